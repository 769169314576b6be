"""Faults under load: a dead worker, cancel storms, overload, an oversubscribed KV pool."""

from __future__ import annotations

import asyncio
import random
import re
import signal
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from stepahead.processes import Service, serving_pair, spawn_scheduler, spawn_worker, wait_serving
from stepahead.v1 import generation_pb2 as pb
from stepahead.v1 import generation_pb2_grpc
from tests.live import FRONTEND_COUNTS, frontend_flags, unused_port, wait_all_free
from worker_svc.backends import sim_continuation as sim_expected

LOST_RE = re.compile(r"worker lost .*; (\d+) requests wait for a worker")
SIM = ["--model", "sim", "--sim-step-ms", "3", "--sim-token-us", "0", "--check-invariants"]


def stop_all(*services: Service | None) -> None:
    for service in services:
        if service is not None and service.proc.poll() is None:
            service.stop()


async def stream_tokens(stub: generation_pb2_grpc.GenerationAsyncStub, i: int, n: int) -> list[int]:
    request = pb.GenerateRequest(
        request_id=f"f{i}",
        text=f"fault {i} " * (1 + i % 7),
        sampling=pb.SamplingParams(max_new_tokens=n, ignore_eos=True),
    )
    return [t async for r in stub.Generate(request, timeout=120) for t in r.token_ids]


