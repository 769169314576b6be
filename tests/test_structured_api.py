"""Structured outputs at the client APIs: every form of a constraint reaches the core as the
Constraint it means, every bad one is refused naming its field (HTTP 400 with `param`, gRPC
INVALID_ARGUMENT) and the frontend serves on, its metrics count what it admitted and compiled;
and the CLI client's and loadgen's flags send what they say.

Against a frontend whose core is scripted (tests/test_openai_sampling.py), over the HTTP app in
process and the gRPC API on 127.0.0.1; what a model generates under a constraint is tested with
the worker (tests/test_grammar.py).
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx2
import pytest

from loadgen import BenchmarkConfig
from loadgen.backend import SMALL_SCHEMA, Constrained, Sampling
from loadgen.cli import build_parser, config_from_args
from loadgen.client import build_request as loadgen_request
from loadgen.openai_protocol import chat_body, completion_body
from loadgen.workload import PromptSpec
from scheduler_svc.frontend import validation
from scheduler_svc.frontend.frontend import ApiError, Frontend
from scheduler_svc.frontend.openai.routes import build_app
from scheduler_svc.frontend.validation import MAX_CHOICES
from stepahead.grammars import ANY_JSON_OBJECT, GrammarError, compile_constraint, is_cached
from stepahead.protocol import MAX_CONSTRAINT_BYTES, Constraint
from stepahead.v1 import generation_pb2 as pb
from stepahead_client.client import build_request as client_request
from stepahead_client.client import parse_args as client_args
from tests.live import CALL_TIMEOUT_S
from tests.test_openai_api import assert_names, error_of
from tests.test_openai_sampling import EOS, Scripted, ScriptedCore, scripted, steps_of  # noqa: F401 (a fixture)

pytestmark = pytest.mark.anyio

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
MESSAGES = [{"role": "user", "content": "hi"}]
BASES: dict[str, tuple[str, dict[str, Any]]] = {
    "completions": ("/v1/completions", {"prompt": "hi", "max_tokens": 4}),
    "chat": ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4}),
}
COMPILES = "stepahead_frontend_grammar_compile_seconds_count"
CACHE_HITS = "stepahead_frontend_grammar_compile_cache_hits_total"
CONSTRAINED = "stepahead_constrained_requests_total"


@dataclass
class Served:
    """One frontend over a scripted core: the HTTP API, and `Frontend.admit`, which the gRPC
    API's Generate calls with the request as it arrives (an in-process gRPC server would bind
    grpc.aio to each test's event loop; the gRPC wire itself is tested live, in
    tests/test_structured_services.py)."""

    scripted: Scripted
    http: httpx2.AsyncClient

    @property
    def frontend(self) -> Frontend:
        return self.scripted.frontend

    @property
    def core(self) -> ScriptedCore:
        return self.scripted.core

    def metric(self, name: str, **labels: str) -> float:
        labels["mode"] = self.frontend.config.mode
        return self.frontend.telemetry.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture
async def served(scripted: Scripted) -> AsyncIterator[Served]:  # noqa: F811 (the imported fixture)
    """test_openai_sampling's scripted frontend, with an HTTP client of its own for raw bodies."""
    transport = httpx2.ASGITransport(app=build_app(scripted.frontend))
    async with httpx2.AsyncClient(transport=transport, base_url="http://scripted") as http:
        yield Served(scripted, http)


async def constraint_served(s: Served, call: Awaitable[Any]) -> Constraint | None:
    """The constraint the core got for `call` (one completion), which then ends with EOS."""
    task = asyncio.ensure_future(call)
    specs = await s.scripted.play(task, 1, steps_of([EOS]))
    await task
    return specs[0].params.constraint


async def post(s: Served, endpoint: str, body: dict[str, Any]) -> httpx2.Response:
    path, base = BASES[endpoint]
    return await s.http.post(path, json={**base, **body}, timeout=CALL_TIMEOUT_S)


async def posted(s: Served, endpoint: str, body: dict[str, Any]) -> httpx2.Response:
    """`post`, checked for success."""
    response = await post(s, endpoint, body)
    assert response.status_code == 200, response.text
    return response


async def generate(s: Served, sampling: pb.SamplingParams) -> None:
    """A GenerateRequest as the gRPC API admits it, read to its end; ApiError when refused."""
    call = await s.frontend.admit(pb.GenerateRequest(text="hi", sampling=sampling))
    async with asyncio.timeout(CALL_TIMEOUT_S):
        while not call.done:
            await call.ready.wait()
            call.take()


