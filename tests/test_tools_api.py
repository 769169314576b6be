"""Tool calling at the client APIs, over a frontend whose core is scripted
(tests/test_openai_sampling.py): what reaches the core (the prompt with the tools, the grammar of
the calls a request allows), what the client gets back for a reply the core generates (the
official `openai` client: `message.tool_calls`, `finish_reason: tool_calls`, streamed
`delta.tool_calls` that reassemble into the whole response), a conversation that carries calls and
their results, and each bad definition refused with a 400 naming its field while the frontend
serves on. The gRPC forms go through `Frontend.admit`, which Generate calls; the grammars
themselves are walked in tests/test_tools.py, and a real model is held to them in
tests/test_tools_smollm2.py."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx2
import jsonschema
import pytest

from scheduler_svc.contract import FinishReason, StepOutputs
from scheduler_svc.frontend.frontend import ApiError
from scheduler_svc.frontend.openai.routes import build_app
from scheduler_svc.frontend.tools import (
    CALL_OPEN,
    CALL_SEPARATOR,
    Tool,
    ToolCall,
    ToolChoice,
    render_call,
    tool_constraint,
)
from stepahead.v1 import generation_pb2 as pb
from stepahead_client.client import build_request as client_request
from stepahead_client.client import parse_args as client_args
from tests.live import CALL_TIMEOUT_S
from tests.test_openai_api import assert_names, error_of
from tests.test_openai_sampling import EOS, SCRIPTED_INFO, Scripted, Step, scripted, steps_of  # noqa: F401 (a fixture)

pytestmark = pytest.mark.anyio

WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
    "required": ["city"],
    "additionalProperties": False,
}
SUM: dict[str, Any] = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {"name": "add", "description": "a + b", "parameters": SUM, "strict": True},
    },
]
SCHEMAS: dict[str, dict[str, Any]] = {"get_weather": WEATHER, "add": SUM}
AS_TOOLS = [
    Tool("get_weather", "The weather in a city", json.dumps(WEATHER)),
    Tool("add", "a + b", json.dumps(SUM), True),
]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
PARIS = ToolCall("get_weather", json.dumps({"city": "Paris", "unit": "C"}))
SUM_CALL = ToolCall("add", json.dumps({"a": 2, "b": 3}))


@pytest.fixture
def s(scripted: Scripted) -> Scripted:  # noqa: F811 (the imported fixture)
    """The scripted frontend, with room for the tools' system turn (a byte a token, it outgrows
    the scripted model's 512)."""
    scripted.frontend.worker_state(dataclasses.replace(SCRIPTED_INFO, max_context_len=4096), True)
    return scripted


def tokens(text: str) -> list[int]:
    return list(text.encode())


def calls_text(*calls: ToolCall) -> str:
    return CALL_SEPARATOR.join(map(render_call, calls))


async def served_call(s: Scripted, create: Any, reply: str, finish: FinishReason = FinishReason.STOP) -> Any:
    """`create`'s result once its completion generated `reply` then EOS (or `finish` on its last
    token when not STOP); the spec the core got is `s.core.specs[-1]`."""
    call = asyncio.ensure_future(create)
    ids = tokens(reply) + ([EOS] if finish == FinishReason.STOP else [])
    await s.play(call, 1, steps_of(ids, finish))
    return await call


def chat(**more: Any) -> dict[str, Any]:
    return {"model": "scripted", "messages": MESSAGES, "max_tokens": 200, "tools": TOOLS, **more}


def check_call(call: Any, expected: ToolCall) -> None:
    assert call.type == "function" and call.id.startswith("call_") and len(call.id) == 29
    assert (call.function.name, call.function.arguments) == (expected.name, expected.arguments)
    schema: dict[str, Any] = SCHEMAS[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)


# ---- requests: the prompt and the grammar the core gets --------------------------------------------


