"""Two real processes over gRPC on 127.0.0.1: streaming, abort, health, stop.

What a test acts on is a state it has seen: a request streaming (its first response read, and
the worker stopped while the test looks, where nothing may move on), the scheduler refusing
new calls (retried until it does)."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from stepahead.processes import (
    STOP_TIMEOUT_S,
    Service,
    serving_pair,
    spawn_scheduler,
    spawn_scheduler_in_process,
    spawn_worker,
    wait_serving,
)
from stepahead.v1 import generation_pb2 as pb
from stepahead.v1 import generation_pb2_grpc
from tests.live import (
    CALL_TIMEOUT_S,
    FRONTEND_COUNTS,
    SETTLE_TIMEOUT_S,
    frontend_flags,
    generate,
    paused,
    request,
    server_info,
    unused_port,
    wait_all_free,
    wait_frontends_serving,
    wait_until,
    worker_stats_after_drain,
)
from worker_svc.backends import sim_continuation as sim_expected

pytestmark = pytest.mark.anyio
SIM = ["--model", "sim", "--sim-step-ms", "2", "--check-invariants", "--kv-slots", "4096"]
LOST_RE = re.compile(r"worker lost .*?; (\d+) requests wait for a worker", re.S)  # its reason may span lines


@pytest.fixture(scope="module", params=FRONTEND_COUNTS, ids=lambda n: f"frontends={n}")
def sim_pair(request: pytest.FixtureRequest) -> Iterator[tuple[Service, Service]]:
    with serving_pair(SIM, ["--max-batch-tokens", "256", *frontend_flags(request.param)]) as pair:
        asyncio.run(wait_frontends_serving(pair[1].address, request.param))
        yield pair


async def test_health_reflection_and_info(sim_pair: tuple[Service, Service]) -> None:
    worker, scheduler = sim_pair
    for service, name in ((worker, "stepahead.v1.Worker"), (scheduler, "stepahead.v1.Generation")):
        async with grpc.aio.insecure_channel(service.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for svc in ("", name):
                got = await health.Check(  # type: ignore[attr-defined]
                    health_pb2.HealthCheckRequest(service=svc), timeout=CALL_TIMEOUT_S
                )
                assert got.status == health_pb2.HealthCheckResponse.SERVING
            reflect = reflection_pb2_grpc.ServerReflectionStub(channel)  # type: ignore[arg-type]
            replies = [
                r
                async for r in reflect.ServerReflectionInfo(  # type: ignore[operator]
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=CALL_TIMEOUT_S
                )
            ]
            names = {s.name for s in replies[0].list_services_response.service}
            assert {name, "grpc.health.v1.Health"} <= names
    info = await server_info(scheduler.address)
    assert (info.model, info.mode, info.vocab_size, info.tokenizer) == ("sim", "overlap", 258, "byte")
    assert info.kv_slots == 4096 and info.request_slots == 256 and info.worker_connected


async def test_concurrent_streams_get_the_sim_tokens(sim_pair: tuple[Service, Service]) -> None:
    _, scheduler = sim_pair
    prompts = [f"client {i} says hello" * (1 + i % 20) for i in range(24)]
    reqs = [request(p, 10 + i, ignore_eos=True) for i, p in enumerate(prompts)]
    replies = await asyncio.gather(*(generate(scheduler.address, r) for r in reqs))
    for prompt, req, stream in zip(prompts, reqs, replies, strict=True):
        ids = [t for r in stream for t in r.token_ids]
        assert ids == sim_expected(prompt.encode(), req.sampling.max_new_tokens)
        assert "".join(r.text for r in stream) == bytes(t for t in ids if t < 256).decode()
        assert [r.finish_reason for r in stream[:-1]] == [pb.FINISH_REASON_UNSPECIFIED] * (len(stream) - 1)
        assert stream[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert stream[-1].completion_tokens == len(ids) and stream[-1].prompt_tokens == len(prompt)
        assert len({r.request_id for r in stream}) == 1
    await wait_all_free(scheduler.address)


async def test_abort_rpc_and_client_cancel_free_everything(sim_pair: tuple[Service, Service]) -> None:
    """Each long request, seen streaming, is ended while the worker is stopped: it cannot end by
    itself meanwhile."""
    worker, scheduler = sim_pair
    async with grpc.aio.insecure_channel(scheduler.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        call = stub.Generate(
            request("abort me", 4000, rid="to-abort", ignore_eos=True), timeout=CALL_TIMEOUT_S
        )
        first = await call.read()
        assert isinstance(first, pb.GenerateResponse)
        assert first.request_id == "to-abort"
        with paused(worker.proc):
            assert (await stub.Abort(pb.AbortRequest(request_id="to-abort"), timeout=CALL_TIMEOUT_S)).aborted
        rest = []
        while isinstance(r := await call.read(), pb.GenerateResponse):
            rest.append(r)
        assert rest[-1].finish_reason == pb.FINISH_REASON_ABORT
        assert not (await stub.Abort(pb.AbortRequest(request_id="to-abort"), timeout=CALL_TIMEOUT_S)).aborted

        cancel_me = request("cancel me", 4000, rid="to-cancel", ignore_eos=True)
        cancelled = stub.Generate(cancel_me, timeout=CALL_TIMEOUT_S)
        await cancelled.read()
        with paused(worker.proc):
            info = await server_info(scheduler.address)
            assert info.requests_running + info.requests_waiting == 1  # live when cancelled
            cancelled.cancel()
    await wait_all_free(scheduler.address)


BAD_REQUESTS = [
    (pb.GenerateRequest(sampling=pb.SamplingParams(max_new_tokens=4)), "input"),
    (request("", 4), "input.text"),
    (
        pb.GenerateRequest(input_ids=pb.TokenIds(), sampling=pb.SamplingParams(max_new_tokens=4)),
        "input.input_ids.ids",
    ),
    (
        pb.GenerateRequest(input_ids=pb.TokenIds(ids=[1, 999]), sampling=pb.SamplingParams(max_new_tokens=4)),
        "input.input_ids.ids[1]",
    ),
    (request("hi", 0), "sampling.max_new_tokens"),
    (request("hi", 8190), "sampling.max_new_tokens"),
    (request("hi", 4, temperature=-0.5), "sampling.temperature"),
    (request("hi", 4, temperature=float("nan")), "sampling.temperature"),
    (request("hi", 4, top_p=0.0), "sampling.top_p"),
    (request("hi", 4, top_p=1.5), "sampling.top_p"),
    (request("hi", 4, stop_token_ids=[300]), "sampling.stop_token_ids[0]"),
    (request("hi", 4, stop=["ok", ""]), "sampling.stop[1]"),
    (request("hi", 4, rid="x" * 300), "request_id"),
    (request("hi", 4, presence_penalty=2.5), "sampling.presence_penalty"),
    (request("hi", 4, presence_penalty=float("nan")), "sampling.presence_penalty"),
    (request("hi", 4, frequency_penalty=-2.01), "sampling.frequency_penalty"),
    (request("hi", 4, frequency_penalty=float("inf")), "sampling.frequency_penalty"),
    (request("hi", 4, repetition_penalty=0.0), "sampling.repetition_penalty"),
    (request("hi", 4, repetition_penalty=float("nan")), "sampling.repetition_penalty"),
    (request("hi", 4, logprobs=True, top_logprobs=21), "sampling.top_logprobs"),
    (request("hi", 4, top_logprobs=2), "sampling.top_logprobs"),
    (request("hi", 4, n=0), "sampling.n"),
    (request("hi", 4, n=17), "sampling.n"),
    (request("hi", 4, min_tokens=5), "sampling.min_tokens"),
    (request("hi", 4, logit_bias={300: 1.0}), "sampling.logit_bias[300]"),
    (request("hi", 4, logit_bias={65: 100.5}), "sampling.logit_bias[65]"),
    (request("hi", 4, logit_bias={65: float("nan")}), "sampling.logit_bias[65]"),
    (request("hi", 4, logit_bias=dict.fromkeys(range(301), 1.0)), "sampling.logit_bias"),
]


@pytest.mark.parametrize(("bad", "field"), BAD_REQUESTS, ids=[f for _, f in BAD_REQUESTS])
async def test_bad_input_gets_invalid_argument_naming_the_field(
    sim_pair: tuple[Service, Service], bad: pb.GenerateRequest, field: str
) -> None:
    _, scheduler = sim_pair
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(scheduler.address, bad)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert str(err.value.details()).startswith(field + ":")
    good = await generate(scheduler.address, request("after a bad one", 5, ignore_eos=True))
    assert [t for r in good for t in r.token_ids] == sim_expected(b"after a bad one", 5)


async def test_duplicate_live_request_id_is_already_exists(sim_pair: tuple[Service, Service]) -> None:
    worker, scheduler = sim_pair
    async with grpc.aio.insecure_channel(scheduler.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        live = stub.Generate(request("first", 4000, rid="dup", ignore_eos=True), timeout=CALL_TIMEOUT_S)
        await live.read()
        with paused(worker.proc), pytest.raises(grpc.aio.AioRpcError) as err:  # "dup" still live
            [r async for r in stub.Generate(request("second", 4, rid="dup"), timeout=CALL_TIMEOUT_S)]
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "request_id" in str(err.value.details())
        live.cancel()
    await wait_all_free(scheduler.address)


async def test_worker_kept_its_invariants(sim_pair: tuple[Service, Service]) -> None:
    worker, scheduler = sim_pair
    await generate(scheduler.address, request("one more", 3))
    await wait_all_free(scheduler.address)
    stats = await worker_stats_after_drain(worker.address)  # every launched step has run
    assert stats.steps_executed > 0 and stats.steps_executed == stats.last_step_id
    assert stats.sentinel_reads == 0 and stats.out_of_order_launches == 0
    assert stats.live_request_slots == 0


IN_FLIGHT = 3000  # tokens: 6 s of the sim at 2 ms a step at least, whatever the machine


@pytest.mark.parametrize("frontends", FRONTEND_COUNTS)
def test_sigterm_finishes_in_flight_requests_and_refuses_new_ones(frontends: int) -> None:
    """A request seen streaming when SIGTERM lands; new calls are tried until the scheduler
    refuses them, and the first one still runs then (it cannot have ended: see IN_FLIGHT) and
    ends in full. --grace is a hang guard here."""
    with serving_pair(SIM, ["--grace", "600", *frontend_flags(frontends)]) as (worker, scheduler):
        asyncio.run(wait_frontends_serving(scheduler.address, frontends))

        async def scenario() -> tuple[list[int], int, grpc.StatusCode, bool]:
            async with grpc.aio.insecure_channel(scheduler.address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                long = request("long one", IN_FLIGHT, ignore_eos=True)
                call = stub.Generate(long, timeout=CALL_TIMEOUT_S)
                first = await call.read()
                assert isinstance(first, pb.GenerateResponse)
                scheduler.proc.send_signal(signal.SIGTERM)
                refused = grpc.StatusCode.OK
                deadline = time.monotonic() + SETTLE_TIMEOUT_S
                # Served until the scheduler takes the signal; a call that meets the server as it
                # stops listening is CANCELLED by gRPC; after that, every new call is UNAVAILABLE.
                while refused in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED):
                    assert time.monotonic() < deadline, "new calls still served after SIGTERM"
                    try:
                        await generate(scheduler.address, request("too late", 3))
                        refused = grpc.StatusCode.OK
                    except grpc.aio.AioRpcError as exc:
                        refused = exc.code()
                still_running = not call.done()
                tokens = list(first.token_ids)
                finish = pb.FINISH_REASON_UNSPECIFIED
                while isinstance(response := await call.read(), pb.GenerateResponse):
                    tokens += response.token_ids
                    finish = response.finish_reason
                return tokens, finish, refused, still_running

        tokens, finish, refused, still_running = asyncio.run(scenario())
        assert refused == grpc.StatusCode.UNAVAILABLE
        assert still_running  # drained, not done before the signal
        assert finish == pb.FINISH_REASON_LENGTH
        assert tokens == sim_expected(b"long one", IN_FLIGHT)
        assert scheduler.proc.wait(STOP_TIMEOUT_S) == 0
        assert worker.stop() == 0


def test_tiny_model_served_to_the_cli_client() -> None:
    with serving_pair(["--model", "tiny"]) as (_, scheduler):
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "stepahead_client",
                "Hello",
                "--max-new-tokens",
                "16",
                "--ignore-eos",
                "--server",
                scheduler.address,
            ],
            capture_output=True,
            text=True,
            timeout=CALL_TIMEOUT_S,
        )
        assert out.returncode == 0, out.stderr
        assert "FINISH_REASON_LENGTH; 5 prompt + 16 completion tokens" in out.stderr


def lost_waiting(scheduler: Service) -> list[int]:
    """For each worker loss the scheduler logged: how many requests waited for a worker."""
    return [int(m.group(1)) for m in LOST_RE.finditer("".join(list(scheduler.output)))]


def health_status(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        check = health_pb2.HealthCheckRequest(service="")
        return int(stub.Check(check, timeout=CALL_TIMEOUT_S).status)  # type: ignore[attr-defined]


def reports(address: str, status: int) -> bool:
    try:
        return health_status(address) == status
    except grpc.RpcError:  # a check that fails is tried again
        return False


def wait_health(address: str, status: int) -> None:
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    wait_until(lambda: reports(address, status), f"{address} {name}")


@pytest.mark.parametrize("frontends", FRONTEND_COUNTS)
def test_health_follows_the_worker_and_a_stream_survives_its_restart(frontends: int) -> None:
    worker_port = unused_port()
    # A hang guard: the restarted worker is back in seconds.
    flags = ["--worker-retry-timeout", "600", *frontend_flags(frontends)]
    scheduler = spawn_scheduler(f"127.0.0.1:{worker_port}", flags)
    worker = None
    try:
        # No worker yet: not serving, and a request is refused outright.
        assert health_status(scheduler.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            asyncio.run(generate(scheduler.address, request("early", 3)))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

        worker = spawn_worker(SIM, port=worker_port)
        wait_serving(scheduler.address)
        asyncio.run(wait_frontends_serving(scheduler.address, frontends))

        async def across_a_restart() -> list[int]:
            nonlocal worker
            async with grpc.aio.insecure_channel(scheduler.address) as channel:
                call = generation_pb2_grpc.GenerationStub(channel).Generate(
                    request("survivor", 1000, ignore_eos=True), timeout=CALL_TIMEOUT_S
                )
                tokens: list[int] = []
                first = await call.read()
                assert isinstance(first, pb.GenerateResponse)
                tokens += first.token_ids
                assert worker is not None
                with paused(worker.proc):  # it cannot end between the look and the kill
                    assert (await server_info(scheduler.address)).requests_running == 1
                    worker.proc.kill()
                    worker.proc.wait(STOP_TIMEOUT_S)
                await asyncio.to_thread(
                    wait_health, scheduler.address, health_pb2.HealthCheckResponse.NOT_SERVING
                )
                worker = await asyncio.to_thread(spawn_worker, SIM, worker_port)
                while isinstance(response := await call.read(), pb.GenerateResponse):
                    tokens += response.token_ids
                return tokens

        assert asyncio.run(across_a_restart()) == sim_expected(b"survivor", 1000)
        wait_until(lambda: bool(lost_waiting(scheduler)), "the worker's loss logged")
        assert lost_waiting(scheduler) == [1], "".join(scheduler.output)  # lost with the request
        wait_health(scheduler.address, health_pb2.HealthCheckResponse.SERVING)
        assert scheduler.stop() == 0
    finally:
        for service in (scheduler, worker):
            if service is not None and service.proc.poll() is None:
                service.stop()


def test_scheduler_with_an_in_process_worker_serves_and_reports_both_metrics() -> None:
    scheduler = spawn_scheduler_in_process(SIM, [])
    try:
        wait_serving(scheduler.address)
        stream = asyncio.run(generate(scheduler.address, request("no boundary", 6, ignore_eos=True)))
        assert [t for r in stream for t in r.token_ids] == sim_expected(b"no boundary", 6)
        assert set(scheduler.metrics_urls) == {"scheduler", "worker"}
        with urllib.request.urlopen(scheduler.metrics_urls["worker"], timeout=CALL_TIMEOUT_S) as response:
            assert b"stepahead_batches_total" in response.read()
        assert scheduler.stop() == 0
    finally:
        if scheduler.proc.poll() is None:
            scheduler.stop()
