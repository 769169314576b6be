"""The sampling features over the OpenAI-compatible HTTP API, through the official `openai`
client: `n`, penalties, `logit_bias`, `min_tokens` and log-probabilities.

The response formats are checked against a frontend whose core is scripted by the test (each
step's tokens and log-probabilities written down, sent once the reader took the previous
step); what the features do to the output, against live processes on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import httpx2
import openai
import pytest

from scheduler_svc.contract import CoreRequestSpec, FinishReason, StepOutputs, TokenLogprob
from scheduler_svc.frontend.frontend import Frontend, FrontendConfig
from scheduler_svc.frontend.openai.routes import build_app
from scheduler_svc.frontend.tokenizer import ByteTokenizer
from stepahead.processes import Service, serving_pair
from stepahead.protocol import TokenizerSpec, WorkerInfo
from stepahead.v1 import generation_pb2 as pb
from stepahead.v1 import generation_pb2_grpc
from tests.live import (
    CALL_TIMEOUT_S,
    FRONTEND_COUNTS,
    SETTLE_TIMEOUT_S,
    frontend_flags,
    server_info,
    unused_port,
    wait_all_free,
)
from tests.test_openai_api import assert_names, assert_still_serves, error_of

pytestmark = pytest.mark.anyio

EOS = 257
CHAT_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"
SCRIPTED_TOKENIZER = TokenizerSpec("byte", chat_template=CHAT_TEMPLATE)
SCRIPTED_INFO = WorkerInfo("scripted", 258, 512, (EOS,), 256, 4096, 64, "host", SCRIPTED_TOKENIZER)
TOP = 2  # alternatives per scripted token
E_ACUTE = (0xC3, 0xA9)  # "é": its first byte alone has no text yet

# ---- a scripted core -----------------------------------------------------------------------------


class ScriptedCore:
    """Runs nothing: the test sends the frontend each step's outputs itself."""

    def __init__(self) -> None:
        self.specs: list[CoreRequestSpec] = []
        self.aborted: list[int] = []

    def add(self, spec: CoreRequestSpec) -> None:
        self.specs.append(spec)

    def abort(self, handle: int) -> None:
        self.aborted.append(handle)

    async def abort_request(self, rid: str) -> bool:
        return False

    async def server_info(self) -> pb.GetServerInfoResponse:
        return pb.GetServerInfoResponse()

    async def exposition(self) -> bytes:
        return b"# scripted\n"


Step = list[tuple[int, int, FinishReason | None]]  # (completion index, token, finish)


@dataclass
class Scripted:
    frontend: Frontend
    core: ScriptedCore
    client: openai.AsyncOpenAI
    played: int = 0  # specs of earlier calls

    async def play(self, call: asyncio.Future[Any], n: int, steps: list[Step]) -> list[CoreRequestSpec]:
        """Once the call's n completions are added, each step, after the reader took the last;
        with log-probabilities where the request asked for them, as the core sends them."""
        specs = await self._specs(call, n)
        streams = [self.frontend.clients[spec.handle].stream for spec in specs]
        for step in steps:
            outputs = StepOutputs()
            for index, token, finish in step:
                outputs.add(specs[index].handle, token, finish, scripted_logprob(token, specs[index]))
            self.frontend.send(outputs)
            await until(lambda: not any(s.has_news for s in streams))
        return specs

    async def _specs(self, call: asyncio.Future[Any], n: int) -> list[CoreRequestSpec]:
        await until(lambda: call.done() or len(self.core.specs) >= self.played + n)
        if call.done():
            raise AssertionError(f"the call ended before its completions were added: {call.result()}")
        specs, self.played = self.core.specs[self.played :], self.played + n
        assert [spec.index for spec in specs] == list(range(n))
        return specs