@pytest.mark.parametrize(
    ("choice", "parallel", "expected"),
    [
        (None, None, ToolChoice("auto")),
        ("auto", False, ToolChoice("auto")),
        ("required", None, ToolChoice("required")),
        ({"type": "function", "function": {"name": "add"}}, True, ToolChoice("named", "add")),
    ],
)
async def test_the_core_gets_the_grammar_of_the_calls_the_request_allows(
    s: Scripted, choice: Any, parallel: bool | None, expected: ToolChoice
) -> None:
    more: dict[str, Any] = {}
    if choice is not None:
        more["tool_choice"] = choice
    if parallel is not None:
        more["parallel_tool_calls"] = parallel
    await served_call(s, s.client.chat.completions.create(**chat(**more)), "")
    spec = s.core.specs[-1]
    assert spec.params.constraint == tool_constraint(AS_TOOLS, expected, parallel is not False)
    prompt = bytes(spec.prompt_ids).decode()
    # The scripted template reads no tools: they come in a system turn first, with the format.
    assert prompt.startswith("You may call these tools") and prompt.endswith(MESSAGES[0]["content"])
    assert '"name": "get_weather"' in prompt and CALL_OPEN in prompt


async def test_none_sends_no_grammar_and_parses_nothing(s: Scripted) -> None:
    reply = "I would " + calls_text(PARIS)
    done = await served_call(s, s.client.chat.completions.create(**chat(tool_choice="none")), reply)
    assert s.core.specs[-1].params.constraint is None
    assert done.choices[0].message.content == reply and done.choices[0].message.tool_calls is None
    assert done.choices[0].finish_reason == "stop"


# ---- responses --------------------------------------------------------------------------------------


async def test_a_required_call_comes_back_as_tool_calls(s: Scripted) -> None:
    create = s.client.chat.completions.create(**chat(tool_choice="required"))
    done = await served_call(s, create, calls_text(PARIS))
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
    check_call(choice.message.tool_calls[0], PARIS)
    assert done.usage.completion_tokens == len(tokens(calls_text(PARIS))) + 1
    labels = {"mode": s.frontend.config.mode, "reason": "tool_calls"}
    assert s.frontend.telemetry.registry.get_sample_value("stepahead_requests_finished_total", labels) == 1


async def test_auto_splits_content_from_parallel_calls_each_with_its_own_id(s: Scripted) -> None:
    reply = "Let me check <that>. " + calls_text(PARIS, SUM_CALL)
    done = await served_call(s, s.client.chat.completions.create(**chat()), reply)
    message = done.choices[0].message
    assert message.content == "Let me check <that>. " and done.choices[0].finish_reason == "tool_calls"
    assert message.tool_calls is not None and len(message.tool_calls) == 2
    check_call(message.tool_calls[0], PARIS)
    check_call(message.tool_calls[1], SUM_CALL)
    assert message.tool_calls[0].id != message.tool_calls[1].id


async def test_auto_without_a_call_is_text(s: Scripted) -> None:
    reply = "It is sunny, no <tool needed."
    done = await served_call(s, s.client.chat.completions.create(**chat()), reply)
    assert done.choices[0].message.content == reply and done.choices[0].message.tool_calls is None
    assert done.choices[0].finish_reason == "stop"


async def test_a_reply_cut_by_length_keeps_the_call_it_was_in(s: Scripted) -> None:
    """As OpenAI: the arguments so far, and finish_reason `length` to say they are cut."""
    cut = calls_text(PARIS)[:-20]
    create = s.client.chat.completions.create(**chat(tool_choice="required"))
    done = await served_call(s, create, cut, FinishReason.LENGTH)
    choice = done.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is not None
    assert choice.message.tool_calls[0].function.name == "get_weather"
    assert PARIS.arguments.startswith(choice.message.tool_calls[0].function.arguments)


@pytest.mark.parametrize("content", ["", "Checking. "])
async def test_streamed_calls_reassemble_into_the_whole_response(s: Scripted, content: str) -> None:
    """OpenAI's chunks: a call's first delta has its index, id, type and name, the next ones
    fragments of its arguments (one per token here: they stream as they come)."""
    reply = content + calls_text(PARIS, SUM_CALL)
    whole = await served_call(s, s.client.chat.completions.create(**chat()), reply)
    stream = await served_call(s, s.client.chat.completions.create(**chat(stream=True)), reply)
    chunks = [chunk async for chunk in stream]
    text, calls, finish, argument_deltas = "", dict[int, dict[str, str]](), None, 0
    for chunk in chunks:
        delta, finish = chunk.choices[0].delta, chunk.choices[0].finish_reason or finish
        text += delta.content or ""
        for d in delta.tool_calls or []:
            if d.id is not None:
                assert d.index not in calls and d.type == "function" and d.function.name
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            else:
                assert d.function.name is None
            calls[d.index]["arguments"] += d.function.arguments or ""
            argument_deltas += bool(d.function.arguments)
    message = whole.choices[0].message
    assert text == (message.content or "") == content and finish == whole.choices[0].finish_reason
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls
    ]
    assert argument_deltas >= len(PARIS.arguments)


