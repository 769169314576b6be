"""Faults under load: a dead worker, cancel storms, overload, an oversubscribed KV pool.

Each fault lands on a state the test has seen: requests are live (a long one seen streaming,
which runs until the test aborts it, and the load seen under way; checked again while the
worker is stopped, when nothing can move on), capacity is full (long requests, aborted by id
when the test is done with them), or preemption cannot be avoided (completions that must be
co-resident need more KV than the pool has)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import re
import signal
import time
import urllib.request
from collections.abc import Callable

import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.promtext import scrape, total
from stepahead.processes import (
    STOP_TIMEOUT_S,
    Link,
    Service,
    link_socket,
    serving_pair,
    spawn_scheduler,
    spawn_worker,
    wait_serving,
)
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
    wait_until,
)
from tests.poison import poison_seed
from worker_svc.backends import sim_continuation as sim_expected

LOST_RE = re.compile(r"worker lost .*?; (\d+) requests wait for a worker", re.S)  # its reason may span lines
SIM = ["--model", "sim", "--sim-step-ms", "3", "--sim-token-us", "0", "--check-invariants"]
# A restarted worker must come back before live requests give up on it (a hang guard: a worker
# starts in seconds).
RETRY = ["--worker-retry-timeout", "600"]
# Over gRPC with and without frontend processes, and over the worker's link socket.
FRONTENDS_AND_LINKS: list[tuple[int, Link]] = [
    *((n, "grpc") for n in FRONTEND_COUNTS),
    (FRONTEND_COUNTS[-1], "socket"),
]
IGNORE = {"ignore_eos": True}  # vLLM's extra field, as the `openai` client sends it
LONG = 8000  # tokens: 8000 steps of the sim take 8 s at 1 ms a step, 24 s at 3 ms, whatever the machine


def stop_all(*services: Service | None) -> None:
    for service in services:
        if service is not None and service.proc.poll() is None:
            service.stop()


def prompt(i: int) -> str:
    return f"fault {i} " * (1 + i % 7)


def expected(i: int, n: int) -> list[int]:
    return sim_expected(prompt(i).encode(), n)


def fault_request(i: int, tokens: int, **sampling: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=f"f{i}",
        text=prompt(i),
        sampling=pb.SamplingParams(max_new_tokens=tokens, ignore_eos=True, **sampling),  # type: ignore[arg-type]
    )


async def stream_tokens(stub: generation_pb2_grpc.GenerationAsyncStub, i: int, n: int) -> list[int]:
    return [t async for r in stub.Generate(fault_request(i, n), timeout=CALL_TIMEOUT_S) for t in r.token_ids]


async def started_streams(
    stub: generation_pb2_grpc.GenerationAsyncStub, lengths: list[int]
) -> list[asyncio.Task[list[int]]]:
    """Every call sent at once; returns once each has its first response."""
    return list(
        await asyncio.gather(*(started_call(stub, fault_request(i, n)) for i, n in enumerate(lengths)))
    )


def streamed(scheduler: Service) -> float:
    """Tokens the scheduler has streamed to clients (a scrape may leave out a frontend that does
    not answer in time: the count is then too low, never too high)."""
    return total(scrape(scheduler.metrics_url), "stepahead_generation_tokens_total")


async def load_in_flight(
    stub: generation_pb2_grpc.GenerationAsyncStub, scheduler: Service, worker: Service, lengths: list[int]
) -> tuple[asyncio.Task[list[int]], list[asyncio.Task[list[int]]]]:
    """A LONG request (the last index), running once it streams; then every call of `lengths`,
    sent while the worker is stopped (a client on a starved machine sends slowly while it reads
    streams: the first calls could end before the last are sent), and returned once a third of
    their tokens have been streamed (the scheduler's count: the client reads late), so that the
    load is well under way. The long one runs until it is aborted: the load is live whatever
    the shorter calls have done by the time the test acts on it."""
    anchor = await started_call(stub, fault_request(len(lengths), LONG))
    base = await asyncio.to_thread(streamed, scheduler)
    with paused(worker.proc):
        clients = [asyncio.create_task(stream_tokens(stub, i, n)) for i, n in enumerate(lengths)]
        live = len(lengths) + 1
        await wait_info(scheduler.address, lambda i: i.requests_running + i.requests_waiting == live, "sent")
    target = base + sum(lengths) // 3
    try:
        await asyncio.to_thread(wait_until, lambda: streamed(scheduler) >= target, "the load under way")
    except AssertionError as exc:
        info = await server_info(scheduler.address)
        raise AssertionError(f"{exc}: {streamed(scheduler):g} of {target} tokens streamed; {info}") from None
    return anchor, clients


async def aborted_tokens(
    stub: generation_pb2_grpc.GenerationAsyncStub, i: int, call: asyncio.Task[list[int]]
) -> list[int]:
    """Call i's tokens once it is aborted: a beginning of its sim continuation."""
    assert (await stub.Abort(pb.AbortRequest(request_id=f"f{i}"), timeout=CALL_TIMEOUT_S)).aborted
    tokens = await call
    assert 0 < len(tokens) < LONG and tokens == expected(i, len(tokens)), i
    return tokens


def lost_waiting(scheduler: Service) -> list[int]:
    """For each worker loss the scheduler logged: how many requests waited for a worker."""
    return [int(m.group(1)) for m in LOST_RE.finditer("".join(list(scheduler.output)))]


def wait_logged(service: Service, logged: Callable[[str], bool], what: str) -> None:
    """Until the service's output says `what` (its output follows the failure)."""
    try:
        wait_until(lambda: logged("".join(list(service.output))), what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}:\n{''.join(service.output)}") from None


def assert_loss_seen_with_requests(scheduler: Service) -> None:
    wait_logged(scheduler, lambda output: bool(LOST_RE.search(output)), "the worker's loss logged")
    assert lost_waiting(scheduler)[0] > 0, "".join(scheduler.output)


@pytest.mark.parametrize(("frontends", "link"), FRONTENDS_AND_LINKS)
def test_kill_9_the_worker_mid_load_and_every_request_completes_identically(
    frontends: int, link: Link
) -> None:
    rng = random.Random(5)
    port = unused_port()
    links = contextlib.ExitStack()
    link_flags, target = links.enter_context(link_socket()) if link == "socket" else ([], f"127.0.0.1:{port}")
    # Room for all 100 at once: each runs from its first token on. The restarted worker's link
    # socket takes the place of the killed one's, left behind.
    sim = [*SIM, "--kv-slots", "65536", *link_flags]
    worker: Service | None = spawn_worker(sim, port=port)
    scheduler = spawn_scheduler(target, ["--max-batch-tokens", "256", *RETRY, *frontend_flags(frontends)])
    try:
        wait_serving(scheduler.address)
        asyncio.run(wait_frontends_serving(scheduler.address, frontends))
        lengths = [rng.randint(150, 400) for _ in range(100)]

        async def load_with_a_crash() -> list[list[int]]:
            nonlocal worker
            async with grpc.aio.insecure_channel(scheduler.address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                assert worker is not None
                anchor, clients = await load_in_flight(stub, scheduler, worker, lengths)
                with paused(worker.proc):  # nothing can finish between the look and the kill
                    assert (await server_info(scheduler.address)).requests_running > 0
                    worker.proc.kill()  # SIGKILL: no goodbye on the stream
                    worker.proc.wait(STOP_TIMEOUT_S)
                worker = await asyncio.to_thread(spawn_worker, sim, port)
                outputs = await asyncio.gather(*clients)
                await aborted_tokens(stub, len(lengths), anchor)
                return outputs

        outputs = asyncio.run(load_with_a_crash())
        for i, (tokens, n) in enumerate(zip(outputs, lengths, strict=True)):
            assert tokens == expected(i, n), i
        assert_loss_seen_with_requests(scheduler)
        assert scheduler.stop() == 0
    finally:
        stop_all(scheduler, worker)
        links.close()


@pytest.mark.parametrize("frontends", FRONTEND_COUNTS)
def test_requests_end_with_unavailable_when_no_worker_comes_back_in_time(frontends: int) -> None:
    port = unused_port()
    worker = spawn_worker(SIM, port=port)
    scheduler = spawn_scheduler(
        f"127.0.0.1:{port}", ["--worker-retry-timeout", "1", *frontend_flags(frontends)]
    )
    try:
        wait_serving(scheduler.address)
        asyncio.run(wait_frontends_serving(scheduler.address, frontends))

        async def orphaned() -> tuple[grpc.StatusCode, float]:
            async with grpc.aio.insecure_channel(scheduler.address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                client = await started_call(stub, fault_request(0, LONG))
                started = time.monotonic()  # before the worker can be found lost
                with paused(worker.proc):
                    assert (await server_info(scheduler.address)).requests_running == 1
                    worker.proc.kill()
                    worker.proc.wait(STOP_TIMEOUT_S)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await client
                return err.value.code(), time.monotonic() - started

        code, waited = asyncio.run(orphaned())
        assert code == grpc.StatusCode.UNAVAILABLE
        assert waited >= 1.0  # it waited for a worker before giving up
        assert scheduler.stop() == 0
    finally:
        stop_all(scheduler, worker)


# Ends every storm forces, whatever the machine's speed: a long request cancelled or aborted
# once it streams, and one whose deadline passes long before the sim could finish it.
FORCED_ENDS = {0: "cancel", 1: "deadline", 2: "abort"}


async def storm(address: str, n: int, seed: int) -> dict[str, int]:
    """n requests, 100 in flight; 30% end early: cancelled, past a deadline, or aborted (the
    first three of them in each way, see FORCED_ENDS)."""
    rng = random.Random(seed)
    outcomes = {"completed": 0, "cancelled": 0, "deadline": 0, "aborted": 0}
    forced: dict[int, str] = {}
    limit = asyncio.Semaphore(100)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def one(i: int) -> None:
            how = rng.choices(["complete", "cancel", "deadline", "abort"], [70, 12, 6, 12])[0]
            after = rng.randint(0, 6)
            tokens = rng.randint(4, 40)
            if i in FORCED_ENDS:
                how, after, tokens = FORCED_ENDS[i], 0, LONG
            request = pb.GenerateRequest(
                request_id=f"s{seed}-{i}",
                text="storm " * rng.randint(1, 30),
                sampling=pb.SamplingParams(max_new_tokens=tokens, ignore_eos=True),
            )
            async with limit:
                call = stub.Generate(request, timeout=0.05 if how == "deadline" else CALL_TIMEOUT_S)
                try:
                    got = 0
                    async for _ in call:
                        got += 1
                        if got > after and how == "cancel":
                            call.cancel()
                        elif got > after and how == "abort":
                            await stub.Abort(
                                pb.AbortRequest(request_id=request.request_id), timeout=CALL_TIMEOUT_S
                            )
                    outcome = "aborted" if how == "abort" else "completed"
                except asyncio.CancelledError:
                    outcome = "cancelled"
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED), exc
                    outcome = "cancelled" if how == "cancel" else "deadline"
                outcomes[outcome] += 1
                if i in FORCED_ENDS:
                    forced[i] = outcome

        await asyncio.gather(*(one(i) for i in range(n)))
    assert forced == {0: "cancelled", 1: "deadline", 2: "aborted"}, forced
    return outcomes


def resident_bytes(scheduler: Service) -> float:
    with urllib.request.urlopen(scheduler.metrics_url, timeout=CALL_TIMEOUT_S) as response:
        text = response.read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "process_resident_memory_bytes"
    )


STORM = 1000  # requests in a storm
RSS_BOUND_MIB = 4.0  # what a later storm may add to the scheduler's RSS: under 4 KiB a request


@pytest.mark.parametrize("frontends", FRONTEND_COUNTS)
def test_cancel_storms_free_every_slot_and_keep_memory_flat(frontends: int) -> None:
    """A first storm warms the process up (allocator arenas, gRPC buffers, caches); then two
    more each must leave RSS within RSS_BOUND_MIB of where it was. A leak grows it over every
    storm; a one-off high-water mark (the load's interleaving differs from run to run) over one
    at most, so the smaller growth of the two is the one held to the bound."""
    with serving_pair([*SIM, "--sim-step-ms", "1", "--kv-slots", "8192"], frontend_flags(frontends)) as (
        _,
        scheduler,
    ):
        first = asyncio.run(storm(scheduler.address, STORM, seed=1))
        assert first["cancelled"] > 0 and first["deadline"] + first["aborted"] > 0
        asyncio.run(wait_all_free(scheduler.address))
        rss = [resident_bytes(scheduler)]
        for seed in (2, 3):
            asyncio.run(storm(scheduler.address, STORM, seed=seed))
            info = asyncio.run(wait_all_free(scheduler.address))
            assert info.requests_running == 0 and info.requests_waiting == 0
            rss.append(resident_bytes(scheduler))
        growth = [(b - a) / 2**20 for a, b in itertools.pairwise(rss)]
        assert min(growth) < RSS_BOUND_MIB, f"scheduler RSS grew {growth} MiB over each later storm"


def preemptions(scheduler: Service) -> float:
    with urllib.request.urlopen(scheduler.metrics_url, timeout=CALL_TIMEOUT_S) as response:
        text = response.read().decode()
    found = [
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "stepahead_preemptions_total"
    ]
    assert found, text
    return sum(found)


KV_SLOTS = 850
COMPLETIONS, COMPLETION_TOKENS = 16, 110  # one prompt's 16 completions of 110 tokens: 1,760 KV slots


@pytest.mark.parametrize("frontends", FRONTEND_COUNTS)
def test_a_kv_pool_oversubscribed_twice_completes_everything_identically(frontends: int) -> None:
    """Completions 1..n-1 of a call are admitted together once completion 0's prompt is cached,
    so the n completions are co-resident, decoding in step; each fits the pool alone (its
    prompt + 110 tokens), together they need twice the pool: preemption cannot be avoided.
    Then separate requests of 8-56 prompt tokens (~1,700 KV slots if all at once) as well."""
    lengths = [30 + 5 * (i % 7) for i in range(24)]
    with serving_pair([*SIM, "--kv-slots", str(KV_SLOTS)], frontend_flags(frontends)) as (_, scheduler):
        asyncio.run(wait_frontends_serving(scheduler.address, frontends))

        async def completions() -> dict[int, list[int]]:
            async with grpc.aio.insecure_channel(scheduler.address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                call = fault_request(0, COMPLETION_TOKENS, n=COMPLETIONS)
                by_index: dict[int, list[int]] = {}
                async for r in stub.Generate(call, timeout=CALL_TIMEOUT_S):
                    by_index.setdefault(r.index, []).extend(r.token_ids)
                return by_index

        async def load() -> list[list[int]]:
            async with grpc.aio.insecure_channel(scheduler.address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                return await asyncio.gather(*(stream_tokens(stub, i, n) for i, n in enumerate(lengths)))

        assert COMPLETIONS * COMPLETION_TOKENS > 2 * KV_SLOTS > 2 * (len(prompt(0)) + COMPLETION_TOKENS)
        by_index = asyncio.run(completions())
        preempted = preemptions(scheduler)
        outputs = asyncio.run(load())
        asyncio.run(wait_all_free(scheduler.address))
    assert by_index == dict.fromkeys(range(COMPLETIONS), expected(0, COMPLETION_TOKENS))
    assert preempted > 0
    for i, (tokens, n) in enumerate(zip(outputs, lengths, strict=True)):
        assert tokens == expected(i, n), i


@pytest.mark.parametrize(("frontends", "link"), FRONTENDS_AND_LINKS)
def test_sigterm_on_the_worker_drains_it_and_a_new_worker_finishes_the_load(
    frontends: int, link: Link
) -> None:
    port = unused_port()
    links = contextlib.ExitStack()
    link_flags, target = links.enter_context(link_socket()) if link == "socket" else ([], f"127.0.0.1:{port}")
    sim = [*SIM, "--kv-slots", "65536", *link_flags]  # room for all at once: each runs from its admission on
    worker: Service | None = spawn_worker(sim, port=port)
    scheduler = spawn_scheduler(target, [*RETRY, *frontend_flags(frontends)])
    lengths = [60 + 10 * (i % 10) for i in range(40)]
    try:
        wait_serving(scheduler.address)
        asyncio.run(wait_frontends_serving(scheduler.address, frontends))
        drained: list[Service] = []

        async def load_across_a_restart() -> list[list[int]]:
            nonlocal worker
            async with grpc.aio.insecure_channel(scheduler.address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                assert worker is not None
                anchor, clients = await load_in_flight(stub, scheduler, worker, lengths)
                with paused(worker.proc):  # SIGTERM arrives as it resumes, with requests running
                    assert (await server_info(scheduler.address)).requests_running > 0
                    worker.proc.send_signal(signal.SIGTERM)
                assert await asyncio.to_thread(worker.proc.wait, STOP_TIMEOUT_S) == 0
                drained.append(worker)
                worker = await asyncio.to_thread(spawn_worker, sim, port)
                outputs = await asyncio.gather(*clients)
                await aborted_tokens(stub, len(lengths), anchor)
                return outputs

        outputs = asyncio.run(load_across_a_restart())
        for i, (tokens, n) in enumerate(zip(outputs, lengths, strict=True)):
            assert tokens == expected(i, n), i
        old = drained[0].output
        wait_logged(drained[0], lambda output: bool(re.search(r"session \d+ closed", output)), "drained")
        assert any("draining launched batches" in line for line in old)
        assert_loss_seen_with_requests(scheduler)
    finally:
        stop_all(scheduler, worker)
        links.close()


MAX_RUNNING = MAX_WAITING = 8


@pytest.mark.parametrize("frontends", FRONTEND_COUNTS)
def test_overload_at_ten_times_capacity_refuses_the_excess_and_serves_the_admitted(frontends: int) -> None:
    """Capacity: 8 running + 8 waiting, filled first: 8 long requests run (they cannot end
    before the test aborts them), 8 more wait. Then 144 arrive at once: every one is refused.
    Once the long ones are aborted, the 8 waiting ones are served in full."""
    flags = ["--max-running", str(MAX_RUNNING), "--max-waiting", str(MAX_WAITING)]
    with serving_pair(
        [*SIM, "--request-slots", "8", "--kv-slots", "80000"], [*flags, *frontend_flags(frontends)]
    ) as (_, scheduler):
        asyncio.run(wait_frontends_serving(scheduler.address, frontends))

        async def overload() -> tuple[list[list[int]], list[list[int]], list[list[int] | grpc.StatusCode]]:
            async with grpc.aio.insecure_channel(scheduler.address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                running = await started_streams(stub, [LONG] * MAX_RUNNING)
                await wait_info(scheduler.address, lambda i: i.requests_running == MAX_RUNNING, "full")
                waiting = [
                    asyncio.create_task(stream_tokens(stub, MAX_RUNNING + i, 50)) for i in range(MAX_WAITING)
                ]
                await wait_info(scheduler.address, lambda i: i.requests_waiting == MAX_WAITING, "queue full")

                async def one(i: int) -> list[int] | grpc.StatusCode:
                    try:
                        return await stream_tokens(stub, i, 50)
                    except grpc.aio.AioRpcError as exc:
                        return exc.code()

                excess = range(MAX_RUNNING + MAX_WAITING, 160)
                refused = await asyncio.gather(*(one(i) for i in excess))
                info = await server_info(scheduler.address)
                assert (info.requests_running, info.requests_waiting) == (MAX_RUNNING, MAX_WAITING), info
                assert not any(task.done() for task in running + waiting)  # all of it held meanwhile
                long = [await aborted_tokens(stub, i, call) for i, call in enumerate(running)]
                return long, await asyncio.gather(*waiting), refused

        long, served, refused = asyncio.run(overload())
        asyncio.run(wait_all_free(scheduler.address))
    assert refused == [grpc.StatusCode.RESOURCE_EXHAUSTED] * (160 - MAX_RUNNING - MAX_WAITING)
    assert len(long) == MAX_RUNNING  # each aborted while running, with a beginning of its tokens
    for i, tokens in enumerate(served, start=MAX_RUNNING):
        assert tokens == expected(i, 50), i


@pytest.mark.parametrize("frontends", FRONTEND_COUNTS)
def test_a_poison_request_ends_alone_with_internal_and_every_other_request_completes(frontends: int) -> None:
    """A worker whose steps fail whenever one request's rows reach a position (`tests/poison.py`),
    under a load of 24: that request ends with INTERNAL (gRPC) or 500 (HTTP, through the `openai`
    client) naming the worker's fault, each other completes with the sim's tokens, nothing is held
    after, and the server serves on. Before the quarantine every request waited out
    `--worker-retry-timeout` and then all ended with UNAVAILABLE."""
    port = unused_port()
    worker = spawn_worker(SIM, port=port, module="tests.poison")
    http = unused_port()
    scheduler = spawn_scheduler(
        f"127.0.0.1:{port}", [*RETRY, "--http-port", str(http), *frontend_flags(frontends)]
    )
    try:
        wait_serving(scheduler.address)
        asyncio.run(wait_frontends_serving(scheduler.address, frontends))
        poisoned = 7

        async def load() -> tuple[list[list[int] | grpc.StatusCode], tuple[int, str]]:
            async with grpc.aio.insecure_channel(scheduler.address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)

                async def one(i: int) -> list[int] | grpc.StatusCode:
                    seed = poison_seed(len(prompt(i).encode()) + 20) if i == poisoned else i
                    try:
                        responses = stub.Generate(fault_request(i, 64, seed=seed), timeout=CALL_TIMEOUT_S)
                        return [t async for r in responses for t in r.token_ids]
                    except grpc.aio.AioRpcError as exc:
                        assert "the worker failed every step of this request alone" in (exc.details() or "")
                        return exc.code()

                async def over_http() -> tuple[int, str]:
                    async with openai.AsyncOpenAI(
                        base_url=f"http://127.0.0.1:{http}/v1",
                        api_key="-",
                        max_retries=0,
                        timeout=CALL_TIMEOUT_S,
                    ) as client:
                        try:
                            await client.completions.create(
                                model="sim",
                                prompt="poison",
                                max_tokens=16,
                                seed=poison_seed(10),
                                extra_body=IGNORE,
                            )
                        except openai.APIStatusError as exc:
                            return exc.status_code, str(exc)
                    raise AssertionError("the poisoned HTTP request completed")

                refused = asyncio.create_task(over_http())
                outputs = await asyncio.gather(*(one(i) for i in range(24)))
                return outputs, await refused

        outputs, (status, message) = asyncio.run(load())
        assert outputs[poisoned] == grpc.StatusCode.INTERNAL
        assert all(outputs[i] == expected(i, 64) for i in range(24) if i != poisoned)
        assert status == 500 and "poisoned row" in message, message
        asyncio.run(wait_all_free(scheduler.address))
        metrics = scrape(scheduler.metrics_url)
        assert total(metrics, "stepahead_poison_requests_total") == 2
        assert total(metrics, "stepahead_step_failures_total") >= 4  # each poison failed alone twice
        assert asyncio.run(stream_tokens_once(scheduler.address)) == expected(99, 8)  # serving on
        assert scheduler.stop() == 0
    finally:
        stop_all(scheduler, worker)


async def stream_tokens_once(address: str) -> list[int]:
    async with grpc.aio.insecure_channel(address) as channel:
        return await stream_tokens(generation_pb2_grpc.GenerationStub(channel), 99, 8)