async def until(condition: Callable[[], bool]) -> None:
    """Checked after each turn of the loop the app runs on, until it holds (a hang guard of
    SETTLE_TIMEOUT_S: it takes a few turns)."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"the scripted call never got there in {SETTLE_TIMEOUT_S:g}s")
        await asyncio.sleep(0)


def scripted_logprob(token: int, spec: CoreRequestSpec) -> TokenLogprob | None:
    """Made-up values: the token itself at -0.25 (-inf for "z"), ids 0, 1, ... below it."""
    if not spec.params.logprobs:
        return None
    top = spec.params.top_logprobs
    chosen = -math.inf if token == ord("z") else -0.25
    return TokenLogprob(chosen, tuple(range(top)), tuple(-1.0 - i for i in range(top)))


@pytest.fixture
async def scripted() -> AsyncIterator[Scripted]:
    core = ScriptedCore()
    frontend = Frontend(FrontendConfig())
    frontend.core = core
    frontend.worker_state(SCRIPTED_INFO, True)
    transport = httpx2.ASGITransport(app=build_app(frontend))
    async with (
        httpx2.AsyncClient(transport=transport, base_url="http://scripted") as http,
        openai.AsyncOpenAI(
            base_url="http://scripted/v1", api_key="unchecked", max_retries=0, http_client=http
        ) as client,
    ):
        yield Scripted(frontend, core, client)


def steps_of(tokens: list[int], finish: FinishReason = FinishReason.STOP, index: int = 0) -> list[Step]:
    """One token a step; the finish comes with the last."""
    return [[(index, t, finish if i == len(tokens) - 1 else None)] for i, t in enumerate(tokens)]


async def scripted_call(s: Scripted, create: Any, n: int, steps: list[Step]) -> Any:
    call = asyncio.ensure_future(create)
    await s.play(call, n, steps)
    return await call


# ---- chat log-probabilities ----------------------------------------------------------------------

# "a", then "é" in two tokens, then "x" held back as the possible start of the stop string
# "xy" until "b" shows it is not one, then EOS.
HELD_BACK = [ord("a"), *E_ACUTE, ord("x"), ord("b"), EOS]
HELD_BACK_CHUNKS = [("a", [ord("a")]), ("é", list(E_ACUTE)), ("xb", [ord("x"), ord("b")]), ("", [EOS])]


def chat_args(**more: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": "hi"}]
    return {"model": "scripted", "messages": messages, "max_tokens": 16, **more}


async def test_chat_stream_chunks_carry_the_logprobs_of_held_back_tokens(scripted: Scripted) -> None:
    args = chat_args(stop=["xy"], logprobs=True, top_logprobs=TOP, stream=True)
    stream = await scripted_call(
        scripted, scripted.client.chat.completions.create(**args), 1, steps_of(HELD_BACK)
    )
    chunks = [chunk async for chunk in stream][1:]  # after the role
    got = [
        (c.choices[0].delta.content or "", [e.bytes for e in c.choices[0].logprobs.content]) for c in chunks
    ]
    assert got == [
        (text, [list(bytes((t,))) if t < 256 else [] for t in ids]) for text, ids in HELD_BACK_CHUNKS
    ]
    assert [c.choices[0].finish_reason for c in chunks] == [None, None, None, "stop"]


async def test_chat_logprobs_entries_name_each_token_by_its_bytes(scripted: Scripted) -> None:
    args = chat_args(logprobs=True, top_logprobs=TOP)
    chat = await scripted_call(
        scripted, scripted.client.chat.completions.create(**args), 1, steps_of(HELD_BACK)
    )
    content = chat.choices[0].logprobs.content
    assert [(e.token, e.bytes) for e in content[:3]] == [
        ("a", [0x61]),
        ("\ufffd", [0xC3]),
        ("\ufffd", [0xA9]),
    ]
    assert content[-1].token == "" and content[-1].bytes == []  # EOS: no text
    assert all(e.logprob == -0.25 for e in content)
    tops = [[(t.token, t.logprob, t.bytes) for t in e.top_logprobs] for e in content]
    assert tops == [[("\x00", -1.0, [0]), ("\x01", -2.0, [1])]] * len(HELD_BACK)
    assert chat.choices[0].message.content == "aéxb"


async def test_chat_whole_logprobs_are_the_streamed_ones(scripted: Scripted) -> None:
    args = chat_args(stop=["xy"], logprobs=True, top_logprobs=TOP)
    whole = await scripted_call(
        scripted, scripted.client.chat.completions.create(**args), 1, steps_of(HELD_BACK)
    )
    create = scripted.client.chat.completions.create(**args, stream=True)
    stream = await scripted_call(scripted, create, 1, steps_of(HELD_BACK))
    streamed = [e for c in [c async for c in stream][1:] for e in c.choices[0].logprobs.content]
    assert streamed == whole.choices[0].logprobs.content


async def test_chat_without_logprobs_has_none(scripted: Scripted) -> None:
    args = chat_args()
    chat = await scripted_call(
        scripted, scripted.client.chat.completions.create(**args), 1, steps_of(HELD_BACK)
    )
    assert chat.choices[0].logprobs is None


# ---- completions log-probabilities ---------------------------------------------------------------

# "a", "é" in two tokens, a lone first byte (U+FFFD in the text), "z" (a log-probability of
# -inf), "b"; the length ends it.
OFFSETS = [ord("a"), *E_ACUTE, E_ACUTE[0], ord("z"), ord("b")]
OFFSETS_TEXT = "aé\ufffdzb"


def completion_args(**more: Any) -> dict[str, Any]:
    return {"model": "scripted", "prompt": "hi", "max_tokens": len(OFFSETS), **more}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("include", [False, True], ids=["cut-before", "included"])
async def test_a_stop_string_is_left_out_or_included(scripted: Scripted, stream: bool, include: bool) -> None:
    """vLLM's include_stop_str_in_output: the text ends after the stop string instead of before."""
    extra = {"include_stop_str_in_output": True} if include else {}
    create = scripted.client.completions.create(
        **completion_args(stop=["xy"], stream=stream, max_tokens=16, extra_body=extra)
    )
    done = await scripted_call(scripted, create, 1, steps_of(list(b"abxy")))
    chunks = [chunk async for chunk in done] if stream else [done]
    text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    assert text == ("abxy" if include else "ab") and chunks[-1].choices[0].finish_reason == "stop"
    last = chunks[-1].choices[0].model_dump()
    assert last["stop_reason"] == "xy"  # vLLM's: what ended it
    assert all(chunk.choices[0].model_dump()["stop_reason"] is None for chunk in chunks[:-1])