async def test_each_of_n_completions_has_its_own_calls(s: Scripted) -> None:
    call = asyncio.ensure_future(s.client.chat.completions.create(**chat(n=2)))
    first, second = [*tokens(calls_text(PARIS)), EOS], [*tokens("No call."), EOS]
    steps: list[Step] = [[(0, first[i], None), (1, second[i], None)] for i in range(len(second) - 1)]
    steps += [[(0, t, None)] for t in first[len(second) - 1 : -1]]
    steps += [[(1, EOS, FinishReason.STOP), (0, EOS, FinishReason.STOP)]]
    await s.play(call, 2, steps)
    done = await call
    by_index = {c.index: c for c in done.choices}
    assert by_index[0].finish_reason == "tool_calls" and by_index[1].finish_reason == "stop"
    check_call(by_index[0].message.tool_calls[0], PARIS)
    assert by_index[1].message.content == "No call." and by_index[1].message.tool_calls is None


# ---- a conversation with calls and their results ------------------------------------------------------


async def test_a_turn_after_a_tool_result(s: Scripted) -> None:
    """The client sends back the assistant turn as the response gave it (content null, its
    tool_calls) and the tool's result; the template that reads no tools gets the calls written
    as the model writes them."""
    create = s.client.chat.completions.create(**chat(tool_choice="required"))
    first = await served_call(s, create, calls_text(PARIS))
    assistant = first.choices[0].message
    result = {"role": "tool", "tool_call_id": assistant.tool_calls[0].id, "content": "18 C, clear"}
    history = [*MESSAGES, assistant.model_dump(exclude_none=True), result]
    create = s.client.chat.completions.create(**chat(messages=history))
    done = await served_call(s, create, "It is 18 C in Paris.")
    assert done.choices[0].message.content == "It is 18 C in Paris."
    prompt = bytes(s.core.specs[-1].prompt_ids).decode()
    assert prompt.endswith(MESSAGES[0]["content"] + calls_text(PARIS) + "18 C, clear")


# ---- refusals -------------------------------------------------------------------------------------------

HUGE_SCHEMA = {"type": "object", "properties": {"x": {"enum": [f"value {i}" for i in range(8000)]}}}
BAD_SCHEMA = {"type": "object", "properties": {"x": {"type": "nonsense"}}}
DUPLICATE = [TOOLS[0], TOOLS[0]]
HTTP_BAD: list[tuple[dict[str, Any], str]] = [
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}]},
        "tools[0].function.parameters",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
        "tools[0].function.parameters",
    ),
    ({"tools": DUPLICATE}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0].function.name"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": HUGE_SCHEMA}}]}, "tools"),
    ({"functions": [{"name": "f"}]}, "functions"),
    (
        {
            "messages": [
                {
                    "role": "user",
                    "content": "x",
                    "tool_calls": [
                        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                    ],
                }
            ]
        },
        "messages[0].tool_calls",
    ),
    (
        {
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
                    ],
                }
            ]
        },
        "messages[0].tool_calls[0].function.arguments",
    ),
    (
        {
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "[1]"}}
                    ],
                }
            ]
        },
        "messages[0].tool_calls[0].function.arguments",
    ),
]


@pytest.fixture
async def http(s: Scripted) -> AsyncIterator[httpx2.AsyncClient]:
    transport = httpx2.ASGITransport(app=build_app(s.frontend))
    async with httpx2.AsyncClient(transport=transport, base_url="http://scripted") as client:
        yield client


@pytest.mark.parametrize(("body", "param"), HTTP_BAD, ids=[p + json.dumps(b)[:40] for b, p in HTTP_BAD])
async def test_each_bad_definition_gets_a_400_naming_its_field_and_serving_goes_on(
    s: Scripted, http: httpx2.AsyncClient, body: dict[str, Any], param: str
) -> None:
    response = await http.post("/v1/chat/completions", json=chat(**body), timeout=CALL_TIMEOUT_S)
    assert_names(error_of(response, 400), param)
    assert s.core.specs == [] and s.frontend.clients == {}
    done = await served_call(
        s, s.client.chat.completions.create(**chat(tool_choice="required")), calls_text(PARIS)
    )
    check_call(done.choices[0].message.tool_calls[0], PARIS)


