"""The HTTP API against hostile bodies and clients: JSON that parses but cannot be served, bodies
that are not JSON, loose types, and clients that leave before their response begins. Each gets
a precise status in OpenAI's error shape (never a 500, never a traceback in the log), and the
server keeps serving with every slot free."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import signal
import socket
from collections.abc import Iterator
from typing import Any

import grpc
import httpx2 as httpx
import pytest

from stepahead.processes import (
    STOP_TIMEOUT_S,
    Service,
    serving_pair,
    spawn_scheduler,
    spawn_worker,
    wait_serving,
)
from stepahead.serving import ResourceErrors
from stepahead.v1 import generation_pb2 as pb
from stepahead.v1 import generation_pb2_grpc
from tests.live import (
    CALL_TIMEOUT_S,
    FRONTEND_COUNTS,
    frontend_flags,
    paused,
    server_info,
    started_call,
    unused_port,
    wait_all_free,
    wait_frontends_serving,
    wait_info,
)

pytestmark = pytest.mark.anyio

SIM = ["--model", "sim", "--sim-step-ms", "3", "--sim-token-us", "0"]
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Service, Service]]:
    with serving_pair(SIM, ["--http-port", str(unused_port())]) as services:
        yield services


@pytest.fixture(scope="module")
def sim(pair: tuple[Service, Service]) -> Service:
    return pair[1]


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    error: dict[str, Any] = body["error"]
    return error


async def post(
    sim: Service, path: str, content: str | bytes, headers: dict[str, str] = JSON
) -> httpx.Response:
    async with httpx.AsyncClient(timeout=CALL_TIMEOUT_S) as http:
        return await http.post(f"{sim.http_url}{path}", content=content, headers=headers)


async def still_serves(sim: Service) -> None:
    body = {"prompt": "still there?", "max_tokens": 3}
    response = await post(sim, "/v1/completions", json.dumps(body))
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3
    await wait_all_free(sim.address)


def assert_no_traceback(sim: Service) -> None:
    logged = "".join(list(sim.output))
    assert "Traceback" not in logged and "Exception in ASGI application" not in logged, logged[-3000:]


# ---- bodies ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [{"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"}, {}],
    ids=["text/plain", "form", "none"],
)
async def test_only_json_bodies_are_served(sim: Service, headers: dict[str, str]) -> None:
    """A web page may POST text/plain or a form to 127.0.0.1 without a CORS preflight."""
    response = await post(sim, "/v1/completions", json.dumps({"prompt": "hi"}), headers)
    error = error_of(response, 415)
    assert "application/json" in error["message"] and error["type"] == "invalid_request_error"
    await still_serves(sim)


CHAT = "/v1/chat/completions"
SURROGATE = "\\ud800"  # as the JSON text holds it: parses to a lone surrogate


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", f'{{"prompt": "a{SURROGATE}b"}}', "prompt"),
        ("/v1/completions", f'{{"prompt": "a", "stop": ["x", "{SURROGATE}"]}}', "stop[1]"),
        ("/v1/completions", f'{{"prompt": "a", "model": "{SURROGATE}"}}', "model"),
        (
            "/v1/chat/completions",
            f'{{"messages": [{{"role": "user", "content": "{SURROGATE}"}}]}}',
            "messages[0].content",
        ),
        (
            "/v1/chat/completions",
            f'{{"messages": [{{"role": "{SURROGATE}", "content": "x"}}]}}',
            "messages[0].role",
        ),
    ],
    ids=["prompt", "stop", "model", "content", "role"],
)
async def test_a_lone_surrogate_is_400_naming_the_field(
    sim: Service, path: str, body: str, param: str
) -> None:
    error = error_of(await post(sim, path, body), 400)
    assert error["param"] == param and "surrogate" in error["message"]
    assert_no_traceback(sim)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ('{"prompt": "a", "x": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
        ('{"prompt": "a", "ignored": ' + "9" * 5000 + "}", "not valid JSON"),
        ('{"prompt": "a", "max_tokens": ' + "9" * 5000 + "}", "not valid JSON"),
    ],
    ids=["deep nesting", "huge integer, ignored field", "huge integer"],
)
async def test_json_that_parses_badly_is_400_not_500(sim: Service, body: str, says: str) -> None:
    error = error_of(await post(sim, "/v1/completions", body), 400)
    assert says in error["message"]
    assert_no_traceback(sim)
    await still_serves(sim)


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_tokens", True), ("stream", "yes"), ("n", 1.5), ("echo", 1), ("seed", "7")],
)
async def test_booleans_and_integers_are_strict(sim: Service, field: str, value: object) -> None:
    body = {"prompt": "a", "max_tokens": 2, field: value}
    error = error_of(await post(sim, "/v1/completions", json.dumps(body)), 400)
    assert error["param"] == field


async def test_a_wrong_method_is_405_as_an_invalid_request(sim: Service) -> None:
    async with httpx.AsyncClient(timeout=CALL_TIMEOUT_S) as http:
        response = await http.get(f"{sim.http_url}/v1/completions")
    assert error_of(response, 405)["type"] == "invalid_request_error"


# ---- clients that leave ------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream before its first chunk"])
async def test_a_client_that_leaves_before_its_response_is_a_quiet_abort(
    pair: tuple[Service, Service], stream: bool
) -> None:
    """The worker is stopped while the client sends and leaves, so no token can come first."""
    worker, sim = pair
    body = {"prompt": "leaving", "max_tokens": 500, "stream": stream}
    with paused(worker.proc):
        async with httpx.AsyncClient(timeout=CALL_TIMEOUT_S) as http:
            call = asyncio.create_task(http.post(f"{sim.http_url}/v1/completions", json=body))
            await wait_info(sim.address, lambda i: i.requests_running + i.requests_waiting == 1, "admitted")
            call.cancel()  # the connection closes
            with pytest.raises(asyncio.CancelledError):
                await call
        await wait_info(sim.address, lambda i: i.requests_running + i.requests_waiting == 0, "aborted")
    await still_serves(sim)
    assert_no_traceback(sim)
    assert (await server_info(sim.address)).worker_connected


# ---- shutdown past --grace ---------------------------------------------------------------

GRACE_S = 2.0
ENDLESS = 8000  # tokens: 24 s at least at the sim's 3 ms a step, far past --grace


@pytest.mark.parametrize("frontends", FRONTEND_COUNTS, ids=lambda n: f"frontends={n}")
async def test_requests_longer_than_the_grace_end_with_an_error_not_a_cut(frontends: int) -> None:
    """SIGTERM with a stream, a whole request and a gRPC stream running, none of which can end
    within --grace: the stream ends with an OpenAI error event and [DONE], the whole request
    with a 503 in OpenAI's shape, the gRPC call with UNAVAILABLE."""
    flags = ["--http-port", str(unused_port()), "--grace", str(GRACE_S), *frontend_flags(frontends)]
    with serving_pair(SIM, flags) as (_, sim):
        await wait_frontends_serving(sim.address, frontends)
        body = {"prompt": "endless", "max_tokens": ENDLESS, "ignore_eos": True}
        url = f"{sim.http_url}/v1/completions"
        async with (
            httpx.AsyncClient(timeout=CALL_TIMEOUT_S) as http,
            grpc.aio.insecure_channel(sim.address) as channel,
            http.stream("POST", url, json={**body, "stream": True}) as stream,
        ):
            lines = stream.aiter_lines()
            assert (await anext(lines)).startswith("data: ")  # streaming
            whole = asyncio.create_task(http.post(url, json=body))
            grpc_call = await started_call(
                generation_pb2_grpc.GenerationStub(channel),
                pb.GenerateRequest(
                    request_id="g",
                    text="endless",
                    sampling=pb.SamplingParams(max_new_tokens=ENDLESS, ignore_eos=True),
                ),
            )
            await wait_info(sim.address, lambda i: i.requests_running == 3, "three running")
            sim.proc.send_signal(signal.SIGTERM)
            events = [line async for line in lines if line]
            refused = await whole
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await grpc_call
        assert events[-1] == "data: [DONE]", events[-3:]
        last = json.loads(events[-2].removeprefix("data: "))
        assert last["error"]["type"] == "service_unavailable_error" and "--grace" in last["error"]["message"]
        assert "--grace" in error_of(refused, 503)["message"]
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
        assert sim.proc.wait(STOP_TIMEOUT_S) == 0
        assert_no_traceback(sim)


