"""The worker link under faults that do not close a socket: a stopped worker, a stopped scheduler,
and clients that are not the scheduler."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.promtext import scrape, total
from stepahead.processes import Service, spawn_scheduler, spawn_worker, wait_serving
from stepahead.protocol import PROTOCOL_VERSION
from stepahead.v1 import generation_pb2 as pb
from stepahead.v1 import generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.live import unused_port
from worker_svc.backends import sim_continuation as sim_expected

SIM = ["--model", "sim", "--sim-step-ms", "3", "--sim-token-us", "0"]
STEP_TIMEOUT_S = 1.5
MARGIN_S = 3.0  # detection comes within the timeout plus one heartbeat and a reconnect attempt
TOKEN = "link-secret"


@contextmanager
def running(*services: Service) -> Iterator[None]:
    try:
        yield
    finally:
        for service in services:
            if service.proc.poll() is None:
                os.kill(service.proc.pid, signal.SIGCONT)
                service.stop()


def serving_status(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return int(stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status)  # type: ignore[attr-defined]


def seconds_until_not_serving(address: str, limit_s: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < limit_s:
        if serving_status(address) == health_pb2.HealthCheckResponse.NOT_SERVING:
            return time.monotonic() - started
        time.sleep(0.05)
    raise AssertionError(f"{address} still SERVING after {limit_s}s")


def request(i: int, n: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=f"l{i}", text=f"link {i}", sampling=pb.SamplingParams(max_new_tokens=n, ignore_eos=True)
    )


async def tokens(stub: generation_pb2_grpc.GenerationAsyncStub, i: int, n: int) -> list[int]:
    return [t async for r in stub.Generate(request(i, n), timeout=120) for t in r.token_ids]


def test_a_stopped_worker_is_detected_and_the_load_completes_after_it_resumes() -> None:
    worker = spawn_worker(SIM)
    scheduler = spawn_scheduler(worker.address, ["--worker-step-timeout", str(STEP_TIMEOUT_S)])
    with running(scheduler, worker):
        wait_serving(scheduler.address)
        lengths = [200 + 10 * i for i in range(20)]

        async def load_with_a_stop() -> tuple[list[list[int]], float]:
            async with grpc.aio.insecure_channel(scheduler.address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                clients = [asyncio.create_task(tokens(stub, i, n)) for i, n in enumerate(lengths)]
                await asyncio.sleep(0.3)
                os.kill(worker.proc.pid, signal.SIGSTOP)
                detected = await asyncio.to_thread(
                    seconds_until_not_serving, scheduler.address, STEP_TIMEOUT_S + MARGIN_S
                )
                await asyncio.sleep(STEP_TIMEOUT_S)
                os.kill(worker.proc.pid, signal.SIGCONT)
                return await asyncio.gather(*clients), detected

        outputs, detected = asyncio.run(load_with_a_stop())
        assert outputs == [sim_expected(f"link {i}".encode(), n) for i, n in enumerate(lengths)]
        assert detected <= STEP_TIMEOUT_S + MARGIN_S
        assert total(scrape(scheduler.metrics_url), "stepahead_worker_step_timeouts_total") >= 1


def test_a_worker_stopped_for_good_ends_every_request_with_unavailable_in_bounded_time() -> None:
    worker = spawn_worker(SIM)
    flags = ["--worker-step-timeout", str(STEP_TIMEOUT_S), "--worker-retry-timeout", "1"]
    scheduler = spawn_scheduler(worker.address, flags)
    with running(scheduler, worker):
        wait_serving(scheduler.address)

        async def orphaned() -> tuple[list[list[int] | BaseException], float]:
            async with grpc.aio.insecure_channel(scheduler.address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                clients = [asyncio.create_task(tokens(stub, i, 5000)) for i in range(10)]
                await asyncio.sleep(0.3)
                os.kill(worker.proc.pid, signal.SIGSTOP)
                started = time.monotonic()
                outcomes = await asyncio.gather(*clients, return_exceptions=True)
                return outcomes, time.monotonic() - started

        outcomes, waited = asyncio.run(orphaned())
        codes = {o.code() for o in outcomes if isinstance(o, grpc.aio.AioRpcError)}
        assert codes == {grpc.StatusCode.UNAVAILABLE} and len(outcomes) == 10
        assert all(isinstance(o, grpc.aio.AioRpcError) for o in outcomes)
        assert waited <= STEP_TIMEOUT_S + 1 + MARGIN_S + 2


def test_a_stopped_scheduler_frees_the_worker_for_another_one() -> None:
    worker = spawn_worker([*SIM, "--scheduler-timeout", "1"])
    first = spawn_scheduler(worker.address, ["--frontends", "0"])
    with running(first, worker):
        wait_serving(first.address)
        os.kill(first.proc.pid, signal.SIGSTOP)
        second = spawn_scheduler(worker.address, ["--frontends", "0"])
        with running(second):
            wait_serving(second.address, timeout_s=20)  # refused (busy) until the worker drops the first

            async def one() -> list[int]:
                async with grpc.aio.insecure_channel(second.address) as channel:
                    return await tokens(generation_pb2_grpc.GenerationStub(channel), 0, 8)

            assert asyncio.run(one()) == sim_expected(b"link 0", 8)
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
        call = worker_pb2_grpc.WorkerStub(channel).Connect(metadata=metadata)
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

        async def scenario() -> tuple[list[list[int]], list[grpc.StatusCode], int, int]:
            meta = (("authorization", f"Bearer {token}"),) if token else None
            async with grpc.aio.insecure_channel(worker.address) as wchannel:
                stats = worker_pb2_grpc.WorkerStub(wchannel).GetStats
                epoch = (await stats(worker_pb2.GetStatsRequest(), metadata=meta)).epoch
                async with grpc.aio.insecure_channel(scheduler.address) as channel:
                    stub = generation_pb2_grpc.GenerationStub(channel)
                    clients = [asyncio.create_task(tokens(stub, i, 300)) for i in range(8)]
                    refusals = [
                        await foreign_hello(worker.address, t)
                        for _ in range(5)
                        for t in (None, "wrong", token)
                    ]
                    outputs = await asyncio.gather(*clients)
                after = (await stats(worker_pb2.GetStatsRequest(), metadata=meta)).epoch
            return outputs, refusals, epoch, after

        outputs, refusals, epoch, after = asyncio.run(scenario())
        assert outputs == [sim_expected(f"link {i}".encode(), 300) for i in range(8)]
        assert epoch == after  # the scheduler's session was never replaced
        busy = {grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INTERNAL}  # see foreign_hello
        with_hello = [code for i, code in enumerate(refusals) if not token or i % 3 == 2]
        without = [code for i, code in enumerate(refusals) if token and i % 3 != 2]
        assert set(with_hello) <= busy and grpc.StatusCode.FAILED_PRECONDITION in with_hello
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
            worker_pb2_grpc.WorkerStub(channel).GetStats(worker_pb2.GetStatsRequest(), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