# ---- gRPC ----------------------------------------------------------------------------------------------


def grpc_chat(**more: Any) -> pb.GenerateRequest:
    tools = [pb.Tool(name=t.name, description=t.description, parameters=t.parameters) for t in AS_TOOLS]
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")], tools=tools, **more)
    return pb.GenerateRequest(messages=chat, sampling=pb.SamplingParams(max_new_tokens=200))


async def test_grpc_streams_the_call_deltas_and_the_tool_calls_finish(s: Scripted) -> None:
    request = grpc_chat(tool_choice=pb.ToolChoice(function="add"), parallel_tool_calls=False)
    completions = await s.frontend.admit(request)
    spec = s.core.specs[-1]
    assert spec.params.constraint == tool_constraint(AS_TOOLS, ToolChoice("named", "add"), False)
    reply = tokens("".join(calls_text(SUM_CALL)))
    for i, token in enumerate(reply):
        last = i == len(reply) - 1
        s.frontend.send(one_output(spec.handle, token, FinishReason.STOP if last else None))
    async with asyncio.timeout(CALL_TIMEOUT_S):
        chunks = []
        while not completions.done:
            await completions.ready.wait()
            chunks += [chunk for _, chunk in completions.take()]
    deltas = [d for c in chunks for d in c.tool_calls]
    assert "".join(c.text for c in chunks) == "" and chunks[-1].finish_reason == FinishReason.TOOL_CALLS
    assert deltas[0].name == "add" and deltas[0].id.startswith("call_")
    assert all(not d.name and d.index == 0 for d in deltas[1:])
    assert "".join(d.arguments for d in deltas) == SUM_CALL.arguments


def one_output(handle: int, token: int, finish: FinishReason | None) -> StepOutputs:
    outputs = StepOutputs()
    outputs.add(handle, token, finish, None)
    return outputs


@pytest.mark.parametrize(
    ("more", "field"),
    [
        (
            {"tools": [pb.Tool(name="f", parameters=json.dumps(BAD_SCHEMA))]},
            "input.messages.tools[0].parameters",
        ),
        ({"tool_choice": pb.ToolChoice(mode="always")}, "input.messages.tool_choice.mode"),
        ({"tool_choice": pb.ToolChoice(function="nope")}, "input.messages.tool_choice.function"),
    ],
)
async def test_grpc_refuses_bad_definitions_naming_their_field(
    s: Scripted, more: dict[str, Any], field: str
) -> None:
    request = grpc_chat()
    if "tools" in more:
        del request.messages.tools[:]
        request.messages.tools.extend(more["tools"])
    else:
        request.messages.tool_choice.CopyFrom(more["tool_choice"])
    with pytest.raises(ApiError) as refused:
        await s.frontend.admit(request)
    assert refused.value.field == field and str(refused.value).startswith(field + ":")
    assert s.core.specs == []


# ---- the CLI client ----------------------------------------------------------------------------------


def test_the_cli_client_sends_a_tools_file(tmp_path: Path) -> None:
    openai_form, bare = tmp_path / "tools.json", tmp_path / "bare.json"
    openai_form.write_text(json.dumps(TOOLS))
    bare.write_text(json.dumps([TOOLS[1]["function"]]))
    flags = ["--chat", "hi", "--tools", str(openai_form), "--tool-choice", "add", "--no-parallel-tool-calls"]
    chat = client_request(client_args(flags)).messages
    assert [(t.name, t.description, json.loads(t.parameters)) for t in chat.tools] == [
        (t.name, t.description, json.loads(t.parameters)) for t in AS_TOOLS
    ]
    assert chat.tools[1].strict and not chat.tools[0].HasField("strict")
    assert chat.tool_choice.function == "add" and chat.HasField("parallel_tool_calls")
    assert not chat.parallel_tool_calls
    chat = client_request(
        client_args(["--chat", "hi", "--tools", str(bare), "--tool-choice", "required"])
    ).messages
    assert [t.name for t in chat.tools] == ["add"] and chat.tool_choice.mode == "required"
    assert not chat.HasField("parallel_tool_calls")
    for bad in (["hi", "--tools", str(bare)], ["--chat", "hi", "--tools", str(tmp_path / "missing.json")]):
        with pytest.raises(SystemExit):
            client_args(bad)
