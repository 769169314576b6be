"""The OpenAI-compatible HTTP API against live processes on 127.0.0.1, through the official
`openai` client (httpx2 where a client must misbehave): the same text as the gRPC API,
streaming, usage, chat, stop strings, seeds, errors, the API key, TLS, refusals (429, 503)
and clients that go away."""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx2
import openai
import pytest
from openai.types import Completion

from stepahead.processes import STOP_TIMEOUT_S, Service, serving_pair
from stepahead.v1 import generation_pb2 as pb
from stepahead.v1 import generation_pb2_grpc
from tests.live import (
    CALL_TIMEOUT_S,
    FRONTEND_COUNTS,
    frontend_flags,
    server_info,
    unused_port,
    wait_all_free,
    wait_info,
    wait_until,
)
from tests.test_security import Pki, server_auth, write_pki
from worker_svc.backends import sim_continuation

pytestmark = pytest.mark.anyio

TINY = ["--model", "tiny"]
SIM = ["--model", "sim", "--sim-step-ms", "2", "--kv-slots", "4096"]
SLOW_SIM = ["--model", "sim", "--sim-step-ms", "20", "--kv-slots", "8192"]
# No newline anywhere, so that the rendered text is plain to write down (see `rendered`).
CHAT_TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}] {{ m.content }}|{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
CONVERSATION: list[Any] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Grüß dich"},
]
MAX_REQUEST_BYTES = 16384
JSON_HEADERS = {"content-type": "application/json"}
API_KEY = "openai-api-test-key"
SERVED_NAME = "stepahead/sim-demo"
IGNORE_EOS = {"ignore_eos": True}
PROMPT = "Once upon a time"
# Tokens: 160 s or more on the slow sim (its steps take 20 ms at least), a hundred times what a
# test takes to abort such a request: only that abort ends it.
LONG = 8000


# ---- processes -----------------------------------------------------------------------------------


def http_flags(*flags: str) -> list[str]:
    return ["--http-port", str(unused_port()), *flags]


@pytest.fixture(scope="module")
def chat_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("chat") / "template.jinja"
    path.write_text(CHAT_TEMPLATE)
    return path


@pytest.fixture(scope="module", params=FRONTEND_COUNTS, ids=lambda n: f"frontends={n}")
def tiny(request: pytest.FixtureRequest, chat_template: Path) -> Iterator[Service]:
    """The random-weight Llama (byte-level tokens: a prompt has as many tokens as UTF-8 bytes)."""
    flags = http_flags(
        "--chat-template",
        str(chat_template),
        "--max-request-bytes",
        str(MAX_REQUEST_BYTES),
        *frontend_flags(request.param),
    )
    with serving_pair(TINY, flags) as (_, scheduler):
        yield scheduler


IN_PROCESS_ONLY = pytest.mark.parametrize("tiny", [0], indirect=True, ids=["frontends=0"])


@pytest.fixture(scope="module", params=FRONTEND_COUNTS, ids=lambda n: f"frontends={n}")
def slow(request: pytest.FixtureRequest) -> Iterator[Service]:
    """One request runs and one waits at most; the sim takes 20 ms a token."""
    flags = http_flags("--max-running", "1", "--max-waiting", "1", *frontend_flags(request.param))
    with serving_pair(SLOW_SIM, flags) as (_, scheduler):
        yield scheduler


@pytest.fixture(scope="module")
def keyed() -> Iterator[Service]:
    """An API key, and no chat template (the sim has none)."""
    with serving_pair(SIM, http_flags(*frontend_flags(0)), api_key=API_KEY) as (_, scheduler):
        yield scheduler


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return write_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls(pki: Pki) -> Iterator[Service]:
    flags = http_flags(
        "--tls-cert",
        str(pki.server_cert),
        "--tls-key",
        str(pki.server_key),
        "--served-model-name",
        SERVED_NAME,
        *frontend_flags(0),
    )
    with serving_pair(SIM, flags, scheduler_credentials=server_auth(pki)) as (_, scheduler):
        yield scheduler


@dataclass
class LostWorker:
    scheduler: Service
    live_stream: openai.Stream[Completion]  # its first chunk read before the worker was killed