@pytest.mark.parametrize(
    ("ending", "finish", "stop_reason"),
    [
        ([ord("q")], FinishReason.STOP, ord("q")),  # a stop token of the request's
        ([EOS], FinishReason.STOP, None),  # the end of sequence is no stop reason
        ([ord("c")], FinishReason.LENGTH, None),
    ],
    ids=["stop-token", "eos", "length"],
)
async def test_stop_reason_names_the_stop_token_and_only_that(
    scripted: Scripted, ending: list[int], finish: FinishReason, stop_reason: int | None
) -> None:
    extra = {"stop_token_ids": [ord("q")]}
    for create in (scripted.client.completions.create, scripted.client.chat.completions.create):
        args = completion_args(max_tokens=3, extra_body=extra)
        if create == scripted.client.chat.completions.create:
            args = {**chat_args(max_tokens=3), "extra_body": extra}
        done = await scripted_call(
            scripted, create(**args), 1, steps_of([ord("a"), ord("b"), *ending], finish)
        )
        assert done.choices[0].model_dump()["stop_reason"] == stop_reason


async def test_completion_logprobs_are_openai_s_legacy_lists(scripted: Scripted) -> None:
    create = scripted.client.completions.create(**completion_args(logprobs=TOP))
    done = await scripted_call(scripted, create, 1, steps_of(OFFSETS, FinishReason.LENGTH))
    logprobs = done.choices[0].logprobs
    assert done.choices[0].text == OFFSETS_TEXT
    assert logprobs.tokens == ["a", "\ufffd", "\ufffd", "\ufffd", "z", "b"]
    assert logprobs.token_logprobs == [-0.25, -0.25, -0.25, -0.25, -9999.0, -0.25]  # -inf is not JSON
    assert logprobs.text_offset == [0, 1, 1, 2, 3, 4]  # where each token starts in the text
    alternatives = {"\x00": -1.0, "\x01": -2.0}
    assert logprobs.top_logprobs[0] == {**alternatives, "a": -0.25}  # the sampled token too
    assert logprobs.top_logprobs[4] == {**alternatives, "z": -9999.0}