# ---- the request head and body: size and time ------------------------------------------------

PATIENCE_S = 2.0  # --http-head-timeout and --http-body-timeout of `limited`


@pytest.fixture(scope="module")
def limited() -> Iterator[Service]:
    flags = ["--http-port", str(unused_port())]
    flags += ["--http-head-timeout", str(PATIENCE_S), "--http-body-timeout", str(PATIENCE_S)]
    flags += ["--allowed-hosts", "127.0.0.1,localhost"]
    with serving_pair(SIM, flags) as (_, scheduler):
        yield scheduler


async def exchange(service: Service, *parts: bytes) -> tuple[int, bytes]:
    """Sends `parts` on one connection (until the server stops reading), then reads until the
    server closes it: its status and body. The server must close it (a hang guard bounds it)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", http_port(service))
    try:
        with contextlib.suppress(ConnectionError):  # a server that refuses may close mid-send
            for part in parts:
                writer.write(part)
                await writer.drain()
        response = await asyncio.wait_for(reader.read(), CALL_TIMEOUT_S)
    finally:
        writer.close()
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body


def http_port(service: Service) -> int:
    return int(service.http_url.rsplit(":", 1)[1])


HEAD = b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"


async def test_an_endless_header_is_431_once_it_passes_the_limit(limited: Service) -> None:
    """An unauthenticated client sends a header that never ends: it is cut at 32 KiB."""
    status, body = await exchange(limited, HEAD, b"x-endless: ", *[b"a" * 4096] * 64)  # 256 KiB
    assert status == 431 and b"32768 bytes" in body
    await still_serves(limited)


async def test_too_many_header_fields_is_431(limited: Service) -> None:
    fields = b"".join(b"x-h%d: v\r\n" % i for i in range(150))
    status, body = await exchange(limited, HEAD + fields + b"content-length: 2\r\n\r\n{}")
    assert status == 431 and b"100 header fields" in body
    await still_serves(limited)


async def test_half_sent_heads_are_closed_with_408_and_the_server_serves_meanwhile(limited: Service) -> None:
    """Slowloris: 50 connections each stop mid-head; while they are open a request is served;
    each is answered 408 and closed after --http-head-timeout."""
    stalled = [asyncio.create_task(exchange(limited, HEAD + b"x-slow: 1\r\n")) for _ in range(50)]
    await still_serves(limited)
    outcomes = await asyncio.gather(*stalled)
    assert {status for status, _ in outcomes} == {408}
    await still_serves(limited)


async def test_a_body_that_pauses_is_408(limited: Service) -> None:
    status, body = await exchange(limited, HEAD + b"content-length: 100\r\n\r\n", b'{"prompt": ')
    assert status == 408 and b"body paused" in body
    await still_serves(limited)
    assert_no_traceback(limited)


# ---- file descriptors ------------------------------------------------------------------------

FD_LIMIT = 256  # the scheduler's `ulimit -n` (and its frontends'): its HTTP keeps 128 connections
HALF_SENT = 400  # connections stopped mid-head: more than the process has file descriptors


@pytest.mark.parametrize("frontends", FRONTEND_COUNTS, ids=lambda n: f"frontends={n}")
async def test_more_half_sent_connections_than_file_descriptors_leave_every_api_serving(
    frontends: int,
) -> None:
    """400 connections that never finish their head (no head timeout comes to close them), on
    a scheduler with 256 file descriptors: its HTTP keeps at most half, closing the oldest
    waiting one for a new one (408); gRPC, /metrics and HTTP keep answering, a restarted worker
    is reconnected, and running out of descriptors (accepts come in bursts) is a line in the
    log, not a traceback at each accept."""
    worker_port = unused_port()
    worker = spawn_worker(SIM, port=worker_port)
    flags = ["--http-port", str(unused_port()), "--http-head-timeout", "3600", *frontend_flags(frontends)]
    scheduler = spawn_scheduler(worker.address, flags, fd_limit=FD_LIMIT)
    half_sent: list[socket.socket] = []
    try:
        wait_serving(scheduler.address, frontends=max(frontends, 1))
        for _ in range(HALF_SENT):
            half_sent.append(socket.create_connection(("127.0.0.1", http_port(scheduler)), CALL_TIMEOUT_S))
            half_sent[-1].sendall(HEAD + b"x-slow: 1\r\n")
        async with httpx.AsyncClient(timeout=CALL_TIMEOUT_S) as http:
            assert (await http.get(scheduler.metrics_url)).status_code == 200
        assert (await server_info(scheduler.address)).model == "sim"
        await still_serves(scheduler)
        assert closed_by_the_server(half_sent[0])  # the oldest made room

        worker.stop()
        worker = spawn_worker(SIM, port=worker_port)
        await still_serves(scheduler)  # waits for the worker, through the scheduler's reconnect
        assert (await server_info(scheduler.address)).model == "sim"
    finally:
        for sock in half_sent:
            sock.close()
        scheduler.stop()
        worker.stop()
    logged = "".join(scheduler.output)
    assert "Traceback" not in logged, logged[-3000:]
    assert logged.count("out of system resource") <= 2 * max(frontends, 1), logged[-3000:]


def test_running_out_of_descriptors_is_a_line_a_while(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """What asyncio hands its exception handler at each failed accept, 1,000 times: one line,
    no traceback; any other error still goes to asyncio's own handler."""
    loop = asyncio.new_event_loop()
    handled: list[dict[str, Any]] = []
    loop.default_exception_handler = handled.append  # type: ignore[method-assign,assignment]
    report = ResourceErrors(interval_s=3600)
    emfile = OSError(errno.EMFILE, "Too many open files")
    with caplog.at_level(logging.ERROR, "stepahead.serving"):
        for _ in range(1000):
            report(loop, {"message": "socket.accept() out of system resource", "exception": emfile})
        report(loop, {"message": "something else", "exception": ValueError("x")})
    loop.close()
    assert len(caplog.records) == 1 and caplog.records[0].exc_info is None
    assert "Too many open files" in caplog.text and "ulimit -n" in caplog.text
    assert [context["message"] for context in handled] == ["something else"]