def held_port(port: int) -> socket.socket:
    """The dead worker's port bound (not listening), so that no service started meanwhile can
    take it and become the worker the scheduler keeps reconnecting to."""
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past its connections' TIME_WAIT
    holder.bind(("127.0.0.1", port))
    return holder


@pytest.fixture(scope="module")
def lost_worker() -> Iterator[LostWorker]:
    """A LONG request on the slow sim, so it is still live when its worker is killed."""
    flags = http_flags("--worker-retry-timeout", "1", "--grace", "2", *frontend_flags(0))
    with serving_pair(SLOW_SIM, flags) as (worker, scheduler), sync_api(scheduler.http_url) as client:
        stream = client.completions.create(
            model="sim", prompt="cut short", max_tokens=LONG, stream=True, extra_body=IGNORE_EOS
        )
        next(stream)
        worker.proc.kill()
        worker.proc.wait(STOP_TIMEOUT_S)
        with held_port(worker.port):
            wait_until(lambda: health(scheduler.http_url) == 503, "/health 503")
            yield LostWorker(scheduler, stream)
            stream.close()


# ---- clients -------------------------------------------------------------------------------------


def api(base_url: str, key: str = "unchecked", **options: Any) -> openai.AsyncOpenAI:
    """max_retries=0: the client would otherwise retry 429 and 5xx on its own."""
    return openai.AsyncOpenAI(
        base_url=f"{base_url}/v1", api_key=key, max_retries=0, timeout=CALL_TIMEOUT_S, **options
    )


def sync_api(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{base_url}/v1", api_key="unchecked", max_retries=0, timeout=CALL_TIMEOUT_S
    )


@pytest.fixture
async def client(tiny: Service) -> AsyncIterator[openai.AsyncOpenAI]:
    async with api(tiny.http_url) as client:
        yield client


async def greedy(client: openai.AsyncOpenAI, prompt: str | list[int], max_tokens: int) -> Completion:
    return await client.completions.create(
        model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body=IGNORE_EOS
    )


async def greedy_chunks(
    client: openai.AsyncOpenAI, prompt: str, max_tokens: int, include_usage: bool = False
) -> list[Completion]:
    stream = await client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True} if include_usage else openai.omit,
        extra_body=IGNORE_EOS,
    )
    return [chunk async for chunk in stream]


def joined(chunks: list[Completion]) -> str:
    return "".join(c.choices[0].text for c in chunks if c.choices)


async def grpc_text(address: str, request: pb.GenerateRequest) -> str:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        return "".join([r.text async for r in stub.Generate(request, timeout=CALL_TIMEOUT_S)])


def greedy_sampling(max_new_tokens: int) -> pb.SamplingParams:
    return pb.SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True)


def rendered(messages: list[Any]) -> str:
    """CHAT_TEMPLATE's text for `messages`, written out by hand."""
    return "".join(f"[{m['role']}] {m['content']}|" for m in messages) + "[assistant] "


def sim_text(prompt: str, max_tokens: int) -> str:
    return bytes(t for t in sim_continuation(prompt.encode(), max_tokens) if t < 256).decode()


def health(base_url: str) -> int:
    with httpx2.Client(timeout=CALL_TIMEOUT_S) as http:
        return http.get(f"{base_url}/health").status_code