async def test_completion_stream_logprobs_join_to_the_whole_ones(scripted: Scripted) -> None:
    args = completion_args(logprobs=TOP)
    steps = steps_of(OFFSETS, FinishReason.LENGTH)
    whole = await scripted_call(scripted, scripted.client.completions.create(**args), 1, steps)
    stream = await scripted_call(scripted, scripted.client.completions.create(**args, stream=True), 1, steps)
    chunks = [chunk async for chunk in stream]
    assert [c.choices[0].text for c in chunks] == ["a", "é", "\ufffdz", "b"]
    lists = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    joined = {name: [x for c in chunks for x in getattr(c.choices[0].logprobs, name)] for name in lists}
    assert joined == {name: getattr(whole.choices[0].logprobs, name) for name in lists}


async def test_completion_logprobs_zero_is_the_sampled_token_alone(scripted: Scripted) -> None:
    create = scripted.client.completions.create(**completion_args(logprobs=0))
    done = await scripted_call(scripted, create, 1, [[(0, 0x61, FinishReason.LENGTH)]])
    assert done.choices[0].logprobs.top_logprobs == [{"a": -0.25}]


# ---- n choices -----------------------------------------------------------------------------------

# Choice 1 ends first, on its stop token; choice 0 runs to its length.
INTERLEAVED: list[Step] = [
    [(0, ord("a"), None), (1, ord("b"), None)],
    [(1, EOS, FinishReason.STOP)],
    [(0, ord("c"), FinishReason.LENGTH)],
]


async def test_n_chat_stream_interleaves_the_choices_by_index(scripted: Scripted) -> None:
    args = chat_args(n=2, max_tokens=2, stream=True, stream_options={"include_usage": True})
    stream = await scripted_call(scripted, scripted.client.chat.completions.create(**args), 2, INTERLEAVED)
    chunks = [chunk async for chunk in stream]
    roles, rest, usage = chunks[:2], chunks[2:-1], chunks[-1]
    assert [(c.choices[0].index, c.choices[0].delta.role) for c in roles] == [
        (0, "assistant"),
        (1, "assistant"),
    ]
    got = [(c.choices[0].index, c.choices[0].delta.content, c.choices[0].finish_reason) for c in rest]
    assert got == [(0, "a", None), (1, "b", None), (1, None, "stop"), (0, "c", "length")]
    assert usage.choices == [] and usage.usage is not None
    assert (usage.usage.prompt_tokens, usage.usage.completion_tokens) == (2, 4)  # "hi"; 2 + 2 tokens


async def test_n_completion_has_a_choice_per_index_with_its_own_finish(scripted: Scripted) -> None:
    create = scripted.client.completions.create(**completion_args(n=2, max_tokens=2))
    done = await scripted_call(scripted, create, 2, INTERLEAVED)
    assert [(c.index, c.text, c.finish_reason) for c in done.choices] == [
        (0, "ac", "length"),
        (1, "b", "stop"),
    ]
    assert done.usage is not None and done.usage.completion_tokens == 4