def closed_by_the_server(sock: socket.socket) -> bool:
    """Whether the server closed it: with a 408, or with a reset (what it had sent is lost to the
    reset when it closes at once, its place needed)."""
    sock.settimeout(CALL_TIMEOUT_S)
    try:
        answer = sock.recv(64)
    except ConnectionResetError:
        return True
    return answer == b"" or answer.startswith(b"HTTP/1.1 408 ")


# ---- Host ------------------------------------------------------------------------------------


async def test_a_host_not_allowed_is_400_and_health_answers_any(limited: Service) -> None:
    """`limited` serves --allowed-hosts 127.0.0.1,localhost: a page that rebinds its own name to
    127.0.0.1 still sends that name, and is refused."""
    async with httpx.AsyncClient(timeout=CALL_TIMEOUT_S) as http:
        body = {"prompt": "hi", "max_tokens": 1}
        url = f"{limited.http_url}/v1/completions"
        refused = await http.post(url, json=body, headers={"host": "rebound.example:8000"})
        error = error_of(refused, 400)
        assert error["code"] == "invalid_host" and "rebound.example" in error["message"]
        assert "--allowed-hosts" in error["message"]
        models = await http.get(f"{limited.http_url}/v1/models", headers={"host": "localhost:8000"})
        assert models.status_code == 200
        health = await http.get(f"{limited.http_url}/health", headers={"host": "rebound.example"})
        assert health.status_code == 200
        # Scrapers (Prometheus, an inference gateway's endpoint picker) address pods by IP.
        metrics = await http.get(f"{limited.http_url}/metrics", headers={"host": "10.1.2.3:8000"})
        assert metrics.status_code == 200 and "stepahead_requests_running" in metrics.text
        tokenize = await http.post(
            f"{limited.http_url}/tokenize", json={"prompt": "x"}, headers={"host": "a.b"}
        )
        error_of(tokenize, 400)
    await still_serves(limited)


