"""Large work a single request can ask of a frontend, kept off its event loop (where every
stream it serves is written) or bounded: a long prompt is tokenized on a thread; a whole
(unstreamed) response is built a slice at a time, its log-probabilities capped with a 400 that
names the limit and points to streaming.

Against a frontend whose core is scripted by the test (no worker): what is checked is where
and how the frontend does the work, forced, not how long it takes.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx2
import pytest

from scheduler_svc.contract import MIN_TEMPERATURE, FinishReason, TokenLogprob
from scheduler_svc.frontend.api_config import ClientApiConfig
from scheduler_svc.frontend.frontend import OFF_LOOP_INPUT_BYTES, ApiError, Frontend, FrontendConfig
from scheduler_svc.frontend.openai import routes as openai_api
from scheduler_svc.frontend.openai.protocol import ChatLogprobs, CompletionLogprobs, ResponseIds
from scheduler_svc.frontend.openai.routes import Choice, build_app
from scheduler_svc.frontend.tokenizer import ByteTokenizer
from stepahead.protocol import TokenizerSpec, WorkerInfo
from stepahead.v1 import generation_pb2 as pb
from tests.live import SETTLE_TIMEOUT_S
from tests.test_openai_sampling import CHAT_TEMPLATE, ScriptedCore, until

pytestmark = pytest.mark.anyio

CONTEXT = 32768
INFO = WorkerInfo(
    "scripted",
    258,
    CONTEXT,
    (257,),
    256,
    1 << 20,
    64,
    "host",
    TokenizerSpec("byte", chat_template=CHAT_TEMPLATE),
)


class LoopWatchingTokenizer(ByteTokenizer):
    """Tokenizes a large text only once the event loop has run meanwhile: on the loop's own
    thread that never happens (the hang guard fails the test instead of hanging it)."""

    def __init__(self, loop_ran: threading.Event) -> None:
        super().__init__()
        self.loop_ran = loop_ran
        self.threads: list[str] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.threads.append(threading.current_thread().name)
        if len(text) >= OFF_LOOP_INPUT_BYTES:
            assert self.loop_ran.wait(SETTLE_TIMEOUT_S), (
                "the event loop did not run while a prompt was tokenized"
            )
        return super().encode(text, add_special_tokens)


def scripted_frontend() -> tuple[Frontend, ScriptedCore]:
    core = ScriptedCore()
    frontend = Frontend(FrontendConfig())
    frontend.core = core
    frontend.worker_state(INFO, True)
    return frontend, core


@pytest.mark.parametrize("size", [3 * OFF_LOOP_INPUT_BYTES, 1 << 20], ids=["48KiB", "1MiB"])
async def test_a_long_prompt_is_tokenized_off_the_event_loop(size: int) -> None:
    """While it is tokenized the loop keeps turning (a callback it runs releases the tokenizer);
    a prompt over the context is then refused as before, naming the field."""
    frontend, core = scripted_frontend()
    loop_ran = threading.Event()
    tokenizer = LoopWatchingTokenizer(loop_ran)
    frontend.tokenizer = tokenizer
    asyncio.get_running_loop().call_soon(loop_ran.set)
    request = pb.GenerateRequest(text="a" * size, sampling=pb.SamplingParams(max_new_tokens=4))
    with pytest.raises(ApiError) as refused:
        await frontend.admit(request)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and refused.value.field == "input.text"
    assert f"got {size}" in str(refused.value)  # tokenized in full, then refused
    assert tokenizer.threads and not any(name == threading.main_thread().name for name in tokenizer.threads)
    assert core.specs == []


async def test_a_short_prompt_is_tokenized_on_the_loop_and_served() -> None:
    frontend, core = scripted_frontend()
    tokenizer = LoopWatchingTokenizer(threading.Event())
    frontend.tokenizer = tokenizer
    completions = await frontend.admit(
        pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_new_tokens=4))
    )
    assert completions.prompt_ids == list(b"hi") and len(core.specs) == 1
    assert tokenizer.threads == [threading.main_thread().name]


async def test_a_prompt_checked_while_the_worker_changed_is_checked_again_against_the_new_one() -> None:
    """The worker's session changes while a long prompt is tokenized on the thread: the
    prompt is checked again with what the new session says (here: a shorter context)."""
    frontend, core = scripted_frontend()
    loop_ran = threading.Event()
    frontend.tokenizer = LoopWatchingTokenizer(loop_ran)
    smaller = WorkerInfo(**{**INFO.__dict__, "max_context_len": 4096, "epoch": 1})

    def new_session() -> None:
        frontend.worker_state(smaller, True)
        frontend.tokenizer = LoopWatchingTokenizer(loop_ran)
        loop_ran.set()

    asyncio.get_running_loop().call_soon(new_session)
    text = "a" * (OFF_LOOP_INPUT_BYTES + 1000)  # within the first context, over the second
    with pytest.raises(ApiError) as refused:
        await frontend.admit(pb.GenerateRequest(text=text, sampling=pb.SamplingParams(max_new_tokens=1)))
    assert "at most 4096 tokens" in str(refused.value) and core.specs == []


# ---- whole responses -------------------------------------------------------------------------


@pytest.fixture
async def http() -> AsyncIterator[tuple[Frontend, ScriptedCore, httpx2.AsyncClient]]:
    frontend, core = scripted_frontend()
    transport = httpx2.ASGITransport(app=build_app(frontend, ClientApiConfig(max_whole_logprobs=1000)))
    async with httpx2.AsyncClient(transport=transport, base_url="http://scripted") as client:
        yield frontend, core, client


def chat_body(**more: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}], **more}


async def test_a_whole_response_over_the_logprob_cap_is_400_naming_the_limit_and_streaming(
    http: tuple[Frontend, ScriptedCore, httpx2.AsyncClient],
) -> None:
    """n x max_tokens x (1 + top_logprobs) over the cap: refused before the core sees it; the
    same request streamed is served."""
    _, core, client = http
    body = chat_body(n=4, max_tokens=50, logprobs=True, top_logprobs=5)  # 4 x 50 x 6 = 1200 > 1000
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "top_logprobs" and error["type"] == "invalid_request_error"
    assert "at most 1000 log-probabilities" in error["message"] and "asks for 1200" in error["message"]
    assert '"stream": true' in error["message"] and "max_tokens (50)" in error["message"]
    assert core.specs == []
    completions = await client.post(
        "/v1/completions", json={"prompt": "hi", "n": 4, "max_tokens": 50, "logprobs": 5}
    )
    assert completions.status_code == 400 and completions.json()["error"]["param"] == "logprobs"

    within = chat_body(n=4, max_tokens=41, logprobs=True, top_logprobs=5)  # 4 x 41 x 6 = 984
    await admitted(client, core, within, 4)
    await admitted(client, core, {**body, "stream": True}, 8)


async def admitted(client: httpx2.AsyncClient, core: ScriptedCore, body: dict[str, Any], specs: int) -> None:
    """The call is admitted (the core got its completions); it then waits for tokens, and is left."""
    call = asyncio.ensure_future(client.post("/v1/chat/completions", json=body))
    await until(lambda: call.done() or len(core.specs) == specs)
    assert not call.done(), call.result().text
    call.cancel()


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
async def test_a_whole_body_built_in_slices_is_the_body_built_at_once(
    endpoint: str, monkeypatch: Any
) -> None:
    """Slices of 7 log-probabilities, so each choice takes many; the loop runs between them."""
    monkeypatch.setattr(openai_api, "SLICE_ENTRIES", 7)
    spell = ByteTokenizer().token_bytes
    ids = ResponseIds("cmpl-x", "scripted", endpoint)  # type: ignore[arg-type]
    tokens = [*b"caf", 0xC3, 0xA9, *b" ok", 257]
    logprobs = [TokenLogprob(-0.5 - i, (1, 2, 3), (-1.0, -2.0, float("-inf"))) for i in range(len(tokens))]

    def choices() -> list[Choice]:
        made = []
        for index in range(2):
            fmt = ChatLogprobs(spell) if endpoint == "chat" else CompletionLogprobs(spell)
            choice = Choice(index, fmt)
            choice.texts, choice.token_ids, choice.token_logprobs = ["café ok"], list(tokens), list(logprobs)
            choice.finish, choice.completion_tokens = FinishReason.STOP, len(tokens)
            made.append(choice)
        return made

    at_once = ids.body([choice.take(ids, chunk=False) for choice in choices()], (3, 2 * len(tokens), 0, 0))
    turns = 0

    async def count_turns() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    counter = asyncio.ensure_future(count_turns())
    sliced = await openai_api._whole_body(ids, choices(), (3, 2 * len(tokens), 0, 0))
    counter.cancel()
    assert json.loads(sliced) == json.loads(json.dumps(at_once))
    assert turns >= len(tokens)  # tokens of 4 entries each: one a slice, a turn of the loop after each


async def test_a_temperature_too_small_for_float32_stays_a_sampled_one(
    http: tuple[Frontend, ScriptedCore, httpx2.AsyncClient],
) -> None:
    """1e-50 is 0 (greedy) in float32, the wire's type: it samples at the least temperature."""
    _, core, client = http
    call = asyncio.ensure_future(
        client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "temperature": 1e-50})
    )
    await until(lambda: len(core.specs) == 1)
    assert core.specs[0].params.temperature == pytest.approx(MIN_TEMPERATURE)
    call.cancel()
    greedy = asyncio.ensure_future(
        client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "temperature": 0})
    )
    await until(lambda: len(core.specs) == 2)
    assert core.specs[1].params.temperature == 0
    greedy.cancel()