async def test_a_failed_completion_fails_the_call_and_ends_the_others(scripted: Scripted) -> None:
    call = asyncio.ensure_future(scripted.client.completions.create(**completion_args(n=3)))
    specs = await scripted.play(call, 3, [[(0, ord("a"), None), (1, ord("b"), None)]])
    refused = StepOutputs(errors=[(specs[2].handle, "RESOURCE_EXHAUSTED", "no room for it")])
    scripted.frontend.send(refused)
    with pytest.raises(openai.RateLimitError):
        await call
    assert sorted(scripted.core.aborted) == [specs[0].handle, specs[1].handle]


# ---- live processes ------------------------------------------------------------------------------

TINY = ["--model", "tiny"]  # random weights, byte-level tokens: token id = byte
SLOW_SIM = ["--model", "sim", "--sim-step-ms", "20", "--kv-slots", "16384"]
LIVE_TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}|{% endfor %}[assistant] "
PROMPT = "Once upon a time"
MESSAGES: list[Any] = [{"role": "user", "content": PROMPT}]
IGNORE_EOS = {"ignore_eos": True}
SEED = 1234
# Tokens: 160 s or more on the slow sim (its steps take 20 ms at least), a hundred times what a
# test takes to abort such a request: only that abort ends it.
LONG = 8000
Q = ord("Q")
VLLM_FIELDS = ("repetition_penalty", "min_tokens", "stop_token_ids")  # the extra fields
IN_PROCESS_ONLY = pytest.mark.parametrize("tiny", [0], indirect=True, ids=["frontends=0"])


@pytest.fixture(scope="module", params=FRONTEND_COUNTS, ids=lambda n: f"frontends={n}")
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    template = tmp_path_factory.mktemp("chat") / "template.jinja"
    template.write_text(LIVE_TEMPLATE)
    flags = ["--http-port", str(unused_port()), "--chat-template", str(template)]
    with serving_pair(TINY, [*flags, *frontend_flags(request.param)]) as (_, scheduler):
        yield scheduler


@pytest.fixture(scope="module", params=FRONTEND_COUNTS, ids=lambda n: f"frontends={n}")
def slow(request: pytest.FixtureRequest) -> Iterator[Service]:
    flags = ["--http-port", str(unused_port()), *frontend_flags(request.param)]
    with serving_pair(SLOW_SIM, flags) as (_, scheduler):
        yield scheduler


def api(service: Service) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{service.http_url}/v1", api_key="unchecked", max_retries=0, timeout=CALL_TIMEOUT_S
    )


@pytest.fixture
async def client(tiny: Service) -> AsyncIterator[openai.AsyncOpenAI]:
    async with api(tiny) as client:
        yield client


async def complete(client: openai.AsyncOpenAI, max_tokens: int = 12, **more: Any) -> Any:
    """Greedy unless `more` says otherwise; `more` may hold the extra fields as they are."""
    extra: dict[str, Any] = {k: more.pop(k) for k in VLLM_FIELDS if k in more}
    settings: dict[str, Any] = {"temperature": 0, **more}
    return await client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=max_tokens, extra_body={**IGNORE_EOS, **extra}, **settings
    )


async def chat(client: openai.AsyncOpenAI, max_tokens: int = 12, **more: Any) -> Any:
    settings: dict[str, Any] = {"temperature": 0, **more}
    return await client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=max_tokens, extra_body=IGNORE_EOS, **settings
    )


async def greedy_ids(address: str, max_new_tokens: int) -> list[int]:
    sampling = pb.SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        call = stub.Generate(pb.GenerateRequest(text=PROMPT, sampling=sampling), timeout=CALL_TIMEOUT_S)
        return [t async for response in call for t in response.token_ids]


# ---- n -------------------------------------------------------------------------------------------


