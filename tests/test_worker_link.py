"""The worker link under faults that do not close a socket: a stopped worker, a stopped scheduler,
and clients that are not the scheduler.

A stopped (SIGSTOP) process keeps its sockets open: the scheduler finds a stopped worker with its
watchdog (--worker-step-timeout), the worker a silent scheduler with --scheduler-timeout. Each
test stops a process while the state it needs holds (requests seen streaming, a session seen
live) and polls for the outcome, with hang guards only."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.promtext import scrape, total
from stepahead.processes import Link, Service, link_socket, spawn_scheduler, spawn_worker, wait_serving
from stepahead.protocol import PROTOCOL_VERSION, Launch, NewRequest, launch_to_proto
from stepahead.v1 import generation_pb2 as pb
from stepahead.v1 import generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.live import (
    CALL_TIMEOUT_S,
    SETTLE_TIMEOUT_S,
    paused,
    server_info,
    started_call,
    unused_port,
    wait_info,
    wait_until,
)
from worker_svc.backends import sim_continuation as sim_expected

SIM = ["--model", "sim", "--sim-step-ms", "3", "--sim-token-us", "0"]
# A step takes milliseconds; far longer without a result, the worker is hung. gRPC's keepalive
# would find a stopped worker only after its ping timeout (about a minute), so the watchdog does.
STEP_TIMEOUT_S = 5.0
RETRY = ["--worker-retry-timeout", "600"]  # a hang guard: the stopped worker resumes in seconds
SCHEDULER_TIMEOUT_S = 10.0  # the worker's default: five of the scheduler's 2 s idle heartbeats
LONG = 8000  # tokens: 24 s of the sim at 3 ms a step, whatever the machine
TOKEN = "link-secret"


LINKS: tuple[Link, ...] = ("grpc", "socket")


LinkTo = Callable[[Link], tuple[list[str], str | None]]


@pytest.fixture
def link_to() -> Iterator[LinkTo]:
    """The worker's flags for a link and the scheduler's --worker (None: the worker's gRPC
    address); a socket's directory lasts until the test ends."""
    with contextlib.ExitStack() as stack:

        def to(link: Link) -> tuple[list[str], str | None]:
            return ([], None) if link == "grpc" else stack.enter_context(link_socket())

        yield to


@contextmanager
def running(*services: Service) -> Iterator[None]:
    try:
        yield
    finally:
        for service in services:
            if service.proc.poll() is None:
                os.kill(service.proc.pid, signal.SIGCONT)
                service.stop()