def sampling(**structured: Any) -> pb.SamplingParams:
    return pb.SamplingParams(max_new_tokens=4, **structured)


def fresh_regex() -> str:
    """A regex no test compiled before (the cache is the process's)."""
    return f"id-{uuid.uuid4().hex}"


# ---- HTTP: each form, the Constraint it is -------------------------------------------------------


def json_schema_format(schema: dict[str, Any] | None = None, **more: Any) -> dict[str, Any]:
    inner: dict[str, Any] = {"name": "city", **more}
    if schema is not None:
        inner["schema"] = schema
    return {"response_format": {"type": "json_schema", "json_schema": inner}}


HTTP_FORMS: list[tuple[dict[str, Any], Constraint | None]] = [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, Constraint("json", ANY_JSON_OBJECT)),
    (json_schema_format(SCHEMA, strict=True), Constraint("json", json.dumps(SCHEMA))),
    (json_schema_format(SCHEMA, strict=False, description="a city"), Constraint("json", json.dumps(SCHEMA))),
    (json_schema_format(), Constraint("json", "{}")),  # no schema: any JSON, as vLLM
    ({"structured_outputs": {"json": SCHEMA}}, Constraint("json", json.dumps(SCHEMA))),
    ({"structured_outputs": {"json": '{"type": "array"}'}}, Constraint("json", '{"type": "array"}')),
    ({"structured_outputs": {"regex": "[0-9]+"}}, Constraint("regex", "[0-9]+")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, Constraint("choice", '["yes", "no"]')),
    ({"structured_outputs": {"grammar": 'start: "a"'}}, Constraint("grammar", 'start: "a"')),
    ({"structured_outputs": {"json_object": True}}, Constraint("json", ANY_JSON_OBJECT)),
    ({"structured_outputs": {"json_object": False, "regex": "b"}}, Constraint("regex", "b")),
    ({"guided_json": SCHEMA}, Constraint("json", json.dumps(SCHEMA))),
    ({"guided_regex": "[a-z]"}, Constraint("regex", "[a-z]")),
    ({"guided_choice": ["x", "y"]}, Constraint("choice", '["x", "y"]')),
    ({"guided_grammar": 'start: "b"'}, Constraint("grammar", 'start: "b"')),
    ({"response_format": {"type": "text"}, "guided_regex": "c"}, Constraint("regex", "c")),
]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize(("body", "expected"), HTTP_FORMS, ids=[json.dumps(b)[:60] for b, _ in HTTP_FORMS])
async def test_each_http_form_reaches_the_core_as_its_constraint(
    served: Served, endpoint: str, body: dict[str, Any], expected: Constraint | None
) -> None:
    assert await constraint_served(served, posted(served, endpoint, body)) == expected


async def test_the_openai_client_s_response_format_reaches_the_core(served: Served) -> None:
    response_format: Any = {
        "type": "json_schema",
        "json_schema": {"name": "city", "schema": SCHEMA, "strict": True},
    }
    create = served.scripted.client.chat.completions.create(
        model="scripted",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        response_format=response_format,
    )
    assert await constraint_served(served, create) == Constraint("json", json.dumps(SCHEMA))


async def test_a_streamed_constrained_request_is_served(served: Served) -> None:
    body = {"stream": True, "structured_outputs": {"choice": ["a"]}}
    assert await constraint_served(served, posted(served, "chat", body)) == Constraint("choice", '["a"]')


# ---- HTTP: refusals ------------------------------------------------------------------------------