async def test_n_completions_are_whole_choices_sampled_apart(client: openai.AsyncOpenAI) -> None:
    three = await complete(client, 8, n=3, temperature=1.0, seed=SEED)
    one = await complete(client, 8, temperature=1.0, seed=SEED)
    assert [(c.index, c.finish_reason) for c in three.choices] == [
        (0, "length"),
        (1, "length"),
        (2, "length"),
    ]
    assert three.usage.completion_tokens == 3 * 8 and three.usage.prompt_tokens == len(PROMPT)
    assert three.choices[0].text == one.choices[0].text  # completion 0 keeps the request's seed
    assert len({c.text for c in three.choices}) == 3


async def test_n_chat_stream_joins_to_the_whole_choices(client: openai.AsyncOpenAI) -> None:
    settings: dict[str, Any] = {"n": 3, "temperature": 1.0, "seed": SEED}
    whole = await chat(client, 8, **settings)
    stream = await chat(client, 8, **settings, stream=True, stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    *deltas, usage = chunks
    assert [c.choices[0].delta.role for c in deltas[:3]] == ["assistant"] * 3
    assert [c.choices[0].index for c in deltas[:3]] == [0, 1, 2]
    for choice in whole.choices:
        mine = [c.choices[0] for c in deltas[3:] if c.choices[0].index == choice.index]
        assert "".join(c.delta.content or "" for c in mine) == choice.message.content
        assert [c.finish_reason for c in mine] == [None] * (len(mine) - 1) + ["length"]
    assert usage.usage is not None and usage.usage.completion_tokens == whole.usage.completion_tokens == 24


async def test_n_stream_closed_early_aborts_every_completion(slow: Service) -> None:
    async with api(slow) as client:
        stream = await client.completions.create(
            model="sim", prompt="left", max_tokens=LONG, n=3, stream=True, extra_body=IGNORE_EOS
        )
        await anext(stream)
        info = await server_info(slow.address)
        assert info.requests_running + info.requests_waiting == 3
        await stream.close()
        await wait_all_free(slow.address)


# ---- penalties, logit_bias, min_tokens -----------------------------------------------------------


@pytest.mark.parametrize(
    "penalty",
    [{"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"repetition_penalty": 3.0}],
    ids=["presence", "frequency", "repetition"],
)
async def test_a_penalty_changes_the_greedy_text(client: openai.AsyncOpenAI, penalty: dict[str, Any]) -> None:
    free = await complete(client, 24, logprobs=0)
    assert len(set(free.choices[0].logprobs.tokens)) < 24  # it repeats itself: a penalty has a hold
    penalized = await complete(client, 24, **penalty)
    assert penalized.choices[0].text != free.choices[0].text


async def test_logit_bias_of_100_makes_the_token_the_greedy_one(client: openai.AsyncOpenAI) -> None:
    done = await complete(client, 8, logit_bias={str(Q): 100})
    assert done.choices[0].text == "Q" * 8


async def test_logit_bias_of_minus_100_changes_the_greedy_token(client: openai.AsyncOpenAI) -> None:
    free = await chat(client, 1, logprobs=True)
    [first] = free.choices[0].logprobs.content[0].bytes  # a byte: the token's id
    biased = await chat(client, 1, logprobs=True, logit_bias={str(first): -100})
    assert biased.choices[0].logprobs.content[0].bytes != [first]


async def test_min_tokens_holds_back_a_stop_token(tiny: Service, client: openai.AsyncOpenAI) -> None:
    first = (await greedy_ids(tiny.address, 1))[0]
    stops = {"stop_token_ids": [first]}
    settings: dict[str, Any] = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    free = await client.completions.create(**settings, extra_body=stops)
    held = await client.completions.create(**settings, extra_body={**stops, "min_tokens": 3})
    assert (free.choices[0].finish_reason, free.usage.completion_tokens) == ("stop", 1)
    assert held.usage.completion_tokens >= 3


async def test_grpc_names_the_stop_string_or_stop_token_that_ended_it(tiny: Service) -> None:
    async def responses(**stops: Any) -> list[pb.GenerateResponse]:
        sampling = pb.SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True, **stops)
        async with grpc.aio.insecure_channel(tiny.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            call = stub.Generate(pb.GenerateRequest(text=PROMPT, sampling=sampling), timeout=CALL_TIMEOUT_S)
            return [response async for response in call]

    async def last(**stops: Any) -> pb.GenerateResponse:
        return (await responses(**stops))[-1]

    whole = await responses()
    free = [token for response in whole for token in response.token_ids]
    text = "".join(response.text for response in whole)
    # A piece of the text, not at its start, whose first occurrence is where it is taken from.
    stop = next(text[i : i + 2] for i in range(1, len(text) - 1) if text.find(text[i : i + 2]) == i)
    by_string = await last(stop=[stop])
    assert (by_string.WhichOneof("stop_reason"), by_string.stop_string) == ("stop_string", stop)
    by_token = await last(stop_token_ids=[free[1]])
    assert (by_token.WhichOneof("stop_reason"), by_token.stop_token_id) == ("stop_token_id", free[1])
    assert by_token.finish_reason == pb.FINISH_REASON_STOP
    unstopped = await last()
    assert unstopped.finish_reason == pb.FINISH_REASON_LENGTH and unstopped.WhichOneof("stop_reason") is None


# ---- log-probabilities ---------------------------------------------------------------------------

LIVE_TOP = 5


def descending(values: list[float]) -> bool:
    return all(a >= b for a, b in itertools.pairwise(values))


async def test_chat_logprobs_are_the_greedy_tokens_with_their_alternatives(
    client: openai.AsyncOpenAI,
) -> None:
    done = await chat(client, 12, logprobs=True, top_logprobs=LIVE_TOP)
    content = done.choices[0].logprobs.content
    assert len(content) == done.usage.completion_tokens == 12
    for entry in content:
        assert len(entry.top_logprobs) == LIVE_TOP and len(entry.bytes) == 1
        assert descending([t.logprob for t in entry.top_logprobs]) and entry.logprob <= 0
        best = entry.top_logprobs[0]
        assert (best.bytes, best.logprob) == (entry.bytes, entry.logprob)  # greedy: the likeliest
    assert (
        bytes(b for e in content for b in e.bytes).decode(errors="replace") == done.choices[0].message.content
    )


async def test_chat_streamed_logprobs_are_the_whole_ones(client: openai.AsyncOpenAI) -> None:
    whole = await chat(client, 12, logprobs=True, top_logprobs=LIVE_TOP)
    stream = await chat(client, 12, logprobs=True, top_logprobs=LIVE_TOP, stream=True)
    chunks = [chunk async for chunk in stream][1:]  # after the role
    assert [e for c in chunks for e in c.choices[0].logprobs.content] == whole.choices[0].logprobs.content


async def test_completion_logprobs_are_the_greedy_tokens_with_their_alternatives(
    client: openai.AsyncOpenAI,
) -> None:
    done = await complete(client, 12, logprobs=LIVE_TOP)
    logprobs = done.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.text_offset) == 12
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        values = list(top.values())  # token strings may coincide (U+FFFD): then fewer entries
        assert 1 <= len(top) <= LIVE_TOP and descending(values) and top[token] == values[0] == logprob


async def test_completion_streamed_logprobs_are_the_whole_ones(client: openai.AsyncOpenAI) -> None:
    whole = (await complete(client, 12, logprobs=LIVE_TOP)).choices[0].logprobs
    stream = await complete(client, 12, logprobs=LIVE_TOP, stream=True)
    chunks = [chunk.choices[0].logprobs async for chunk in stream]
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for c in chunks for x in getattr(c, name)] == getattr(whole, name), name


async def test_http_logprobs_are_the_grpc_ones(tiny: Service, client: openai.AsyncOpenAI) -> None:
    sampling = pb.SamplingParams(
        max_new_tokens=12, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=LIVE_TOP
    )
    completion = await complete(client, 12, logprobs=LIVE_TOP)
    chat_done = await chat(client, 12, logprobs=True, top_logprobs=LIVE_TOP)
    by_grpc = await grpc_logprobs(tiny.address, pb.GenerateRequest(text=PROMPT, sampling=sampling))
    assert completion.choices[0].logprobs.token_logprobs == [lp.logprob for lp in by_grpc]
    messages = pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in MESSAGES])
    by_grpc = await grpc_logprobs(tiny.address, pb.GenerateRequest(messages=messages, sampling=sampling))
    assert [http_entry(e) for e in chat_done.choices[0].logprobs.content] == [
        grpc_entry(lp) for lp in by_grpc
    ]