def error_of(response: httpx2.Response, status: int) -> dict[str, Any]:
    """The OpenAI error body of `response`, checked for its shape."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    error: dict[str, Any] = body["error"]
    assert isinstance(error["message"], str) and error["message"]
    return error


def assert_names(error: dict[str, Any], param: str) -> None:
    assert error["param"] == param
    assert error["message"].startswith(f"{param}:"), error["message"]


async def assert_still_serves(client: openai.AsyncOpenAI) -> None:
    done = await greedy(client, "still there?", 4)
    assert (done.choices[0].finish_reason, done.usage and done.usage.completion_tokens) == ("length", 4)


# ---- models and health ---------------------------------------------------------------------------


async def test_models_lists_the_served_model(tiny: Service, client: openai.AsyncOpenAI) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == [(await server_info(tiny.address)).model] == ["tiny"]


async def test_a_model_is_retrieved_by_its_id_and_another_is_404(
    tiny: Service, client: openai.AsyncOpenAI
) -> None:
    assert (await client.models.retrieve("tiny")).id == "tiny"
    with pytest.raises(openai.NotFoundError) as missing:
        await client.models.retrieve("gpt-4o")
    assert error_of(missing.value.response, 404)["param"] == "model"


async def test_an_unknown_route_is_404_in_openai_s_error_body(tiny: Service) -> None:
    async with httpx2.AsyncClient(timeout=CALL_TIMEOUT_S) as http:
        response = await http.post(f"{tiny.http_url}/v1/embeddings", json={"input": "x"})
    assert response.status_code == 404
    assert "/v1/embeddings" in response.json()["error"]["message"]


async def test_health_is_200_while_serving(tiny: Service) -> None:
    async with httpx2.AsyncClient(timeout=CALL_TIMEOUT_S) as http:
        assert (await http.get(f"{tiny.http_url}/health")).status_code == 200


# ---- completions ---------------------------------------------------------------------------------


async def test_completion_text_is_the_grpc_apis(tiny: Service, client: openai.AsyncOpenAI) -> None:
    done = await greedy(client, PROMPT, 24)
    expected = await grpc_text(tiny.address, pb.GenerateRequest(text=PROMPT, sampling=greedy_sampling(24)))
    assert done.choices[0].text == expected
    assert done.choices[0].finish_reason == "length"


async def test_streamed_chunks_join_to_the_grpc_text(tiny: Service, client: openai.AsyncOpenAI) -> None:
    chunks = await greedy_chunks(client, PROMPT, 24)
    expected = await grpc_text(tiny.address, pb.GenerateRequest(text=PROMPT, sampling=greedy_sampling(24)))
    assert joined(chunks) == expected == (await greedy(client, PROMPT, 24)).choices[0].text
    assert [c.choices[0].finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]


async def test_usage_counts_prompt_bytes_and_max_tokens(client: openai.AsyncOpenAI) -> None:
    prompt = "Grüße, 世界"
    done = await greedy(client, prompt, 9)
    assert done.usage is not None
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (len(prompt.encode()), 9)
    assert done.usage.total_tokens == len(prompt.encode()) + 9


async def test_include_usage_ends_the_stream_with_a_usage_chunk(client: openai.AsyncOpenAI) -> None:
    chunks = await greedy_chunks(client, PROMPT, 7, include_usage=True)
    *tokens, last = chunks
    assert last.choices == [] and last.usage is not None
    prompt_tokens = len(PROMPT.encode())
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (prompt_tokens, 7)
    assert last.usage.total_tokens == prompt_tokens + 7
    assert all(c.choices and c.usage is None for c in tokens)


async def test_without_include_usage_no_chunk_has_usage(client: openai.AsyncOpenAI) -> None:
    chunks = await greedy_chunks(client, PROMPT, 7)
    assert chunks and all(c.choices and c.usage is None for c in chunks)


async def test_token_id_prompt_gives_the_text_of_its_bytes(client: openai.AsyncOpenAI) -> None:
    by_ids = await greedy(client, list(PROMPT.encode()), 16)
    assert by_ids.choices[0].text == (await greedy(client, PROMPT, 16)).choices[0].text
    assert by_ids.usage is not None and by_ids.usage.prompt_tokens == len(PROMPT.encode())


# ---- chat ----------------------------------------------------------------------------------------


async def test_chat_answers_the_rendered_conversation(client: openai.AsyncOpenAI) -> None:
    chat = await client.chat.completions.create(
        model="tiny", messages=CONVERSATION, max_tokens=12, temperature=0, extra_body=IGNORE_EOS
    )
    text = rendered(CONVERSATION)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == (await greedy(client, text, 12)).choices[0].text
    assert chat.usage is not None and chat.usage.prompt_tokens == len(text.encode())
    assert chat.choices[0].finish_reason == "length"


async def test_chat_is_the_grpc_apis_answer(tiny: Service, client: openai.AsyncOpenAI) -> None:
    chat = await client.chat.completions.create(
        model="tiny", messages=CONVERSATION, max_tokens=12, temperature=0, extra_body=IGNORE_EOS
    )
    messages = pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in CONVERSATION])
    expected = await grpc_text(
        tiny.address, pb.GenerateRequest(messages=messages, sampling=greedy_sampling(12))
    )
    assert chat.choices[0].message.content == expected


async def test_chat_stream_starts_with_the_role_and_joins_to_the_message(client: openai.AsyncOpenAI) -> None:
    settings: dict[str, Any] = {"model": "tiny", "messages": CONVERSATION, "max_tokens": 12, "temperature": 0}
    whole = await client.chat.completions.create(**settings, extra_body=IGNORE_EOS)
    stream = await client.chat.completions.create(**settings, stream=True, extra_body=IGNORE_EOS)
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


# ---- stop strings and seeds ----------------------------------------------------------------------


def stop_in(text: str) -> str:
    """Two ASCII letters or digits whose first occurrence in `text` is past its start."""
    for i in range(1, len(text) - 1):
        pair = text[i : i + 2]
        if pair.isascii() and pair.isalnum() and text.find(pair) == i:
            return pair
    raise AssertionError(f"no stop string to pick in {text!r}")


@IN_PROCESS_ONLY
async def test_stop_string_ends_the_text_before_it(client: openai.AsyncOpenAI) -> None:
    free = (await greedy(client, "abc", 32)).choices[0].text
    stop = stop_in(free)
    done = await client.completions.create(
        model="tiny", prompt="abc", max_tokens=32, temperature=0, stop=[stop], extra_body=IGNORE_EOS
    )
    assert (done.choices[0].text, done.choices[0].finish_reason) == (free[: free.index(stop)], "stop")


@IN_PROCESS_ONLY
async def test_streamed_stop_string_ends_the_text_before_it(client: openai.AsyncOpenAI) -> None:
    free = (await greedy(client, "abc", 32)).choices[0].text
    stop = stop_in(free)
    stream = await client.completions.create(
        model="tiny",
        prompt="abc",
        max_tokens=32,
        temperature=0,
        stop=stop,
        stream=True,
        extra_body=IGNORE_EOS,
    )
    chunks = [chunk async for chunk in stream]
    assert joined(chunks) == free[: free.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


async def sampled(client: openai.AsyncOpenAI, seed: int) -> str:
    done = await client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=32, temperature=1.0, seed=seed, extra_body=IGNORE_EOS
    )
    return done.choices[0].text


@IN_PROCESS_ONLY
async def test_same_seed_samples_the_same_text(client: openai.AsyncOpenAI) -> None:
    assert await sampled(client, 7) == await sampled(client, 7)


@IN_PROCESS_ONLY
async def test_other_seed_samples_another_text(client: openai.AsyncOpenAI) -> None:
    assert await sampled(client, 7) != await sampled(client, 8)


# ---- errors --------------------------------------------------------------------------------------

BAD_COMPLETIONS: list[tuple[dict[str, Any], str]] = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "abc"}, "max_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"stop": [""]}, "stop[0]"),
    ({"n": 0}, "n"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [300]}, "prompt[0]"),
    ({"stream": True, "top_p": 0}, "top_p"),
]


@IN_PROCESS_ONLY
@pytest.mark.parametrize(("bad", "param"), BAD_COMPLETIONS, ids=[str(b) for b, _ in BAD_COMPLETIONS])
async def test_bad_completion_is_400_naming_the_param(
    client: openai.AsyncOpenAI, bad: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        await client.completions.create(model="tiny", prompt="hi", max_tokens=4, extra_body=bad)
    error = error_of(refused.value.response, 400)
    assert error["type"] == "invalid_request_error"
    assert_names(error, param)
    await assert_still_serves(client)


BAD_CHATS: list[tuple[dict[str, Any], str]] = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
]


@IN_PROCESS_ONLY
@pytest.mark.parametrize(("bad", "param"), BAD_CHATS, ids=[str(b) for b, _ in BAD_CHATS])
async def test_bad_chat_is_400_naming_the_param(
    client: openai.AsyncOpenAI, bad: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(
            model="tiny", messages=CONVERSATION, max_tokens=4, extra_body=bad
        )
    assert_names(error_of(refused.value.response, 400), param)
    await assert_still_serves(client)


@IN_PROCESS_ONLY
async def test_prompt_longer_than_the_context_is_400(tiny: Service, client: openai.AsyncOpenAI) -> None:
    context = (await server_info(tiny.address)).max_context_len
    with pytest.raises(openai.BadRequestError) as refused:
        await client.completions.create(model="tiny", prompt="x" * (context + 1), max_tokens=1)
    error = error_of(refused.value.response, 400)
    assert_names(error, "prompt")
    assert str(context) in error["message"]
    await assert_still_serves(client)


@IN_PROCESS_ONLY
async def test_answer_longer_than_the_context_is_400(tiny: Service, client: openai.AsyncOpenAI) -> None:
    context = (await server_info(tiny.address)).max_context_len
    with pytest.raises(openai.BadRequestError) as refused:
        await client.completions.create(model="tiny", prompt="hi", max_tokens=context)
    error = error_of(refused.value.response, 400)
    assert_names(error, "max_tokens")
    assert "max_new_tokens" not in error["message"]  # the gRPC name is not the HTTP API's
    await assert_still_serves(client)


@IN_PROCESS_ONLY
async def test_chat_answer_longer_than_the_context_names_max_completion_tokens(
    tiny: Service, client: openai.AsyncOpenAI
) -> None:
    context = (await server_info(tiny.address)).max_context_len
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(
            model="tiny", messages=CONVERSATION, max_completion_tokens=context
        )
    assert_names(error_of(refused.value.response, 400), "max_completion_tokens")


@IN_PROCESS_ONLY
async def test_unknown_model_is_404(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as refused:
        await client.completions.create(model="gpt-unknown", prompt="hi", max_tokens=4)
    error = error_of(refused.value.response, 404)
    assert (error["type"], error["code"]) == ("not_found_error", "model_not_found")
    assert_names(error, "model")
    await assert_still_serves(client)


@IN_PROCESS_ONLY
async def test_malformed_json_is_400(tiny: Service, client: openai.AsyncOpenAI) -> None:
    async with httpx2.AsyncClient(timeout=CALL_TIMEOUT_S) as http:
        response = await http.post(
            f"{tiny.http_url}/v1/completions",
            content=b'{"prompt": "hi", ',
            headers={"content-type": "application/json"},
        )
    error = error_of(response, 400)
    assert error["type"] == "invalid_request_error" and "JSON" in error["message"]
    await assert_still_serves(client)


async def oversized_body() -> AsyncIterator[bytes]:
    """A valid completion request over MAX_REQUEST_BYTES, sent chunked (no content-length)."""
    yield b'{"model": "tiny", "max_tokens": 1, "prompt": "'
    for _ in range(MAX_REQUEST_BYTES // 1024 + 1):
        yield b"x" * 1024
    yield b'"}'


@IN_PROCESS_ONLY
@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_body_over_max_request_bytes_is_413(
    tiny: Service, client: openai.AsyncOpenAI, framing: str
) -> None:
    url = f"{tiny.http_url}/v1/completions"
    async with httpx2.AsyncClient(timeout=CALL_TIMEOUT_S) as http:
        if framing == "chunked":
            response = await http.post(url, content=oversized_body(), headers=JSON_HEADERS)
        else:
            response = await http.post(url, json={"model": "tiny", "prompt": "x" * MAX_REQUEST_BYTES})
    assert str(MAX_REQUEST_BYTES) in error_of(response, 413)["message"]
    await assert_still_serves(client)


async def test_chat_without_a_template_is_400_naming_messages(keyed: Service) -> None:
    async with api(keyed.http_url, API_KEY) as client:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model="sim", messages=CONVERSATION, max_tokens=4)
    assert error_of(refused.value.response, 400)["param"] == "messages"


async def test_chat_without_a_template_is_failed_precondition_on_grpc(keyed: Service) -> None:
    messages = pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in CONVERSATION])
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        async with grpc.aio.insecure_channel(keyed.address) as channel:
            call = generation_pb2_grpc.GenerationStub(channel).Generate(
                pb.GenerateRequest(messages=messages, sampling=greedy_sampling(4)),
                metadata=(("authorization", f"Bearer {API_KEY}"),),
                timeout=CALL_TIMEOUT_S,
            )
            [r async for r in call]
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION


# ---- the API key ---------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/models", "/v1/completions"])
async def test_no_key_is_401(keyed: Service, path: str) -> None:
    async with httpx2.AsyncClient(timeout=CALL_TIMEOUT_S) as http:
        if path == "/v1/models":
            response = await http.get(f"{keyed.http_url}{path}")
        else:
            response = await http.post(f"{keyed.http_url}{path}", json={"prompt": "hi", "max_tokens": 2})
    assert error_of(response, 401)["type"] == "authentication_error"


async def test_wrong_key_is_401_on_models(keyed: Service) -> None:
    async with api(keyed.http_url, API_KEY + "x") as client:
        with pytest.raises(openai.AuthenticationError):
            await client.models.list()


async def test_wrong_key_is_401_on_completions(keyed: Service) -> None:
    async with api(keyed.http_url, "wrong") as client:
        with pytest.raises(openai.AuthenticationError):
            await client.completions.create(model="sim", prompt="hi", max_tokens=2)


async def test_right_key_is_served(keyed: Service) -> None:
    async with api(keyed.http_url, API_KEY) as client:
        assert [m.id for m in (await client.models.list()).data] == ["sim"]
        done = await client.completions.create(
            model="sim", prompt="keyed", max_tokens=6, extra_body=IGNORE_EOS
        )
    assert done.choices[0].text == sim_text("keyed", 6)


async def test_health_needs_no_key(keyed: Service) -> None:
    async with httpx2.AsyncClient(timeout=CALL_TIMEOUT_S) as http:
        assert (await http.get(f"{keyed.http_url}/health")).status_code == 200


# ---- TLS -----------------------------------------------------------------------------------------


def https(service: Service) -> str:
    return service.http_url.replace("http://", "https://", 1)


async def test_https_trusting_the_ca_is_served(tls: Service, pki: Pki) -> None:
    trusting = httpx2.AsyncClient(verify=ssl.create_default_context(cafile=str(pki.ca)))
    async with api(https(tls), http_client=trusting) as client:
        assert [m.id for m in (await client.models.list()).data] == [SERVED_NAME]
        done = await client.completions.create(
            model=SERVED_NAME, prompt="sealed", max_tokens=5, extra_body=IGNORE_EOS
        )
        with pytest.raises(openai.NotFoundError):  # the worker's own name is not the served one
            await client.completions.create(model="sim", prompt="sealed", max_tokens=5)
    assert done.choices[0].text == sim_text("sealed", 5) and done.model == SERVED_NAME


async def test_https_without_trusting_the_ca_fails(tls: Service, pki: Pki) -> None:
    rogue = httpx2.AsyncClient(verify=ssl.create_default_context(cafile=str(pki.rogue_ca)))
    async with api(https(tls), http_client=rogue) as client:
        with pytest.raises(openai.APIConnectionError):
            await client.models.list()


async def test_plain_http_to_the_tls_port_fails(tls: Service) -> None:
    async with api(tls.http_url) as client:
        with pytest.raises(openai.APIConnectionError):
            await client.models.list()


# ---- a lost worker: 503 --------------------------------------------------------------------------


def test_live_stream_ends_with_an_error_event_when_the_worker_is_lost(lost_worker: LostWorker) -> None:
    with pytest.raises(openai.APIError) as ended:
        for _ in lost_worker.live_stream:
            pass
    assert isinstance(ended.value.body, dict) and ended.value.body["type"] == "service_unavailable_error"


async def test_health_is_503_without_a_worker(lost_worker: LostWorker) -> None:
    async with httpx2.AsyncClient(timeout=CALL_TIMEOUT_S) as http:
        assert (await http.get(f"{lost_worker.scheduler.http_url}/health")).status_code == 503


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_completion_is_503_once_no_worker_came_back_within_the_retry_timeout(
    lost_worker: LostWorker, stream: bool
) -> None:
    """It waits for a worker as a gRPC request does (--worker-retry-timeout 1 s here), then ends
    with 503 (tests/test_frontends.py: one that comes back in time serves it)."""
    async with api(lost_worker.scheduler.http_url) as client:
        with pytest.raises(openai.InternalServerError) as refused:
            await client.completions.create(model="sim", prompt="anyone?", max_tokens=2, stream=stream)
    assert refused.value.status_code == 503
    assert error_of(refused.value.response, 503)["type"] == "service_unavailable_error"


# ---- overload: 429 -------------------------------------------------------------------------------
# On `slow`, a LONG request runs until the test aborts it; a stream's first chunk comes once its
# request runs (an earlier one cannot take its place then).


def running_and_waiting(info: pb.GetServerInfoResponse) -> bool:
    return info.requests_running == 1 and info.requests_waiting == 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_request_beyond_the_waiting_queue_is_429(slow: Service, stream: bool) -> None:
    async with api(slow.http_url) as client:
        running = await client.completions.create(
            model="sim", prompt="runs", max_tokens=LONG, stream=True, extra_body=IGNORE_EOS
        )
        await anext(running)
        waiting = asyncio.create_task(
            client.completions.create(model="sim", prompt="waits", max_tokens=LONG, extra_body=IGNORE_EOS)
        )
        try:
            await wait_info(slow.address, running_and_waiting, "one running, one waiting")
            with pytest.raises(openai.RateLimitError) as refused:
                await client.completions.create(model="sim", prompt="refused", max_tokens=2, stream=stream)
        finally:
            waiting.cancel()
            await running.close()
    error = error_of(refused.value.response, 429)
    assert error["type"] == "rate_limit_error" and "--max-waiting" in error["message"]
    await wait_all_free(slow.address)


async def test_waiting_request_is_served_once_the_running_one_ends(slow: Service) -> None:
    async with api(slow.http_url) as client:
        running = await client.completions.create(
            model="sim", prompt="first", max_tokens=LONG, stream=True, extra_body=IGNORE_EOS
        )
        first = [await anext(running), await anext(running)]
        waiting = asyncio.create_task(
            client.completions.create(model="sim", prompt="second", max_tokens=5, extra_body=IGNORE_EOS)
        )
        try:
            await wait_info(slow.address, running_and_waiting, "second waiting behind first")
            assert sim_text("first", LONG).startswith(joined(first))
        finally:
            await running.close()  # first ends (aborted): second runs
        assert (await waiting).choices[0].text == sim_text("second", 5)
    await wait_all_free(slow.address)


# ---- clients that go away ------------------------------------------------------------------------


async def test_stream_closed_after_its_first_chunk_is_aborted(slow: Service) -> None:
    async with api(slow.http_url) as client:
        stream = await client.completions.create(
            model="sim", prompt="left early", max_tokens=LONG, stream=True, extra_body=IGNORE_EOS
        )
        await anext(stream)
        assert (await server_info(slow.address)).requests_running == 1
        await stream.close()
        await wait_all_free(slow.address)
        done = await client.completions.create(
            model="sim", prompt="next", max_tokens=3, extra_body=IGNORE_EOS
        )
    assert done.choices[0].text == sim_text("next", 3)


async def expire_once_running(address: str, timeout: asyncio.Timeout) -> None:
    await wait_info(address, lambda i: i.requests_running == 1, "running")
    timeout.reschedule(asyncio.get_running_loop().time())


async def test_whole_completion_whose_client_timed_out_is_aborted(slow: Service) -> None:
    async with api(slow.http_url) as client:
        with pytest.raises(TimeoutError):
            # The client's own timeout, set off once its request runs: it drops the connection.
            async with asyncio.timeout(None) as timeout:
                expiry = asyncio.create_task(expire_once_running(slow.address, timeout))
                await client.completions.create(
                    model="sim", prompt="too slow", max_tokens=LONG, extra_body=IGNORE_EOS
                )
        await expiry
        await wait_all_free(slow.address)
        done = await client.completions.create(
            model="sim", prompt="next", max_tokens=3, extra_body=IGNORE_EOS
        )
    assert done.choices[0].text == sim_text("next", 3)


async def test_waiting_request_whose_client_left_is_dropped(slow: Service) -> None:
    async with api(slow.http_url) as client:
        running = await client.completions.create(
            model="sim", prompt="runs", max_tokens=LONG, stream=True, extra_body=IGNORE_EOS
        )
        await anext(running)
        waiting = asyncio.create_task(
            client.completions.create(model="sim", prompt="waits", max_tokens=LONG, extra_body=IGNORE_EOS)
        )
        try:
            await wait_info(slow.address, running_and_waiting, "one running, one waiting")
            waiting.cancel()
            await wait_info(slow.address, lambda i: i.requests_waiting == 0, "the waiting one dropped")
            assert (await server_info(slow.address)).requests_running == 1
        finally:
            waiting.cancel()
            await running.close()
    await wait_all_free(slow.address)