# ---- large work ------------------------------------------------------------------------------


async def test_a_1mib_prompt_is_refused_naming_the_limit_and_the_server_serves(sim: Service) -> None:
    """Tokenized off the event loop (`test_large_work.py` forces that), then refused: it is
    longer than the context."""
    body = {"prompt": "word " * 200_000, "max_tokens": 1}  # 1,000,000 bytes: within --max-text-bytes
    error = error_of(await post(sim, "/v1/completions", json.dumps(body)), 400)
    assert error["param"] == "prompt" and "at most" in error["message"]
    await still_serves(sim)


async def test_a_whole_response_of_too_many_logprobs_is_400_and_a_stream_of_them_is_served(
    sim: Service,
) -> None:
    """n 16 x max_tokens 1000 x (1 + 20) log-probabilities: over what a whole response holds;
    streamed, the same request is served (here: until its first chunk, then left)."""
    body = {"prompt": "hi", "n": 16, "max_tokens": 1000, "logprobs": 20}
    error = error_of(await post(sim, "/v1/completions", json.dumps(body)), 400)
    assert error["param"] == "logprobs" and "asks for 336000" in error["message"]
    assert '"stream": true' in error["message"]
    async with (
        httpx.AsyncClient(timeout=CALL_TIMEOUT_S) as http,
        http.stream("POST", f"{sim.http_url}/v1/completions", json={**body, "stream": True}) as stream,
    ):
        assert stream.status_code == 200
        first = json.loads((await anext(stream.aiter_lines())).removeprefix("data: "))
        assert first["choices"][0]["logprobs"]["top_logprobs"]
    await still_serves(sim)