def serving_status(address: str) -> int | None:
    """The health status; None when the check fails (it is retried)."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            check = health_pb2.HealthCheckRequest(service="")
            return int(stub.Check(check, timeout=CALL_TIMEOUT_S).status)  # type: ignore[attr-defined]
        except grpc.RpcError:
            return None


def wait_status(address: str, status: int) -> None:
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    wait_until(lambda: serving_status(address) == status, f"{address} {name}")


def request(i: int, n: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=f"l{i}", text=f"link {i}", sampling=pb.SamplingParams(max_new_tokens=n, ignore_eos=True)
    )


def expected(i: int, n: int) -> list[int]:
    return sim_expected(f"link {i}".encode(), n)


async def tokens(stub: generation_pb2_grpc.GenerationAsyncStub, i: int, n: int) -> list[int]:
    return [t async for r in stub.Generate(request(i, n), timeout=CALL_TIMEOUT_S) for t in r.token_ids]


async def aborted(
    stub: generation_pb2_grpc.GenerationAsyncStub, i: int, call: asyncio.Task[list[int]]
) -> None:
    """Abort call i, still running: it ends with a beginning of its tokens."""
    assert not call.done()
    assert (await stub.Abort(pb.AbortRequest(request_id=f"l{i}"), timeout=CALL_TIMEOUT_S)).aborted
    got = await call
    assert 0 < len(got) < LONG and got == expected(i, len(got))


async def load_in_flight(
    stub: generation_pb2_grpc.GenerationAsyncStub, scheduler: Service, worker: Service, lengths: list[int]
) -> tuple[asyncio.Task[list[int]], list[asyncio.Task[list[int]]]]:
    """A LONG call (the last index), running once it streams; then every call of `lengths`,
    sent while the worker is stopped (a client on a starved machine sends slowly while it reads
    streams), returned once the core has admitted them all. The long one runs until aborted."""
    anchor = await started_call(stub, request(len(lengths), LONG))
    with paused(worker.proc):
        clients = [asyncio.create_task(tokens(stub, i, n)) for i, n in enumerate(lengths)]
        live = len(lengths) + 1
        await wait_info(scheduler.address, lambda i: i.requests_running + i.requests_waiting == live, "sent")
    await wait_info(scheduler.address, lambda i: not i.requests_waiting, "all admitted")
    return anchor, clients


def handshake_timed_out(scheduler: Service) -> bool:
    return any("no handshake: the worker said nothing" in line for line in list(scheduler.output))


@pytest.mark.parametrize("link", LINKS)
def test_a_stopped_worker_is_detected_and_the_load_completes_after_it_resumes(
    link: Link, link_to: LinkTo
) -> None:
    link_flags, target = link_to(link)
    worker = spawn_worker([*SIM, *link_flags])
    scheduler = spawn_scheduler(
        target or worker.address, ["--worker-step-timeout", str(STEP_TIMEOUT_S), *RETRY]
    )
    with running(scheduler, worker):
        wait_serving(scheduler.address)
        lengths = [200 + 10 * i for i in range(20)]

        async def load_with_a_stop() -> list[list[int]]:
            async with grpc.aio.insecure_channel(scheduler.address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                anchor, clients = await load_in_flight(stub, scheduler, worker, lengths)
                with paused(worker.proc):  # stopped for longer than the watchdog allows, by design
                    assert (await server_info(scheduler.address)).requests_running > 0
                    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
                    await asyncio.to_thread(wait_status, scheduler.address, not_serving)
                    # ... and no new session can start with it meanwhile:
                    timed_out = lambda: handshake_timed_out(scheduler)  # noqa: E731
                    await asyncio.to_thread(wait_until, timed_out, "a handshake timeout")
                outputs = await asyncio.gather(*clients)
                await aborted(stub, len(lengths), anchor)
                return outputs

        outputs = asyncio.run(load_with_a_stop())
        assert outputs == [expected(i, n) for i, n in enumerate(lengths)]
        assert total(scrape(scheduler.metrics_url), "stepahead_worker_step_timeouts_total") >= 1


SLOW_TIMEOUT_S = 2.0  # --worker-step-timeout of the slow-worker cases: each step is slower


@pytest.mark.parametrize(
    ("step_ms", "depth", "n"),
    [(1000, "3", 8), (3 * SLOW_TIMEOUT_S * 1000, "1", 2)],
    ids=["steps over timeout/(depth+1) at depth 3", "one step three timeouts long"],
)
def test_a_slow_worker_is_not_a_dead_one(step_ms: float, depth: str, n: int) -> None:
    """Every step is slower than the watchdog would allow from launch to result (at depth 3,
    four batches in flight at a second each; or one step of three timeouts): the worker's
    keepalives keep the session, and the requests finish with the sim's tokens."""
    worker = spawn_worker(["--model", "sim", "--sim-step-ms", str(step_ms), "--sim-token-us", "0"])
    flags = ["--worker-step-timeout", str(SLOW_TIMEOUT_S), "--overlap-depth", depth, *RETRY]
    scheduler = spawn_scheduler(worker.address, flags)
    with running(scheduler, worker):
        wait_serving(scheduler.address)

        async def slow_load() -> list[list[int]]:
            async with grpc.aio.insecure_channel(scheduler.address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                return await asyncio.gather(*(tokens(stub, i, n) for i in range(2)))

        assert asyncio.run(slow_load()) == [expected(i, n) for i in range(2)]
        assert total(scrape(scheduler.metrics_url), "stepahead_worker_step_timeouts_total") == 0
        opened = [line for line in list(worker.output) if re.search(r"session \d+ opened", line)]
        assert len(opened) == 1, opened  # one session throughout


def test_a_worker_stopped_for_good_ends_every_request_with_unavailable_in_bounded_time() -> None:
    worker = spawn_worker(SIM)
    flags = ["--worker-step-timeout", str(STEP_TIMEOUT_S), "--worker-retry-timeout", "1"]
    scheduler = spawn_scheduler(worker.address, flags)
    with running(scheduler, worker):
        wait_serving(scheduler.address)

        async def orphaned() -> list[list[int] | BaseException]:
            async with grpc.aio.insecure_channel(scheduler.address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                clients = [
                    await started_call(stub, request(i, 5000)) for i in range(10)
                ]  # 15 s each at least
                with paused(worker.proc):  # until every call has ended
                    info = await server_info(scheduler.address)
                    assert info.requests_running + info.requests_waiting == 10
                    # Bounded: the watchdog, then --worker-retry-timeout (6 s); a hang guard 20 times that.
                    ended = asyncio.gather(*clients, return_exceptions=True)
                    return await asyncio.wait_for(ended, SETTLE_TIMEOUT_S)

        outcomes = asyncio.run(orphaned())
        codes = {o.code() for o in outcomes if isinstance(o, grpc.aio.AioRpcError)}
        assert codes == {grpc.StatusCode.UNAVAILABLE} and len(outcomes) == 10
        assert all(isinstance(o, grpc.aio.AioRpcError) for o in outcomes)


def refused_busy(worker: Service) -> float:
    return total(scrape(worker.metrics_url), "stepahead_worker_sessions_refused_total", reason="busy")


@pytest.mark.parametrize("link", LINKS)
def test_a_stopped_scheduler_frees_the_worker_for_another_one(link: Link, link_to: LinkTo) -> None:
    link_flags, target = link_to(link)
    worker = spawn_worker([*SIM, "--scheduler-timeout", str(SCHEDULER_TIMEOUT_S), *link_flags])
    target = target or worker.address
    first = spawn_scheduler(target, ["--frontends", "0"])
    with running(first, worker):
        wait_serving(first.address)
        second = spawn_scheduler(target, ["--frontends", "0"])
        with running(second):
            # The first's session is live (it heartbeats while idle): the second is turned away.
            wait_until(lambda: refused_busy(worker) >= 1, "the second scheduler refused")
            assert serving_status(second.address) == health_pb2.HealthCheckResponse.NOT_SERVING
            os.kill(first.proc.pid, signal.SIGSTOP)
            wait_serving(second.address)  # once the worker has dropped the silent first

            async def one() -> list[int]:
                async with grpc.aio.insecure_channel(second.address) as channel:
                    return await tokens(generation_pb2_grpc.GenerationStub(channel), 0, 8)

            assert asyncio.run(one()) == expected(0, 8)
            samples = scrape(worker.metrics_url)
            assert total(samples, "stepahead_worker_scheduler_timeouts_total") == 1
            assert total(samples, "stepahead_worker_sessions_refused_total", reason="busy") >= 1
        first.proc.kill()


async def foreign_hello(address: str, token: str | None, send_hello: bool = True) -> grpc.StatusCode:
    """A client that is not the scheduler opens a session (and would drive the device).

    NOTE: under load the gRPC client sometimes reports a stream the server refuses at once as
    INTERNAL ("execute_batch" of a send failed) instead of the server's status; the tests
    therefore count the worker's own refusals, by reason, in its metrics. A call the worker
    refuses before reading it (no or a wrong token) sends no Hello.
    """
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    hello = worker_pb2.Hello(protocol_version=PROTOCOL_VERSION, scheduler_id="foreign")
    async with grpc.aio.insecure_channel(address) as channel:
        call = worker_pb2_grpc.WorkerStub(channel).Connect(metadata=metadata, timeout=CALL_TIMEOUT_S)
        try:
            if send_hello:
                await call.write(worker_pb2.SchedulerMessage(hello=hello))
            await call.read()
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        call.cancel()
        return grpc.StatusCode.OK


@pytest.mark.parametrize("token", [None, TOKEN], ids=["no token", "worker token"])
def test_a_foreign_client_cannot_take_over_or_disturb_the_live_session(token: str | None) -> None:
    env_flags = ["--worker-token", token] if token else []
    worker = spawn_worker([*SIM, *env_flags])
    scheduler = spawn_scheduler(worker.address, env_flags)
    with running(scheduler, worker):
        wait_serving(scheduler.address)

        def says_hello(t: str | None) -> bool:
            """Whether the worker reads this probe's Hello (it refuses a wrong token first)."""
            return not token or t == token

        async def scenario() -> tuple[list[list[int]], list[tuple[str | None, grpc.StatusCode]], int, int]:
            meta = (("authorization", f"Bearer {token}"),) if token else None
            async with grpc.aio.insecure_channel(worker.address) as wchannel:
                stats = worker_pb2_grpc.WorkerStub(wchannel).GetStats
                request_stats = worker_pb2.GetStatsRequest()
                epoch = (await stats(request_stats, metadata=meta, timeout=CALL_TIMEOUT_S)).epoch
                async with grpc.aio.insecure_channel(scheduler.address) as channel:
                    stub = generation_pb2_grpc.GenerationStub(channel)
                    anchor = await started_call(stub, request(8, LONG))  # the session drives it throughout
                    clients = [asyncio.create_task(tokens(stub, i, 300)) for i in range(8)]
                    probes = [
                        (t, await foreign_hello(worker.address, t))
                        for _ in range(5)
                        for t in (None, "wrong", token)
                    ]
                    deadline = time.monotonic() + SETTLE_TIMEOUT_S
                    while grpc.StatusCode.FAILED_PRECONDITION not in (c for t, c in probes if says_hello(t)):
                        assert time.monotonic() < deadline, probes  # see foreign_hello: INTERNAL, by chance
                        probes.append((token, await foreign_hello(worker.address, token)))
                    await aborted(stub, 8, anchor)
                    outputs = await asyncio.gather(*clients)
                after = (await stats(request_stats, metadata=meta, timeout=CALL_TIMEOUT_S)).epoch
            return outputs, probes, epoch, after

        outputs, probes, epoch, after = asyncio.run(scenario())
        assert outputs == [expected(i, 300) for i in range(8)]
        assert epoch == after  # the scheduler's session was never replaced
        busy = {grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INTERNAL}  # see foreign_hello
        with_hello = [code for t, code in probes if says_hello(t)]
        without = [code for t, code in probes if not says_hello(t)]
        assert set(with_hello) <= busy
        assert set(without) <= {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INTERNAL}
        samples = scrape(worker.metrics_url)
        refused = {
            r: total(samples, "stepahead_worker_sessions_refused_total", reason=r)
            for r in ("busy", "unauthenticated")
        }
        assert refused == {"busy": len(with_hello), "unauthenticated": len(without)}


def test_stats_need_the_worker_token() -> None:
    worker = spawn_worker([*SIM, "--worker-token", TOKEN], port=unused_port())
    with running(worker):
        wait_serving(worker.address)
        with grpc.insecure_channel(worker.address) as channel, pytest.raises(grpc.RpcError) as refused:
            worker_pb2_grpc.WorkerStub(channel).GetStats(worker_pb2.GetStatsRequest(), timeout=CALL_TIMEOUT_S)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def one_step(address: str, launch: worker_pb2.Launch) -> worker_pb2.WorkerMessage:
    """A session of its own (no scheduler holds the worker): Hello, then `launch`; what the
    worker answers it (Keepalives aside)."""
    hello = worker_pb2.Hello(protocol_version=PROTOCOL_VERSION, scheduler_id="probe")
    async with grpc.aio.insecure_channel(address) as channel:
        call = worker_pb2_grpc.WorkerStub(channel).Connect(timeout=CALL_TIMEOUT_S)

        async def answer() -> worker_pb2.WorkerMessage:
            while True:
                message = await call.read()
                assert isinstance(message, worker_pb2.WorkerMessage), message  # not the stream's end
                if not message.HasField("keepalive"):
                    return message

        await call.write(worker_pb2.SchedulerMessage(hello=hello))
        assert (await answer()).HasField("welcome")
        await call.write(worker_pb2.SchedulerMessage(launch=launch))
        step = await answer()
        call.cancel()
        return step


def test_a_launch_with_a_column_cut_short_fails_its_step_naming_the_column() -> None:
    """Launch's columns are packed arrays (stepahead/packed.py): one whose bytes are not whole
    elements is refused as the step's error, by name, and the worker serves the next session."""
    worker = spawn_worker(SIM)
    with running(worker):
        wait_serving(worker.address)
        good = launch_to_proto(
            Launch(1, new_requests=[NewRequest(0, temperature=0.0, top_p=1.0, top_k=0, seed=0)])
        )
        for column, cut in [
            ("row_req_slots", b"\x00\x00\x00"),
            ("row_sample", b"\x02"),
            ("kv_slots", b"\x01"),
        ]:
            bad = worker_pb2.Launch()
            bad.CopyFrom(good)
            setattr(bad, column, cut)
            answer = asyncio.run(one_step(worker.address, bad))
            assert answer.HasField("error") and answer.error.step_id == 1
            assert answer.error.message.startswith(f"launch: {column}: "), answer.error.message
        answer = asyncio.run(one_step(worker.address, good))
        assert answer.HasField("result") and answer.result.step_id == 1
