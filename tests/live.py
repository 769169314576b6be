"""Helpers for tests against live processes on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator

import grpc

from bench import link_delay
from stepahead.processes import Service, spawn_scheduler, wait_serving
from stepahead.v1 import generation_pb2 as pb
from stepahead.v1 import generation_pb2_grpc, worker_pb2, worker_pb2_grpc

# Hang guards (never expectations; ten times or more above what a slow machine of this kind needs):
CALL_TIMEOUT_S = 300.0  # one whole call of a test's load (milliseconds to a few seconds here)
SETTLE_TIMEOUT_S = 120.0  # a state a test waits for (slots freed, a worker seen): milliseconds
POLL_S = 0.02


def request(text: str, max_new_tokens: int, rid: str = "", **sampling: object) -> pb.GenerateRequest:
    """A text request; `sampling` holds the other SamplingParams fields."""
    return pb.GenerateRequest(
        request_id=rid,
        text=text,
        sampling=pb.SamplingParams(max_new_tokens=max_new_tokens, **sampling),  # type: ignore[arg-type]
    )


async def generate(address: str, req: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    """Every response of one Generate call."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        return [r async for r in stub.Generate(req, timeout=CALL_TIMEOUT_S)]


# Ports a test hands to a service it starts come from below the kernel's ephemeral range
# (32768-60999 by default), so no client connection or `bind(0)` elsewhere can take one between
# the check here and the service's own bind; each pytest-xdist worker draws from a range of its own.
PORTS_FROM, PORTS_PER_WORKER = 20000, 1500
_next_port = itertools.count(random.randrange(PORTS_PER_WORKER))


def unused_port() -> int:
    """A free 127.0.0.1 port of this test process's range (see PORTS_FROM)."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    first = PORTS_FROM + (worker % 8) * PORTS_PER_WORKER
    for _ in range(PORTS_PER_WORKER):
        port = first + next(_next_port) % PORTS_PER_WORKER
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError(f"no free port in {first}..{first + PORTS_PER_WORKER - 1}")


async def server_info(address: str) -> pb.GetServerInfoResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        return await stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=CALL_TIMEOUT_S)


async def wait_info(
    address: str, ready: Callable[[pb.GetServerInfoResponse], bool], what: str
) -> pb.GetServerInfoResponse:
    """Poll GetServerInfo until `ready` holds (SETTLE_TIMEOUT_S at most)."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        while True:
            info = await stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=CALL_TIMEOUT_S)
            if ready(info):
                return info
            if time.monotonic() > deadline:
                raise AssertionError(f"not {what} after {SETTLE_TIMEOUT_S:g}s: {info}")
            await asyncio.sleep(POLL_S)


def all_free(info: pb.GetServerInfoResponse) -> bool:
    free = info.kv_slots_free == info.kv_slots and info.request_slots_free == info.request_slots
    return free and not info.requests_running and not info.requests_waiting


async def wait_all_free(address: str) -> pb.GetServerInfoResponse:
    """Until every KV and request slot is free and nothing runs or waits."""
    return await wait_info(address, all_free, "all free")


FRONTEND_COUNTS = (0, 2)  # the suites that must hold for any process layout run with each


def frontend_flags(count: int) -> list[str]:
    return ["--frontends", str(count)]


def own_channel(address: str) -> grpc.aio.Channel:
    """A channel with its own TCP connection (channels of one process share them otherwise): with
    several frontends on one port, each connection lands on one of them."""
    return grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


async def frontend_of(channel: grpc.aio.Channel) -> str:
    """Which frontend serves this channel (the `stepahead-frontend` trailing metadata of a call)."""
    probe = pb.GenerateRequest(input_ids=pb.TokenIds(ids=[65]), sampling=pb.SamplingParams(max_new_tokens=1))
    call = generation_pb2_grpc.GenerationStub(channel).Generate(probe, timeout=CALL_TIMEOUT_S)
    async for _ in call:
        pass
    return str(dict(await call.trailing_metadata())["stepahead-frontend"])


async def channels_by_frontend(
    address: str, frontends: int, per_frontend: int
) -> dict[str, list[grpc.aio.Channel]]:
    """`per_frontend` channels on each of the `frontends` processes (one frontend for 0)."""
    wanted = max(frontends, 1)
    found: dict[str, list[grpc.aio.Channel]] = {}
    for _ in range(40 * wanted * per_frontend):
        channel = own_channel(address)
        group = found.setdefault(await frontend_of(channel), [])
        if len(group) < per_frontend:
            group.append(channel)
        else:
            await channel.close()
        if len(found) == wanted and all(len(g) == per_frontend for g in found.values()):
            return found
    raise AssertionError(f"connections reached only frontends {sorted(found)}")


async def worker_stats_after_drain(address: str) -> worker_pb2.WorkerStats:
    """The worker's counters once its last request slot is released and every launched step
    has run (the releases reach the worker with an idle launch)."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    async with grpc.aio.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        while True:
            stats = await stub.GetStats(worker_pb2.GetStatsRequest(), timeout=CALL_TIMEOUT_S)
            if stats.live_request_slots == 0 and stats.steps_executed == stats.last_step_id:
                return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"request slots still live on the worker: {stats}")
            await asyncio.sleep(POLL_S)


def wait_until(ready: Callable[[], bool], what: str, timeout_s: float = SETTLE_TIMEOUT_S) -> None:
    """Poll `ready` until it holds; fail naming `what` after `timeout_s` (a hang guard)."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} after {timeout_s:g}s")
        time.sleep(POLL_S)


@contextlib.contextmanager
def paused(proc: subprocess.Popen[str]) -> Iterator[None]:
    """The process stopped (SIGSTOP) until the block ends, then continued: nothing it runs can
    move on meanwhile, so a test can look at a state and act on it (kill it, say) knowing the
    state still holds. Keep the block short: its peers' watchdogs still run (a scheduler gives up
    on a worker whose step takes over --worker-step-timeout, 10 s by default)."""
    proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)


async def wait_frontends_serving(address: str, frontends: int) -> None:
    """Until each of the scheduler's `frontends` processes (its own for 0) answers SERVING: each
    hears of the worker session from the core on its own, so one may serve while another still
    refuses calls with UNAVAILABLE, and a new connection lands on any of them."""
    await asyncio.to_thread(wait_serving, address, SETTLE_TIMEOUT_S, None, max(frontends, 1))


async def started_call(
    stub: generation_pb2_grpc.GenerationAsyncStub, req: pb.GenerateRequest
) -> asyncio.Task[list[int]]:
    """The call once its first response is in (it is running); the task returns all its tokens."""
    call = stub.Generate(req, timeout=CALL_TIMEOUT_S)
    first = await call.read()
    assert isinstance(first, pb.GenerateResponse), first

    async def rest() -> list[int]:
        tokens = list(first.token_ids)
        while isinstance(response := await call.read(), pb.GenerateResponse):
            tokens += response.token_ids
        return tokens

    return asyncio.create_task(rest())


@contextlib.contextmanager
def scheduler_behind_a_link(worker_address: str, delay_ms: float, args: list[str]) -> Iterator[Service]:
    """A scheduler that reaches the worker through `bench.link_delay` (`delay_ms` each way),
    SERVING; stopped on exit, then the proxy."""
    with link_delay.running(worker_address, delay_ms) as proxied:
        scheduler = spawn_scheduler(proxied, args)
        try:
            wait_serving(scheduler.address)
            yield scheduler
        finally:
            scheduler.stop()