Entry = tuple[bytes, float, list[tuple[bytes, float]]]


def http_entry(e: Any) -> Entry:
    return bytes(e.bytes), e.logprob, [(bytes(t.bytes), t.logprob) for t in e.top_logprobs]


def grpc_entry(lp: pb.TokenLogprob) -> Entry:
    spell = ByteTokenizer().token_bytes
    return spell(lp.token_id), lp.logprob, [(spell(t.token_id), t.logprob) for t in lp.top_logprobs]


async def grpc_logprobs(address: str, request: pb.GenerateRequest) -> list[pb.TokenLogprob]:
    async with grpc.aio.insecure_channel(address) as channel:
        call = generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=CALL_TIMEOUT_S)
        return [lp async for response in call for lp in response.logprobs]


# ---- refusals ------------------------------------------------------------------------------------

BASES: dict[str, tuple[str, dict[str, Any]]] = {
    "completions": ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 4}),
    "chat": ("/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": 4}),
}
BAD: list[tuple[str, dict[str, Any], str]] = [
    ("completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("completions", {"presence_penalty": math.nan}, "presence_penalty"),  # sent as a NaN literal
    ("completions", {"frequency_penalty": -2.5}, "frequency_penalty"),
    ("completions", {"frequency_penalty": math.inf}, "frequency_penalty"),
    ("completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("completions", {"repetition_penalty": math.nan}, "repetition_penalty"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"logprobs": -1}, "logprobs"),
    ("completions", {"n": 0}, "n"),
    ("completions", {"n": 17}, "n"),
    ("completions", {"n": -1}, "n"),
    ("completions", {"n": 2, "best_of": 3}, "best_of"),
    ("completions", {"logit_bias": {"258": 1}}, "logit_bias[258]"),  # the vocabulary is 0..257
    ("completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {"-1": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ("completions", {"logit_bias": {"65": 100.5}}, "logit_bias[65]"),
    ("completions", {"logit_bias": {"65": -101}}, "logit_bias[65]"),
    ("completions", {"logit_bias": {"65": math.nan}}, "logit_bias[65]"),
    ("completions", {"min_tokens": 5}, "min_tokens"),  # more than max_tokens
    ("completions", {"min_tokens": -1}, "min_tokens"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs
    ("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("chat", {"n": 17}, "n"),
    ("chat", {"presence_penalty": -2.5}, "presence_penalty"),
]


@IN_PROCESS_ONLY
@pytest.mark.parametrize(("endpoint", "bad", "param"), BAD, ids=[f"{e}-{p}-{b}"[:80] for e, b, p in BAD])
async def test_bad_sampling_field_is_400_naming_it(
    tiny: Service, client: openai.AsyncOpenAI, endpoint: str, bad: dict[str, Any], param: str
) -> None:
    path, base = BASES[endpoint]
    async with httpx2.AsyncClient(timeout=CALL_TIMEOUT_S) as http:
        response = await http.post(
            f"{tiny.http_url}{path}",
            content=json.dumps({**base, **bad}),  # NaN and Infinity as Python writes them
            headers={"content-type": "application/json"},
        )
    error = error_of(response, 400)
    assert error["type"] == "invalid_request_error"
    assert_names(error, param)
    await assert_still_serves(client)
