"""Prometheus plumbing both services share: constant labels and the HTTP endpoint.

The endpoint is a minimal HTTP/1.1 server on asyncio streams with bounded resources: a
capped number of connections, a deadline to send the request head and one to read the
answer, and a small fixed pool of threads that render the exposition. An idle client
costs a socket, never a thread.
"""

from __future__ import annotations

import asyncio
import gzip
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from stepahead.heap import GcCollector

log = logging.getLogger(__name__)

METRICS_PATHS = frozenset({"/metrics", "/"})

# The label values and histogram buckets of both services' metrics, each written once.
FORWARD_MODES = ("prefill", "decode", "mixed")
PHASES = ("pick", "launch", "wait", "process")
FINISH_REASONS = ("length", "stop", "tool_calls", "abort", "error")
# seconds
LINK_RTT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.004, 0.006, 0.01, 0.02, 0.05, 0.1, 0.25)
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
PHASE_BUCKETS = (
    0.00001,
    0.000025,
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)
BATCH_TOKEN_BUCKETS = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
# the worker's
STEP_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)
GAP_BUCKETS = (
    0.00002,
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1.0,
)


class ConstLabels(Collector):
    """Adds a service's constant labels to every sample of another collector (`labels` may be
    a function, read at each collection: a label known only once the service runs)."""

    def __init__(self, inner: Collector, labels: dict[str, str] | Callable[[], dict[str, str]]) -> None:
        self._inner = inner
        self._labels = labels

    def collect(self) -> Iterator[Metric]:
        labels = self._labels() if callable(self._labels) else self._labels
        for family in self._inner.collect():
            labeled = Metric(family.name, family.documentation, family.type, family.unit)
            for s in family.samples:
                labeled.add_sample(s.name, {**s.labels, **labels}, s.value, s.timestamp, s.exemplar)
            yield labeled


def labelled(inner: Collector, labels: Callable[[], dict[str, str]]) -> CollectorRegistry:
    """A registry that exposes `inner` with `labels` added to every sample."""
    view = CollectorRegistry(auto_describe=False)
    view.register(ConstLabels(inner, labels))
    return view


def new_registry(const_labels: dict[str, str]) -> CollectorRegistry:
    """A registry with process metrics (CPU, memory, garbage collections) under the service's
    labels."""
    registry = CollectorRegistry()
    registry.register(ConstLabels(ProcessCollector(registry=None), const_labels))
    registry.register(ConstLabels(GcCollector(), const_labels))
    return registry


@dataclass(frozen=True)
class EndpointLimits:
    read_timeout_s: float = 5.0  # request line and headers, in total
    write_timeout_s: float = 10.0  # the answer, to a client that reads it slowly
    max_head_bytes: int = 8192  # request line and headers
    max_connections: int = 64  # beyond it the oldest still sending its head is dropped
    scrape_threads: int = 2  # render the exposition: collectors may block


DEFAULT_LIMITS = EndpointLimits()


@dataclass(frozen=True)
class Answer:
    status: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()


def plain(status: str, text: str, *headers: tuple[str, str]) -> Answer:
    return Answer(status, text.encode(), (("Content-Type", "text/plain; charset=utf-8"), *headers))


NOT_FOUND = plain("404 Not Found", "not found: try /metrics\n")
NOT_ALLOWED = plain("405 Method Not Allowed", "only GET\n", ("Allow", "GET"))
BAD_REQUEST = plain("400 Bad Request", "bad request\n")
TOO_LARGE = plain("431 Request Header Fields Too Large", "request head too large\n")
FAILED = plain("500 Internal Server Error", "collecting metrics failed\n")


