"""The load generator's OpenAI-compatible backends without a real server: request bodies,
server-sent events, chunks and error bodies, and run_benchmark against a scripted aiohttp
server on 127.0.0.1 that streams in OpenAI's format."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from loadgen import BackendError, BenchmarkConfig, BenchmarkResult, JsonlDataset, RandomDataset, run_benchmark
from loadgen.backend import Sampling
from loadgen.cli import build_parser, config_from_args
from loadgen.cli import run as run_cli
from loadgen.openai_client import STREAM_ERROR, received
from loadgen.openai_protocol import (
    OpenAIError,
    SseDecoder,
    StreamChunk,
    StreamError,
    chat_body,
    completion_body,
    error_of,
    first_model_id,
    http_failure,
    parse_chunk,
)
from loadgen.records import RequestRecord
from loadgen.report import format_summary, result_json
from loadgen.timing import RequestTiming
from loadgen.workload import PromptSpec

pytestmark = pytest.mark.anyio
GREEDY = Sampling(temperature=0.0, ignore_eos=True)
RATE_LIMITED = {
    "error": {
        "message": "Rate limit reached",
        "type": "rate_limit_error",
        "param": None,
        "code": "rate_limit",
    }
}


# --- request bodies ---


def test_completion_body_sends_text_or_a_list_of_token_ids() -> None:
    text = completion_body(PromptSpec("Hi", 8), "m", Sampling(temperature=0.5, ignore_eos=False))
    assert text == {
        "model": "m",
        "prompt": "Hi",
        "max_tokens": 8,
        "temperature": 0.5,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": False,
    }
    ids = completion_body(PromptSpec((72, 105), 3), "m", GREEDY)
    assert (ids["prompt"], ids["max_tokens"], ids["ignore_eos"]) == ([72, 105], 3, True)
    json.dumps(ids)  # the ids are plain ints


def test_chat_body_sends_one_user_message_and_refuses_token_ids() -> None:
    body = chat_body(PromptSpec("Hello", 4), "m", GREEDY)
    assert body["messages"] == [{"role": "user", "content": "Hello"}]
    assert (body["max_completion_tokens"], body["stream"], body["stream_options"]) == (
        4,
        True,
        {"include_usage": True},
    )
    assert "prompt" not in body and "max_tokens" not in body
    with pytest.raises(ValueError, match="text"):
        chat_body(PromptSpec((1, 2), 4), "m", GREEDY)


# --- server-sent events ---


def test_sse_events_split_anywhere_come_out_whole() -> None:
    stream = b'data: {"a": 1}\n\ndata: {"b": 2}\r\n\r\n: a comment\n\nevent: x\ndata: [DONE]\n\n'
    for cut in range(len(stream) + 1):
        decoder = SseDecoder()
        events = decoder.feed(stream[:cut]) + decoder.feed(stream[cut:]) + decoder.finish()
        assert events == ['{"a": 1}', '{"b": 2}', "[DONE]"], cut


def test_sse_joins_data_lines_and_flushes_an_unterminated_event() -> None:
    decoder = SseDecoder()
    assert decoder.feed(b"data: one\ndata:two\n\n") == ["one\ntwo"]
    assert decoder.feed(b"data: [DONE]") == []
    assert decoder.finish() == ["[DONE]"] and decoder.finish() == []


def test_sse_keeps_multibyte_text_split_between_reads() -> None:
    encoded = 'data: {"t": "é"}\n\n'.encode()
    decoder = SseDecoder()
    assert decoder.feed(encoded[:12]) + decoder.feed(encoded[12:]) == ['{"t": "é"}']


# --- chunks ---


def test_completion_chunks_text_finish_and_usage() -> None:
    text = parse_chunk('{"choices": [{"index": 0, "text": "ab", "finish_reason": null}]}', chat=False)
    assert text == StreamChunk(text="ab")
    finish = parse_chunk('{"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}', chat=False)
    assert finish == StreamChunk(finish_reason="length")
    usage = parse_chunk(
        '{"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}}',
        chat=False,
    )
    assert usage == StreamChunk(prompt_tokens=5, completion_tokens=7)


def test_chat_chunks_read_the_delta_content() -> None:
    role = parse_chunk(
        '{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}', chat=True
    )
    assert role == StreamChunk()
    content = parse_chunk('{"choices": [{"delta": {"content": "Hi"}, "finish_reason": "stop"}]}', chat=True)
    assert content == StreamChunk(text="Hi", finish_reason="stop")
    assert parse_chunk('{"choices": [{"text": "not chat"}]}', chat=True).text == ""


def test_errors_inside_the_stream_and_chunks_that_are_not_json() -> None:
    chunk = parse_chunk(
        '{"error": {"message": "engine died", "type": "InternalServerError", "code": 500}}', False
    )
    assert chunk.error == OpenAIError("engine died", "InternalServerError", None, 500)
    flat = parse_chunk('{"object": "error", "message": "bad", "type": "BadRequestError", "code": 400}', False)
    assert flat.error == OpenAIError("bad", "BadRequestError", None, 400)
    for bad in ("{not json", "[1, 2]", '"text"'):
        with pytest.raises(StreamError):
            parse_chunk(bad, chat=False)


# --- error bodies ---


def test_http_failure_takes_the_openai_error_message() -> None:
    assert http_failure(429, json.dumps(RATE_LIMITED).encode()) == ("HTTP 429", "Rate limit reached")
    assert error_of(RATE_LIMITED) == OpenAIError("Rate limit reached", "rate_limit_error", None, "rate_limit")
    flat = {
        "object": "error",
        "message": "too long",
        "type": "BadRequestError",
        "param": "prompt",
        "code": 400,
    }
    assert error_of(flat) == OpenAIError("too long", "BadRequestError", "prompt", 400)
    assert error_of({"choices": []}) is None


def test_http_failure_of_a_body_that_is_no_openai_error() -> None:
    assert http_failure(502, b"  <html>Bad Gateway</html>\n") == ("HTTP 502", "<html>Bad Gateway</html>")
    assert http_failure(500, b"x" * 1000)[1] == "x" * 200
    assert http_failure(404, b'{"detail": "Not Found"}') == ("HTTP 404", '{"detail": "Not Found"}')
    assert http_failure(503, b"") == ("HTTP 503", "")


def test_first_model_id() -> None:
    assert first_model_id(b'{"object": "list", "data": [{"id": "a"}, {"id": "b"}]}') == "a"
    for body in (b'{"data": []}', b"{}", b"nope", b'{"data": [{"name": "a"}]}'):
        assert first_model_id(body) is None


# --- what chunks make of a request ---


def test_usage_gives_the_token_counts_and_text_chunks_the_arrivals() -> None:
    timing = RequestTiming(3, PromptSpec("Hi there", 6))
    timing.sent(1.0)
    received(timing, 1.2, StreamChunk(text="ab"))
    received(timing, 1.3, StreamChunk(text="cd"))
    received(timing, 1.4, StreamChunk(finish_reason="length"))
    received(timing, 1.5, StreamChunk(prompt_tokens=2, completion_tokens=4))
    timing.ended(1.6)
    record = timing.record(9.0)
    assert record == RequestRecord(
        index=3,
        input_len=2,
        send_time=1.0,
        end_time=1.5,
        message_times=(1.2, 1.3),
        message_tokens=(1, 1),
        output_tokens=4,
        finish_reason="LENGTH",
    )
    assert record.output_len == 4


def test_without_usage_every_text_chunk_counts_one_token() -> None:
    timing = RequestTiming(0, PromptSpec((1, 2, 3), 5))
    timing.sent(0.0)
    for t in (0.1, 0.2, 0.3):
        received(timing, t, StreamChunk(text="x"))
    received(timing, 0.4, StreamChunk(text="", finish_reason="stop"))
    timing.ended(0.5)
    record = timing.record(1.0)
    assert (record.output_len, record.input_len, record.finish_reason, record.end_time) == (3, 3, "STOP", 0.4)


def test_a_usage_on_every_chunk_weights_each_arrival() -> None:
    timing = RequestTiming(0, PromptSpec("p", 8))
    timing.sent(0.0)
    received(timing, 0.1, StreamChunk(text="a", prompt_tokens=1, completion_tokens=1))
    received(timing, 0.4, StreamChunk(text="bcd", prompt_tokens=1, completion_tokens=4))
    timing.ended(0.5)
    assert timing.record(1.0).message_tokens == (1, 3)


# --- configuration and command line ---


def parse(*argv: str) -> BenchmarkConfig:
    return config_from_args(build_parser().parse_args(list(argv)))


def test_cli_backend_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "from-env")
    config = parse(
        "--backend", "openai", "--base-url", "http://10.0.0.2:9000", "--model", "m", "--connections", "4"
    )
    assert config == BenchmarkConfig(
        backend="openai", base_url="http://10.0.0.2:9000", model="m", api_key="from-env", connections=4
    )
    assert parse("--backend", "openai", "--api-key", "given").api_key == "given"
    assert parse().api_key is None  # grpc sends no key
    monkeypatch.delenv("OPENAI_API_KEY")
    default = parse("--backend", "openai")
    assert (default.base_url, default.model, default.api_key) == ("http://127.0.0.1:8000", None, None)
    assert "api_key" not in repr(config) and "from-env" not in repr(config)


def test_connections_default_by_backend() -> None:
    assert parse().connection_limit == 8 and parse("--connections", "2").connection_limit == 2
    assert parse("--backend", "openai").connection_limit is None  # an uncapped pool
    assert parse("--backend", "openai", "--connections", "3").connection_limit == 3


def test_chat_needs_text_prompts(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--prompt-as-text"):
        parse("--backend", "openai-chat")
    assert parse("--backend", "openai-chat", "--prompt-as-text").dataset == RandomDataset(as_text=True)
    assert parse("--backend", "openai-chat", "--dataset", "jsonl", "--dataset-path", "p.jsonl").backend == (
        "openai-chat"
    )
    assert parse("--backend", "openai").dataset == RandomDataset()  # completions take token ids


@pytest.mark.parametrize(
    "argv",
    [["--backend", "openai", "--base-url", "127.0.0.1:8000"], ["--backend", "openai", "--connections", "0"]],
)
def test_cli_refuses_bad_backend_settings(argv: list[str]) -> None:
    with pytest.raises(ValueError):
        parse(*argv)


def test_cli_stops_when_the_server_lists_no_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["--backend", "openai", "--base-url", "http://127.0.0.1:1", "--no-progress"]) == 2
    assert "error: cannot list the models at http://127.0.0.1:1/v1/models" in capsys.readouterr().err


# --- run_benchmark against a scripted server ---


@dataclass
class ScriptedOpenAI:
    """Streams `max_tokens` tokens, `per_chunk` per chunk, then a finish chunk, the usage and
    [DONE], once `hold_until` requests are in. Prompts (text, or a chat message) script failures:
    "fail:429" is refused with an OpenAI error body, "no-usage" streams without a usage chunk,
    "stream-error" reports an error inside the stream, "no-done" ends without [DONE] and "hang"
    streams until the client goes."""

    per_chunk: int = 1
    hold_until: int = 0
    models: tuple[str, ...] = ("model-a", "model-b")
    models_status: int = 200
    bodies: list[dict[str, Any]] = field(default_factory=list)
    auth: list[str | None] = field(default_factory=list)
    peers: set[object] = field(default_factory=set)
    model_lists: int = 0
    in_flight: int = 0
    peak_in_flight: int = 0
    all_in: asyncio.Event = field(default_factory=asyncio.Event)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_post("/v1/chat/completions", self.complete)
        return app

    async def list_models(self, request: web.Request) -> web.Response:
        self.model_lists += 1
        if self.models_status != 200:
            return web.json_response(
                {"error": {"message": "bad key", "type": "auth"}}, status=self.models_status
            )
        return web.json_response(
            {"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]}
        )

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.auth.append(request.headers.get("Authorization"))
        self.peers.add(request.transport.get_extra_info("peername") if request.transport else None)
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            return await self.answer(request, body)
        finally:
            self.in_flight -= 1

    async def answer(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        if len(self.bodies) >= self.hold_until:
            self.all_in.set()
        await self.all_in.wait()
        prompt = prompt_of(body)
        if prompt == "fail:429":
            return web.json_response(RATE_LIMITED, status=429)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in self.events(body, prompt):
            await response.write(f"data: {event}\n\n".encode())
            await asyncio.sleep(0.01 if prompt == "hang" else 0)
        await response.write_eof()
        return response

    def events(self, body: dict[str, Any], prompt: str | list[int]) -> Iterator[str]:
        chat = "messages" in body
        n = 10**6 if prompt == "hang" else body["max_completion_tokens" if chat else "max_tokens"]
        if chat:
            yield json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        for done in range(0, n, self.per_chunk):
            yield json.dumps(choice(chat, "ab"[: min(self.per_chunk, n - done)] or "a", None))
            if prompt == "stream-error":
                yield json.dumps(
                    {"error": {"message": "engine died", "type": "InternalServerError", "code": 500}}
                )
        yield json.dumps(choice(chat, "", "length"))
        if prompt != "no-usage":
            yield json.dumps({"choices": [], "usage": usage(len(prompt), n)})
        if prompt != "no-done":
            yield "[DONE]"


def prompt_of(body: dict[str, Any]) -> str | list[int]:
    if "messages" in body:
        return str(body["messages"][0]["content"])
    prompt: str | list[int] = body["prompt"]
    return prompt


def choice(chat: bool, text: str, finish_reason: str | None) -> dict[str, object]:
    content: dict[str, object] = {"delta": {"content": text}} if chat else {"text": text}
    return {"object": "chunk", "choices": [{"index": 0, **content, "finish_reason": finish_reason}]}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    total = prompt_tokens + completion_tokens
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": total}


async def serve(server: ScriptedOpenAI) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(server.app(), shutdown_timeout=1.0, access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"


@pytest.fixture
async def scripted() -> AsyncIterator[tuple[ScriptedOpenAI, str]]:
    server = ScriptedOpenAI()
    runner, url = await serve(server)
    try:
        yield server, url
    finally:
        await runner.cleanup()


async def bench(url: str, **settings: Any) -> BenchmarkResult:
    return await run_benchmark(BenchmarkConfig(base_url=url, **settings))


def jsonl(tmp_path: Path, prompts: list[str], output_len: int = 3) -> JsonlDataset:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "output_len": output_len}) + "\n" for p in prompts))
    return JsonlDataset(path)


async def test_completions_of_token_ids_take_their_counts_from_the_usage(
    scripted: tuple[ScriptedOpenAI, str],
) -> None:
    server, url = scripted
    server.per_chunk = 2
    result = await bench(
        url,
        backend="openai",
        dataset=RandomDataset(5, 6),
        num_prompts=4,
        warmup=1,
        api_key="k",
        ignore_eos=True,
    )
    s = result.summary
    assert (s.completed, s.failed, s.total_input_tokens, s.total_output_tokens) == (4, 0, 20, 24)
    assert s.finish_reasons == {"LENGTH": 4} and s.ttft.count == 4 and s.tpot.count == 4
    assert [r.message_tokens for r in result.records] == [(1, 1, 1)] * 4  # 3 chunks of 2 tokens
    assert s.itl.count == 4 * 2 and result.model == "model-a" and server.model_lists == 1
    assert len(server.bodies) == 5 and server.auth == ["Bearer k"] * 5
    body = server.bodies[-1]
    assert isinstance(body["prompt"], list) and len(body["prompt"]) == 5
    assert (body["model"], body["max_tokens"], body["ignore_eos"], body["stream"]) == (
        "model-a",
        6,
        True,
        True,
    )
    assert body["stream_options"] == {"include_usage": True}


async def test_chat_streams_delta_content(scripted: tuple[ScriptedOpenAI, str]) -> None:
    server, url = scripted
    result = await bench(
        url, backend="openai-chat", model="mine", dataset=RandomDataset(4, 3, as_text=True), num_prompts=3
    )
    s = result.summary
    assert (s.completed, s.failed, s.total_input_tokens, s.total_output_tokens) == (3, 0, 12, 9)
    assert s.ttft.count == 3 and s.itl.count == 3 * 2 and server.model_lists == 0
    assert all(r.message_tokens == (1, 1, 1) and r.finish_reason == "LENGTH" for r in result.records)
    body = server.bodies[0]
    assert (body["model"], body["max_completion_tokens"]) == ("mine", 3)
    assert body["messages"][0]["role"] == "user" and len(body["messages"][0]["content"]) == 4
    assert server.auth == [None] * 3
    data = result_json(result)
    assert (data["backend"], data["model"], data["server"], data["connections"]) == (
        "openai-chat",
        "mine",
        url,
        None,
    )


async def test_refusals_and_broken_streams_are_failures_by_status(
    scripted: tuple[ScriptedOpenAI, str], tmp_path: Path
) -> None:
    _, url = scripted
    prompts = ["fine", "fail:429", "no-usage", "fail:429", "stream-error", "no-done"]
    result = await bench(url, backend="openai", model="m", dataset=jsonl(tmp_path, prompts), num_prompts=6)
    s = result.summary
    assert (s.completed, s.failed) == (2, 4)
    assert s.errors == {"HTTP 429": 2, STREAM_ERROR: 2}
    records = result.records
    assert (records[1].error, records[1].error_detail) == ("HTTP 429", "Rate limit reached")
    assert records[4].error_detail == "engine died" and "without data: [DONE]" in records[5].error_detail
    assert (records[0].input_len, records[0].output_len) == (4, 3)  # from the usage
    assert (records[2].input_len, records[2].output_len) == (0, 3)  # no usage: chunks counted
    errors = result_json(result, detailed=True)["request_errors"]
    assert isinstance(errors, list) and errors[1] == "HTTP 429: Rate limit reached"
    table = format_summary(result).splitlines()
    assert "  HTTP 429:                             2" in table
    assert "Backend:                                openai (model m)" in table


async def test_the_pool_caps_connections_and_requests_in_flight(scripted: tuple[ScriptedOpenAI, str]) -> None:
    server, url = scripted
    server.hold_until = 2
    result = await bench(
        url, backend="openai", model="m", dataset=RandomDataset(4, 2), num_prompts=8, connections=2
    )
    assert result.summary.completed == 8
    assert server.peak_in_flight == 2 and len(server.peers) <= 2


async def test_stop_cancels_requests_in_flight(scripted: tuple[ScriptedOpenAI, str], tmp_path: Path) -> None:
    server, url = scripted
    server.hold_until = 3
    stop = asyncio.Event()
    config = BenchmarkConfig(
        backend="openai",
        base_url=url,
        model="m",
        dataset=jsonl(tmp_path, ["quick", "hang", "hang"]),
        num_prompts=3,
    )
    result = await run_benchmark(config, stop, StopAfter(stop, after=1))
    assert result.interrupted and result.summary.errors == {"CANCELLED": 2}
    assert result.summary.completed == 1 and result.records[0].ok


class StopAfter:
    def __init__(self, stop: asyncio.Event, after: int) -> None:
        self.stop, self.after, self.done = stop, after, 0

    def on_start(self) -> None:
        pass

    def on_request_done(self, record: RequestRecord) -> None:
        self.done += 1
        if self.done == self.after:
            self.stop.set()


async def test_a_model_list_that_refuses_stops_the_run() -> None:
    server = ScriptedOpenAI(models_status=401)
    runner, url = await serve(server)
    try:
        with pytest.raises(BackendError, match="HTTP 401: bad key"):
            await bench(url, backend="openai", dataset=RandomDataset(4, 2), num_prompts=1)
        server.models_status, server.models = 200, ()
        with pytest.raises(BackendError, match="lists no model"):
            await bench(url, backend="openai", dataset=RandomDataset(4, 2), num_prompts=1)
    finally:
        await runner.cleanup()
    assert server.bodies == []


async def test_an_unreachable_server_fails_every_request() -> None:
    result = await bench(
        "http://127.0.0.1:1", backend="openai", model="m", dataset=RandomDataset(4, 2), num_prompts=2
    )
    assert (result.summary.completed, result.summary.errors) == (0, {"CONNECTION_ERROR": 2})