TOO_LONG = "a" * (MAX_CONSTRAINT_BYTES + 1)
HTTP_BAD: list[tuple[dict[str, Any], str]] = [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {}}, "response_format.type"),
    ({"response_format": "json_object"}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
        "response_format.json_schema.name",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}},
        "response_format.json_schema.name",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "n" * 65}}},
        "response_format.json_schema.name",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": "{}"}}},
        "response_format.json_schema.schema",
    ),
    (json_schema_format({"type": "nope"}), "response_format.json_schema.schema"),
    (json_schema_format(SCHEMA, strict="yes"), "response_format.json_schema.strict"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": 7}}, "structured_outputs.regex"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": [1]}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": {"type": "object", "minProperties": "x"}}}, "structured_outputs.json"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"choice": ["a", ""]}}, "structured_outputs.choice[1]"),
    ({"structured_outputs": {"choice": ["a"] * (MAX_CHOICES + 1)}}, "structured_outputs.choice"),
    ({"structured_outputs": {"grammar": "start: foo"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"guided_json": {"type": 5}}, "guided_json"),
    ({"guided_regex": TOO_LONG}, "guided_regex"),
    ({"guided_choice": [""]}, "guided_choice[0]"),
    ({"guided_grammar": ""}, "guided_grammar"),
    # two constraints: the second is named
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.choice"),
    (
        {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
        "structured_outputs.regex",
    ),
    (json_schema_format(SCHEMA) | {"guided_json": SCHEMA}, "guided_json"),
    ({"structured_outputs": {"grammar": 'start: "a"'}, "guided_regex": "a"}, "guided_regex"),
]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize(("body", "param"), HTTP_BAD, ids=[f"{p}-{json.dumps(b)[:50]}" for b, p in HTTP_BAD])
async def test_a_bad_constraint_is_400_naming_its_http_field(
    served: Served, endpoint: str, body: dict[str, Any], param: str
) -> None:
    error = error_of(await post(served, endpoint, body), 400)
    assert error["type"] == "invalid_request_error"
    assert_names(error, param)
    assert served.core.specs == []  # nothing reached the core
    still = await constraint_served(served, posted(served, endpoint, {"guided_regex": "ok"}))
    assert still == Constraint("regex", "ok")


async def test_two_constraints_are_named_in_the_message(served: Served) -> None:
    body = {"response_format": {"type": "json_object"}, "guided_choice": ["a"]}
    error = error_of(await post(served, "chat", body), 400)
    assert error["message"] == (
        "guided_choice: one structured-output constraint per request, got response_format, guided_choice"
    )


async def test_a_compile_failure_gives_its_reason(served: Served) -> None:
    error = error_of(await post(served, "chat", json_schema_format({"type": "nope"})), 400)
    assert error["message"] == "response_format.json_schema.schema: Invalid type: nope"


# ---- gRPC ----------------------------------------------------------------------------------------

GRPC_FORMS: list[tuple[dict[str, Any], Constraint | None]] = [
    ({}, None),
    ({"json_schema": json.dumps(SCHEMA)}, Constraint("json", json.dumps(SCHEMA))),
    ({"json_object": True}, Constraint("json", ANY_JSON_OBJECT)),
    ({"json_object": False}, None),
    ({"regex": "[0-9]+"}, Constraint("regex", "[0-9]+")),
    ({"choice": pb.Choices(choices=["yes", "no"])}, Constraint("choice", '["yes", "no"]')),
    ({"grammar": 'start: "a"'}, Constraint("grammar", 'start: "a"')),
]


@pytest.mark.parametrize(("structured", "expected"), GRPC_FORMS, ids=[str(f)[:40] for f, _ in GRPC_FORMS])
async def test_each_grpc_form_reaches_the_core_as_its_constraint(
    served: Served, structured: dict[str, Any], expected: Constraint | None
) -> None:
    assert await grpc_constraint(served, sampling(**structured)) == expected


async def grpc_constraint(s: Served, params: pb.SamplingParams) -> Constraint | None:
    return await constraint_served(s, generate(s, params))


GRPC_BAD: list[tuple[dict[str, Any], str]] = [
    ({"json_schema": ""}, "sampling.structured.json_schema: must not be empty"),
    ({"json_schema": "{"}, "sampling.structured.json_schema: "),
    ({"json_schema": "[1]"}, "sampling.structured.json_schema: a JSON Schema is an object"),
    ({"json_schema": '{"type": "nope"}'}, "sampling.structured.json_schema: Invalid type: nope"),
    ({"regex": ""}, "sampling.structured.regex: must not be empty"),
    ({"regex": "("}, "sampling.structured.regex: "),
    ({"regex": TOO_LONG}, f"sampling.structured.regex: at most {MAX_CONSTRAINT_BYTES} bytes of UTF-8"),
    ({"choice": pb.Choices()}, "sampling.structured.choice.choices: must not be empty"),
    ({"choice": pb.Choices(choices=["a", ""])}, "sampling.structured.choice.choices[1]: must not be empty"),
    (
        {"choice": pb.Choices(choices=["a"] * (MAX_CHOICES + 1))},
        f"sampling.structured.choice.choices: at most {MAX_CHOICES} choices",
    ),
    (
        {"choice": pb.Choices(choices=["é" * (MAX_CONSTRAINT_BYTES // 2)])},
        "sampling.structured.choice.choices: at most",
    ),
    ({"grammar": ""}, "sampling.structured.grammar: must not be empty"),
    ({"grammar": "start: foo"}, 'sampling.structured.grammar: at 1(8): unknown name: "foo"'),
]


@pytest.mark.parametrize(("structured", "message"), GRPC_BAD, ids=[m[:50] for _, m in GRPC_BAD])
async def test_a_bad_grpc_constraint_is_invalid_argument_naming_its_field(
    served: Served, structured: dict[str, Any], message: str
) -> None:
    with pytest.raises(ApiError) as refused:
        await generate(served, sampling(**structured))
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert str(refused.value).startswith(message), str(refused.value)
    assert served.core.specs == []
    still = await grpc_constraint(served, sampling(regex="ok"))
    assert still == Constraint("regex", "ok")


# ---- metrics and where compiles run --------------------------------------------------------------


async def test_metrics_count_constrained_requests_compiles_and_cache_hits(served: Served) -> None:
    regex = fresh_regex()
    before = (served.metric(COMPILES), served.metric(CACHE_HITS), served.metric(CONSTRAINED, kind="regex"))
    await constraint_served(served, posted(served, "chat", {"guided_regex": regex}))
    assert (served.metric(COMPILES), served.metric(CACHE_HITS), served.metric(CONSTRAINED, kind="regex")) == (
        before[0] + 1,
        before[1],
        before[2] + 1,
    )
    await grpc_constraint(served, sampling(regex=regex))  # the same, over gRPC: cached
    assert (served.metric(COMPILES), served.metric(CACHE_HITS), served.metric(CONSTRAINED, kind="regex")) == (
        before[0] + 1,
        before[1] + 1,
        before[2] + 2,
    )
    choices = served.metric(CONSTRAINED, kind="choice")
    await constraint_served(served, posted(served, "completions", {"structured_outputs": {"choice": ["a"]}}))
    assert served.metric(CONSTRAINED, kind="choice") == choices + 1


async def test_refused_and_unconstrained_requests_are_not_counted(served: Served) -> None:
    kinds = ("json", "regex", "choice", "grammar")
    before = [served.metric(CONSTRAINED, kind=kind) for kind in kinds]
    error_of(await post(served, "chat", {"guided_regex": "("}), 400)
    await constraint_served(served, posted(served, "chat", {}))
    assert [served.metric(CONSTRAINED, kind=kind) for kind in kinds] == before


async def test_an_uncached_constraint_compiles_off_the_event_loop(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    loop_thread, threads = threading.current_thread(), []

    def recording(constraint: Constraint) -> str:
        threads.append(threading.current_thread())
        return compile_constraint(constraint)

    monkeypatch.setattr(validation, "compile_constraint", recording)
    regex = fresh_regex()
    for _ in range(2):
        await constraint_served(served, posted(served, "chat", {"guided_regex": regex}))
    assert threads[0] is not loop_thread  # compiled on a thread
    assert threads[1] is loop_thread  # a cache lookup: on the loop


def test_is_cached_tells_a_compiled_constraint_from_one_that_failed() -> None:
    good, bad = Constraint("regex", fresh_regex()), Constraint("regex", "(" + fresh_regex())
    assert not is_cached(good)
    compile_constraint(good)
    assert is_cached(good)
    with pytest.raises(GrammarError):
        compile_constraint(bad)
    assert not is_cached(bad)


# ---- the CLI client ------------------------------------------------------------------------------


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    schema, grammar = tmp_path / "schema.json", tmp_path / "g.lark"
    schema.write_text(json.dumps(SCHEMA))
    grammar.write_text('start: "yes" | "no"\n')
    return {"SCHEMA_FILE": str(schema), "GRAMMAR_FILE": str(grammar)}


CLIENT_FLAGS: list[tuple[list[str], str | None, Any]] = [
    ([], None, None),
    (["--json-schema", '{"type": "object"}'], "json_schema", '{"type": "object"}'),
    (["--json-schema", "SCHEMA_FILE"], "json_schema", json.dumps(SCHEMA)),
    (["--json-object"], "json_object", True),
    (["--regex", "[0-9]+"], "regex", "[0-9]+"),
    (["--choice", "yes", "--choice", "no"], "choice", ["yes", "no"]),
    (["--grammar", "GRAMMAR_FILE"], "grammar", 'start: "yes" | "no"\n'),
]


@pytest.mark.parametrize(
    ("flags", "which", "value"), CLIENT_FLAGS, ids=[" ".join(f)[:30] for f, _, _ in CLIENT_FLAGS]
)
def test_client_flags_set_the_constraint(
    files: dict[str, str], flags: list[str], which: str | None, value: Any
) -> None:
    args = client_args(["hi", *(files.get(flag, flag) for flag in flags)])
    request = client_request(args)
    assert request.sampling.WhichOneof("structured") == which
    if which == "choice":
        assert list(request.sampling.choice.choices) == value
    elif which is not None:
        assert getattr(request.sampling, which) == value


@pytest.mark.parametrize(
    ("flags", "complaint"),
    [
        (["--regex", "a", "--json-object"], "not allowed with"),
        (["--choice", "a", "--grammar", "g"], "not allowed with"),
        (["--grammar", "/nonexistent/g.lark"], "--grammar: cannot read"),
        (["--json-schema", "/nonexistent/s.json"], "--json-schema: cannot read"),
    ],
)
def test_client_refuses_two_constraints_or_a_missing_file(
    flags: list[str], complaint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        client_args(["hi", *flags])
    assert complaint in capsys.readouterr().err


# ---- loadgen -------------------------------------------------------------------------------------


def test_constrained_fraction_spreads_evenly_over_the_indices() -> None:
    assert [i for i in range(12) if Constrained(0.25).applies(i)] == [3, 7, 11]
    assert sum(Constrained(0.25).applies(i) for i in range(1000)) == 250
    assert not any(Constrained().applies(i) for i in range(100))
    assert all(Constrained(1.0).applies(i) for i in range(100))


LOADGEN_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "loadgen", "schema": json.loads(SMALL_SCHEMA)},
}


def test_loadgen_constrains_its_chosen_requests_over_every_backend() -> None:
    half = Sampling(0.0, False, constrained=Constrained(0.5))
    text = PromptSpec("hi", 8)
    for index in range(4):
        constrained = index % 2 == 1
        assert loadgen_request(text, half, index).sampling.json_schema == (
            SMALL_SCHEMA if constrained else ""
        )
        for body in (completion_body(text, "m", half, index), chat_body(text, "m", half, index)):
            assert body.get("response_format") == (LOADGEN_FORMAT if constrained else None)


def test_loadgen_s_schema_compiles() -> None:
    compile_constraint(Constraint("json", SMALL_SCHEMA))


def parse_loadgen(*argv: str) -> BenchmarkConfig:
    return config_from_args(build_parser().parse_args(list(argv)))


def test_loadgen_flags(tmp_path: Path) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    assert parse_loadgen().constrained == Constrained()
    assert parse_loadgen("--constrained-fraction", "0.25").constrained == Constrained(0.25)
    assert parse_loadgen("--json-schema", str(schema)).constrained == Constrained(1.0, json.dumps(SCHEMA))
    both = parse_loadgen("--json-schema", str(schema), "--constrained-fraction", "0.1")
    assert both.constrained == Constrained(0.1, json.dumps(SCHEMA))


@pytest.mark.parametrize(
    ("flags", "complaint"),
    [
        (["--constrained-fraction", "1.5"], "constrained fraction must be in [0, 1]"),
        (["--constrained-fraction", "nan"], "constrained fraction must be in [0, 1]"),
        (["--json-schema", "MISSING"], "--json-schema: cannot read"),
        (["--json-schema", "NOT_AN_OBJECT"], "a JSON Schema is a JSON object"),
        (["--json-schema", "NOT_JSON"], "is not valid JSON"),
    ],
)
def test_loadgen_refuses_bad_constrained_flags(tmp_path: Path, flags: list[str], complaint: str) -> None:
    (tmp_path / "a.json").write_text("[1]")
    (tmp_path / "b.json").write_text("{nope")
    paths = {"MISSING": "missing.json", "NOT_AN_OBJECT": "a.json", "NOT_JSON": "b.json"}
    with pytest.raises(ValueError, match=re.escape(complaint)):
        parse_loadgen(*(str(tmp_path / paths[flag]) if flag in paths else flag for flag in flags))


async def test_loadgen_s_requests_reach_the_core_constrained(served: Served) -> None:
    constrained = Sampling(0.0, False, constrained=Constrained(1.0))
    expected = Constraint("json", SMALL_SCHEMA)
    over_grpc = loadgen_request(PromptSpec("hi", 4), constrained)
    assert await constraint_served(served, generate(served, over_grpc.sampling)) == expected
    for body, endpoint in (
        (completion_body(PromptSpec("hi", 4), "scripted", constrained), "/v1/completions"),
        (chat_body(PromptSpec("hi", 4), "scripted", constrained), "/v1/chat/completions"),
    ):
        call = served.http.post(endpoint, json=body, timeout=CALL_TIMEOUT_S)
        assert await constraint_served(served, call) == expected
