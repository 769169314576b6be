"""The /metrics endpoint: bounded threads and connections, HTTP answers, live services."""

from __future__ import annotations

import asyncio
import gzip
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack

import pytest
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from stepahead.metrics import EndpointLimits, serve_metrics
from stepahead.processes import START_TIMEOUT_S, Service, serving_pair, spawn_worker
from tests.live import CALL_TIMEOUT_S, SETTLE_TIMEOUT_S

SIM = ["--model", "sim"]
IDLE_CONNECTIONS = 300
EXTRA_THREADS = 5  # what 300 idle connections may add to a live process, at most
# The server hangs up on an idle connection after its read timeout (5 s); a hang guard well past it.
CLOSE_WAIT_S = SETTLE_TIMEOUT_S


@pytest.fixture(scope="module")
def worker() -> Iterator[Service]:
    service = spawn_worker(SIM)
    try:
        yield service
    finally:
        service.stop()


def threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("Threads:"))
    return int(line.split()[1])


def address(url: str) -> tuple[str, int]:
    parts = urllib.parse.urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


def scrape(url: str, headers: dict[str, str] | None = None) -> tuple[str, bytes, dict[str, str]]:
    """(content type, body, headers) of a GET."""
    request = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(request, timeout=15) as response:
        return response.headers["Content-Type"], response.read(), dict(response.headers)


def status_of(url: str, method: str = "GET") -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=15) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def family_names(text: str) -> set[str]:
    return {family.name for family in text_string_to_metric_families(text)}


def open_idle(stack: ExitStack, host: str, port: int, n: int) -> list[socket.socket]:
    """`n` connections that never send a byte (past the listen backlog, a connect waits for a
    SYN retry: seconds)."""
    connect = socket.create_connection
    return [stack.enter_context(connect((host, port), timeout=SETTLE_TIMEOUT_S)) for _ in range(n)]


def hung_up(sock: socket.socket, timeout_s: float) -> bool:
    """Whether the server closes `sock` within `timeout_s` without sending anything."""
    sock.settimeout(timeout_s)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_idle_connections_add_no_threads_and_get_closed(worker: Service) -> None:
    host, port = address(worker.metrics_url)
    scrape(worker.metrics_url)  # the scrape threads exist from here on
    before = threads(worker.proc.pid)
    with ExitStack() as stack:
        idle = open_idle(stack, host, port, IDLE_CONNECTIONS)
        content_type, body, _ = scrape(worker.metrics_url)
        during = threads(worker.proc.pid)
        deadline = time.monotonic() + CLOSE_WAIT_S
        closed = sum(hung_up(sock, max(0.1, deadline - time.monotonic())) for sock in idle)
    assert during < before + EXTRA_THREADS, f"{before} threads before, {during} with 300 idle connections"
    assert content_type == CONTENT_TYPE_LATEST
    assert "stepahead_batches" in family_names(body.decode())
    assert closed == IDLE_CONNECTIONS
    assert threads(worker.proc.pid) < before + EXTRA_THREADS


def test_http_answers(worker: Service) -> None:
    base = worker.metrics_url.removesuffix("/metrics")
    assert status_of(f"{base}/metrics") == 200
    assert status_of(f"{base}/") == 200
    assert status_of(f"{base}/metrics?name[]=x") == 200
    assert status_of(f"{base}/other") == 404
    assert status_of(f"{base}/metrics", method="POST") == 405
    assert status_of(f"{base}/metrics", method="HEAD") == 405


def test_malformed_and_oversized_requests_are_refused(worker: Service) -> None:
    host, port = address(worker.metrics_url)
    for request, status in (
        (b"NONSENSE\r\n\r\n", b"400"),
        (b"GET /metrics HTTP/1.1\r\nX-Pad: " + b"x" * 10_000 + b"\r\n\r\n", b"431"),
    ):
        with socket.create_connection((host, port), timeout=15) as sock:
            sock.sendall(request)
            assert sock.recv(64).split(b" ")[1] == status