class MetricsEndpoint:
    """GET /metrics (or /) answers the registry's exposition; every connection is closed after
    one answer."""

    def __init__(self, registry: CollectorRegistry, limits: EndpointLimits = DEFAULT_LIMITS) -> None:
        self._registry = registry
        self._limits = limits
        self._executor = ThreadPoolExecutor(limits.scrape_threads, thread_name_prefix="metrics-scrape")
        self._reading: dict[asyncio.StreamWriter, None] = {}  # still sending their head, oldest first
        self._answering = 0

    async def serve_forever(self, sock: socket.socket) -> None:
        """Serves on the listening `sock` until cancelled."""
        server = await asyncio.start_server(self._connection, sock=sock, limit=self._limits.max_head_bytes)
        try:
            async with server:
                await server.serve_forever()
        finally:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def _admit(self) -> bool:
        """Room for one more connection, made by dropping the oldest idle one if need be."""
        if len(self._reading) + self._answering < self._limits.max_connections:
            return True
        if not self._reading:
            return False
        oldest = next(iter(self._reading))
        del self._reading[oldest]
        oldest.transport.abort()
        return True

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if self._admit():
                await self._exchange(reader, writer)
        except ConnectionError:
            pass
        finally:
            if not writer.transport.is_closing():
                writer.transport.abort()

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reading[writer] = None
        try:
            head = await self._read_head(reader)
        finally:
            self._reading.pop(writer, None)
        if head is None:
            return  # timed out, closed or dropped: nobody to answer
        self._answering += 1
        try:
            await self._send(writer, head if isinstance(head, Answer) else await self._answer(head))
        finally:
            self._answering -= 1

    async def _read_head(self, reader: asyncio.StreamReader) -> list[str] | Answer | None:
        """The request line and header lines; TOO_LARGE over `max_head_bytes`; None on a
        timeout or a connection closed first."""
        lines: list[str] = []
        size = 0
        try:
            async with asyncio.timeout(self._limits.read_timeout_s):
                while True:
                    line = await reader.readline()
                    size += len(line)
                    if size > self._limits.max_head_bytes:
                        return TOO_LARGE
                    if not line.endswith(b"\n"):
                        return None
                    if line.strip():
                        lines.append(line.decode("latin-1").rstrip("\r\n"))
                    elif lines:
                        return lines
        except ValueError:  # a line over the reader's limit
            return TOO_LARGE
        except (TimeoutError, ConnectionError):
            return None

    async def _answer(self, head: list[str]) -> Answer:
        parts = head[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            return BAD_REQUEST
        method, target, _ = parts
        if method != "GET":
            return NOT_ALLOWED
        if target.split("?", 1)[0] not in METRICS_PATHS:
            return NOT_FOUND
        compress = accepts_gzip(header_value(head[1:], "accept-encoding"))
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor, self._render, compress)
        except Exception:
            log.exception("collecting metrics failed")
            return FAILED

    def _render(self, compress: bool) -> Answer:
        """Runs in a scrape thread, never on the event loop: collectors may wait on it."""
        body = generate_latest(self._registry)
        headers = [("Content-Type", CONTENT_TYPE_LATEST)]
        if compress:
            body = gzip.compress(body)
            headers.append(("Content-Encoding", "gzip"))
        return Answer("200 OK", body, tuple(headers))

    async def _send(self, writer: asyncio.StreamWriter, answer: Answer) -> None:
        """Writes `answer` and closes; a client that does not read it in time is cut off."""
        writer.transport.set_write_buffer_limits(high=0)  # drain() waits for the whole answer
        writer.write(encode(answer))
        try:
            async with asyncio.timeout(self._limits.write_timeout_s):
                await writer.drain()
        except TimeoutError:
            return
        writer.close()


def encode(answer: Answer) -> bytes:
    headers = [*answer.headers, ("Content-Length", str(len(answer.body))), ("Connection", "close")]
    lines = [f"HTTP/1.1 {answer.status}", *(f"{name}: {value}" for name, value in headers), "", ""]
    return "\r\n".join(lines).encode("latin-1") + answer.body


def header_value(lines: list[str], name: str) -> str:
    """The value of header `name` (lower case), or "" if absent."""
    for line in lines:
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() == name:
            return value.strip()
    return ""


def accepts_gzip(accept_encoding: str) -> bool:
    return any(token.split(";")[0].strip().lower() == "gzip" for token in accept_encoding.split(","))


_serving: set[asyncio.Task[None]] = set()  # the endpoints on running loops, kept from collection


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on `host` (its first address) and `port` (0: any free one)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((host, port), family=family)


def serve_metrics(
    registry: CollectorRegistry, host: str, port: int, limits: EndpointLimits = DEFAULT_LIMITS
) -> int:
    """Serves /metrics on the running event loop, or on one thread of its own when no loop
    runs; returns the bound port. The port is bound before returning: OSError if taken."""
    sock = listen(host, port)
    serving = MetricsEndpoint(registry, limits).serve_forever(sock)
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        threading.Thread(target=asyncio.run, args=(serving,), name="metrics", daemon=True).start()
    else:
        task = loop.create_task(serving)
        _serving.add(task)
        task.add_done_callback(_serving.discard)
    return int(sock.getsockname()[1])