@pytest.mark.parametrize("frontends", FRONTEND_COUNTS)
def test_kill_9_the_worker_mid_load_and_every_request_completes_identically(frontends: int) -> None:
    rng = random.Random(5)
    port = unused_port()
    worker: Service | None = spawn_worker(SIM, port=port)
    scheduler = spawn_scheduler(
        f"127.0.0.1:{port}", ["--max-batch-tokens", "256", *frontend_flags(frontends)]
    )
    try:
        wait_serving(scheduler.address)
        lengths = [rng.randint(150, 400) for _ in range(100)]

        async def load_with_a_crash() -> list[list[int]]:
            nonlocal worker
            async with grpc.aio.insecure_channel(scheduler.address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                clients = [asyncio.create_task(stream_tokens(stub, i, n)) for i, n in enumerate(lengths)]
                await asyncio.sleep(rng.uniform(0.2, 0.5))  # well before the longest finishes
                assert worker is not None
                worker.proc.kill()  # SIGKILL: no goodbye on the stream
                worker.proc.wait(10)
                worker = spawn_worker(SIM, port=port)
                return await asyncio.gather(*clients)

        outputs = asyncio.run(load_with_a_crash())
        for i, (tokens, n) in enumerate(zip(outputs, lengths, strict=True)):
            assert tokens == sim_expected(f"fault {i} ".encode() * (1 + i % 7), n), i
        waiting = [int(m.group(1)) for line in scheduler.output if (m := LOST_RE.search(line))]
        assert waiting and waiting[0] > 0, "".join(scheduler.output)
        assert scheduler.stop() == 0
    finally:
        stop_all(scheduler, worker)


@pytest.mark.parametrize("frontends", FRONTEND_COUNTS)
def test_requests_end_with_unavailable_when_no_worker_comes_back_in_time(frontends: int) -> None:
    port = unused_port()
    worker = spawn_worker(SIM, port=port)
    scheduler = spawn_scheduler(
        f"127.0.0.1:{port}", ["--worker-retry-timeout", "1", *frontend_flags(frontends)]
    )
    try:
        wait_serving(scheduler.address)

        async def orphaned() -> tuple[grpc.StatusCode, float]:
            async with grpc.aio.insecure_channel(scheduler.address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                client = asyncio.create_task(stream_tokens(stub, 0, 100_000 // 20))
                await asyncio.sleep(0.3)
                worker.proc.kill()
                started = time.monotonic()
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await client
                return err.value.code(), time.monotonic() - started

        code, waited = asyncio.run(orphaned())
        assert code == grpc.StatusCode.UNAVAILABLE
        assert waited >= 1.0  # it waited for a worker before giving up
        assert scheduler.stop() == 0
    finally:
        stop_all(scheduler, worker)


async def storm(address: str, n: int, seed: int) -> dict[str, int]:
    """n requests, 100 in flight; 30% end early: cancelled, past a deadline, or aborted."""
    rng = random.Random(seed)
    outcomes = {"completed": 0, "cancelled": 0, "deadline": 0, "aborted": 0}
    limit = asyncio.Semaphore(100)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def one(i: int) -> None:
            how = rng.choices(["complete", "cancel", "deadline", "abort"], [70, 12, 6, 12])[0]
            after = rng.randint(0, 6)
            request = pb.GenerateRequest(
                request_id=f"s{seed}-{i}",
                text="storm " * rng.randint(1, 30),
                sampling=pb.SamplingParams(max_new_tokens=rng.randint(4, 40), ignore_eos=True),
            )
            async with limit:
                call = stub.Generate(request, timeout=0.05 if how == "deadline" else 60)
                try:
                    got = 0
                    async for _ in call:
                        got += 1
                        if got > after and how == "cancel":
                            call.cancel()
                        elif got > after and how == "abort":
                            await stub.Abort(pb.AbortRequest(request_id=request.request_id))
                    outcomes["aborted" if how == "abort" else "completed"] += 1
                except asyncio.CancelledError:
                    outcomes["cancelled"] += 1
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED), exc
                    outcomes["cancelled" if how == "cancel" else "deadline"] += 1

        await asyncio.gather(*(one(i) for i in range(n)))
    return outcomes


def resident_bytes(scheduler: Service) -> float:
    with urllib.request.urlopen(scheduler.metrics_url, timeout=10) as response:
        text = response.read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "process_resident_memory_bytes"
    )


@pytest.mark.parametrize("frontends", FRONTEND_COUNTS)
def test_cancel_storms_free_every_slot_and_keep_memory_flat(frontends: int) -> None:
    with serving_pair([*SIM, "--sim-step-ms", "1", "--kv-slots", "8192"], frontend_flags(frontends)) as (
        _,
        scheduler,
    ):
        first = asyncio.run(storm(scheduler.address, 2000, seed=1))
        assert first["cancelled"] > 0 and first["deadline"] + first["aborted"] > 0
        asyncio.run(wait_all_free(scheduler.address))
        rss_after_first = resident_bytes(scheduler)
        asyncio.run(storm(scheduler.address, 2000, seed=2))
        info = asyncio.run(wait_all_free(scheduler.address))
        assert info.requests_running == 0 and info.requests_waiting == 0
        growth = resident_bytes(scheduler) - rss_after_first
        assert growth < 8 * 2**20, f"scheduler RSS grew {growth / 2**20:.1f} MiB over a second storm"


@pytest.mark.parametrize("frontends", FRONTEND_COUNTS)
def test_a_kv_pool_oversubscribed_twice_completes_everything_identically(frontends: int) -> None:
    lengths = [30 + 5 * (i % 7) for i in range(24)]  # prompts of 8-56 tokens: ~1,700 KV slots at once
    with serving_pair([*SIM, "--kv-slots", "850"], frontend_flags(frontends)) as (_, scheduler):

        async def load() -> list[list[int]]:
            async with grpc.aio.insecure_channel(scheduler.address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                return await asyncio.gather(*(stream_tokens(stub, i, n) for i, n in enumerate(lengths)))

        outputs = asyncio.run(load())
        metrics = urllib.request.urlopen(scheduler.metrics_url, timeout=10).read().decode()
        asyncio.run(wait_all_free(scheduler.address))
    for i, (tokens, n) in enumerate(zip(outputs, lengths, strict=True)):
        assert tokens == sim_expected(f"fault {i} ".encode() * (1 + i % 7), n), i
    preemptions = [
        s.value
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
        if s.name == "stepahead_preemptions_total"
    ]
    assert preemptions and preemptions[0] > 0


@pytest.mark.parametrize("frontends", FRONTEND_COUNTS)
def test_sigterm_on_the_worker_drains_it_and_a_new_worker_finishes_the_load(frontends: int) -> None:
    port = unused_port()
    worker: Service | None = spawn_worker(SIM, port=port)
    scheduler = spawn_scheduler(f"127.0.0.1:{port}", frontend_flags(frontends))
    lengths = [60 + 10 * (i % 10) for i in range(40)]
    try:
        wait_serving(scheduler.address)

        async def load_across_a_restart() -> list[list[int]]:
            nonlocal worker
            async with grpc.aio.insecure_channel(scheduler.address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                clients = [asyncio.create_task(stream_tokens(stub, i, n)) for i, n in enumerate(lengths)]
                await asyncio.sleep(0.4)
                assert worker is not None
                worker.proc.send_signal(signal.SIGTERM)
                assert await asyncio.to_thread(worker.proc.wait, 30) == 0
                drained.extend(worker.output)
                worker = spawn_worker(SIM, port=port)
                return await asyncio.gather(*clients)

        drained: list[str] = []
        outputs = asyncio.run(load_across_a_restart())
        for i, (tokens, n) in enumerate(zip(outputs, lengths, strict=True)):
            assert tokens == sim_expected(f"fault {i} ".encode() * (1 + i % 7), n), i
        assert any("draining launched batches" in line for line in drained)
        assert any(re.search(r"session \d+ closed", line) for line in drained)
    finally:
        stop_all(scheduler, worker)


@pytest.mark.parametrize("frontends", FRONTEND_COUNTS)
def test_overload_at_ten_times_capacity_refuses_the_excess_and_serves_the_admitted(frontends: int) -> None:
    # Capacity: 8 running + 8 waiting. 160 arrive at once.
    with serving_pair(
        [*SIM, "--request-slots", "8"],
        ["--max-running", "8", "--max-waiting", "8", *frontend_flags(frontends)],
    ) as (
        _,
        scheduler,
    ):

        async def flood() -> list[list[int] | grpc.StatusCode]:
            async with grpc.aio.insecure_channel(scheduler.address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)

                async def one(i: int) -> list[int] | grpc.StatusCode:
                    try:
                        return await stream_tokens(stub, i, 50)
                    except grpc.aio.AioRpcError as exc:
                        return exc.code()

                return await asyncio.gather(*(one(i) for i in range(160)))

        outcomes = asyncio.run(flood())
        asyncio.run(wait_all_free(scheduler.address))
    refused = [o for o in outcomes if isinstance(o, grpc.StatusCode)]
    served = [(i, o) for i, o in enumerate(outcomes) if isinstance(o, list)]
    assert set(refused) == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert len(served) >= 16 and len(refused) >= 100
    for i, tokens in served:
        assert tokens == sim_expected(f"fault {i} ".encode() * (1 + i % 7), 50), i