def test_exposition_parses_plain_and_gzip(worker: Service) -> None:
    _, plain, _ = scrape(worker.metrics_url)
    _, packed, headers = scrape(worker.metrics_url, {"Accept-Encoding": "gzip"})
    assert headers["Content-Encoding"] == "gzip"
    for text in (plain.decode(), gzip.decompress(packed).decode()):
        assert {"stepahead_batches", "process_cpu_seconds"} <= family_names(text)


def test_a_taken_metrics_port_names_the_flag(worker: Service) -> None:
    _, port = address(worker.metrics_url)
    flags = ["--port", "0", *SIM, "--metrics-port", str(port)]
    done = subprocess.run(
        [sys.executable, "-m", "worker_svc", *flags], capture_output=True, text=True, timeout=START_TIMEOUT_S
    )
    assert done.returncode == 1
    assert "--metrics-port" in done.stderr


def test_a_scheduler_serves_its_frontends_metrics() -> None:
    with serving_pair(SIM) as (_, scheduler):
        content_type, body, _ = scrape(scheduler.metrics_url)
    assert content_type == CONTENT_TYPE_LATEST
    assert {"stepahead_frontends", "stepahead_requests_running"} <= family_names(body.decode())


class LoopBound(Collector):
    """Collects by waiting on the event loop, as the scheduler's frontend metrics do."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def collect(self) -> Iterator[Metric]:
        value = asyncio.run_coroutine_threadsafe(asyncio.sleep(0, 42.0), self._loop).result(10)
        yield GaugeMetricFamily("loop_bound", "A value the event loop hands over.", value=value)


async def get(port: int, path: str = "/metrics") -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    answer = await asyncio.wait_for(reader.read(), CALL_TIMEOUT_S)
    writer.close()
    return answer


def test_collectors_may_wait_on_the_serving_loop() -> None:
    async def scenario() -> bytes:
        registry = CollectorRegistry()
        registry.register(LoopBound(asyncio.get_running_loop()))
        return await get(serve_metrics(registry, "127.0.0.1", 0))

    head, _, body = asyncio.run(scenario()).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ")
    assert b"Connection: close" in head
    assert b"loop_bound 42.0" in body


def test_beyond_the_cap_the_oldest_idle_connection_makes_room() -> None:
    """No read timeout within the test (a hang guard's): only the cap closes connections. They
    are admitted in the order they connect: idle connections 5 to 10 drop 1 to 6, the scrape
    drops the 7th, and the last three are left (the read timeout's test is the next one)."""
    limits = EndpointLimits(read_timeout_s=CALL_TIMEOUT_S, max_connections=4)

    async def scenario() -> tuple[bytes, list[bytes]]:
        registry = CollectorRegistry()
        Counter("scrapes", "A counter.", registry=registry).inc()
        port = serve_metrics(registry, "127.0.0.1", 0, limits)
        idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(10)]
        answer = await get(port)
        closed = [await asyncio.wait_for(reader.read(), CALL_TIMEOUT_S) for reader, _ in idle[:7]]
        for _, writer in idle:
            writer.close()
        return answer, closed

    answer, closed = asyncio.run(scenario())
    assert answer.startswith(b"HTTP/1.1 200 ") and b"scrapes_total 1.0" in answer
    assert closed == [b""] * 7


def test_an_idle_connection_is_closed_at_the_read_timeout() -> None:
    limits = EndpointLimits(read_timeout_s=0.5, max_connections=4)

    async def scenario() -> tuple[bytes, float]:
        port = serve_metrics(CollectorRegistry(), "127.0.0.1", 0, limits)
        start = time.monotonic()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)  # it never sends a byte
        closed = await asyncio.wait_for(reader.read(), CALL_TIMEOUT_S)
        writer.close()
        return closed, time.monotonic() - start

    closed, waited = asyncio.run(scenario())
    assert closed == b"" and waited >= limits.read_timeout_s
