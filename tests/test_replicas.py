"""Replicas: two worker + scheduler pairs serving one model on 127.0.0.1, and clients that
balance over them on one gRPC channel with the round_robin policy
(`stepahead.targets.channel_target`): the split, a worker lost on one replica, and the CLI
client and loadgen given both.

A round_robin channel picks among the replicas it has found ready, in turn: a test first has
a call served by each (or, with a replica's worker lost, sees its calls skip that one) before
it counts where calls go."""

from __future__ import annotations

import asyncio
import json
import random
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.promtext import Samples, scrape, total
from bench.replicas import (
    FULL,
    Measured,
    Point,
    ReplicaFigures,
    replica_figures,
    scaling_table,
    target_lines,
    target_met,
)
from loadgen.cli import run as run_loadgen
from stepahead.processes import (
    STOP_TIMEOUT_S,
    Service,
    spawn_scheduler,
    spawn_scheduler_in_process,
    spawn_worker,
    wait_serving,
)
from stepahead.targets import (
    HEALTH_CHECKED_SERVICE,
    ROUND_ROBIN,
    SERVICE_CONFIG,
    ChannelTarget,
    channel_target,
    open_target,
    split_servers,
)
from stepahead.v1 import generation_pb2 as pb
from stepahead.v1 import generation_pb2_grpc
from stepahead_client.client import parse_args, stream_reply
from tests.live import (
    CALL_TIMEOUT_S,
    POLL_S,
    SETTLE_TIMEOUT_S,
    paused,
    server_info,
    unused_port,
    wait_all_free,
    wait_until,
)
from tests.test_bench import summary
from tests.test_security import server_auth, write_pki
from worker_svc.backends import sim_continuation as sim_expected

SIM = ["--model", "sim", "--sim-step-ms", "3", "--sim-token-us", "0", "--check-invariants"]
FINISHED = "stepahead_requests_finished_total"
SCHEDULED = "stepahead_request_queue_time_seconds_count"  # requests the core has scheduled once
LOST_RE = re.compile(r"worker lost .*?; (\d+) requests wait for a worker", re.S)  # its reason may span lines
API_KEY = "replicas-key-for-tests"
LONG = 8000  # tokens: 24 s of the sim at 3 ms a step, whatever the machine


# ---- targets: no process needed --------------------------------------------------------------


def test_one_plain_server_keeps_the_default_channel() -> None:
    assert channel_target(["10.0.0.1:50051"]) == ChannelTarget("10.0.0.1:50051")


def test_a_target_uri_is_kept_and_balanced_round_robin() -> None:
    target = channel_target(["dns:///schedulers.internal:50051"])
    assert target == ChannelTarget("dns:///schedulers.internal:50051", ((SERVICE_CONFIG, ROUND_ROBIN),))


def test_a_list_becomes_one_address_list_balanced_round_robin() -> None:
    target = channel_target(["127.0.0.1:7001", "localhost:7002"])
    assert target.target == "ipv4:127.0.0.1:7001,127.0.0.1:7002"  # names resolved, IPv4 first
    options = dict(target.options)
    assert json.loads(str(options[SERVICE_CONFIG])) == {
        "loadBalancingConfig": [{"round_robin": {}}],
        "healthCheckConfig": {"serviceName": "stepahead.v1.Generation"},
    }
    assert options["grpc.default_authority"] == "127.0.0.1:7001"  # what TLS checks the names against


def test_an_ipv6_list_uses_the_ipv6_scheme(monkeypatch: pytest.MonkeyPatch) -> None:
    def v6_only(host: str, port: int, *args: object, **kw: object) -> list[tuple[object, ...]]:
        return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", (host, port, 0, 0))]

    monkeypatch.setattr(socket, "getaddrinfo", v6_only)  # whatever this machine's resolver does
    assert channel_target(["[::1]:7001", "[::1]:7002"]).target == "ipv6:[::1]:7001,[::1]:7002"


def test_server_lists_split_on_commas_and_uris_stay_whole() -> None:
    assert split_servers("a:1, b:2") == ["a:1", "b:2"]
    assert split_servers("ipv4:10.0.0.1:1,10.0.0.2:1") == ["ipv4:10.0.0.1:1,10.0.0.2:1"]
    assert parse_args(["hi", "--server", "a:1,b:2"]).servers == ["a:1", "b:2"]
    assert parse_args(["hi"]).servers == ["127.0.0.1:50051"]


@pytest.mark.parametrize("value", ["a:1,,b:2", "a:1,", "dns:///a:1,b:2"])
def test_bad_server_lists_are_refused(value: str) -> None:
    with pytest.raises(ValueError):
        split_servers(value)
    with pytest.raises(SystemExit):
        parse_args(["hi", "--server", value])


@pytest.mark.parametrize(
    ("servers", "message"),
    [
        (["a:1", "no-port"], "not HOST:PORT"),
        (["a:1", "ipv4:10.0.0.1:1"], "not HOST:PORT"),
        (["127.0.0.1:1", "no-such-host.invalid:1"], "cannot resolve no-such-host.invalid"),
        (["127.0.0.1:1", "[::1]:2"], "cannot mix IPv4 and IPv6"),
    ],
)
def test_lists_that_name_no_usable_address_are_refused(servers: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        channel_target(servers)


def test_the_cli_client_reports_a_name_that_does_not_resolve(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse_args(["hi", "--server", "127.0.0.1:1,no-such-host.invalid:1"])
    assert asyncio.run(stream_reply(args)) == 2
    assert "error: --server: cannot resolve no-such-host.invalid" in capsys.readouterr().err


# ---- two live replicas -----------------------------------------------------------------------


@dataclass
class Replica:
    worker: Service
    scheduler: Service

    @property
    def address(self) -> str:
        return self.scheduler.address

    def stop(self) -> None:
        for service in (self.scheduler, self.worker):
            if service.proc.poll() is None:
                service.stop()


def start_replica() -> Replica:
    worker = spawn_worker(SIM)
    try:
        wait_serving(worker.address)
        # --worker-retry-timeout: a hang guard; a restarted worker is back in seconds.
        flags = ["--max-batch-tokens", "256", "--worker-retry-timeout", "600"]
        scheduler = spawn_scheduler(worker.address, flags)
    except BaseException:
        worker.stop()
        raise
    replica = Replica(worker, scheduler)
    try:
        wait_serving(scheduler.address)
    except BaseException:
        replica.stop()
        raise
    return replica


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[Replica]]:
    started: list[Replica] = []
    try:
        for _ in range(2):
            started.append(start_replica())
        yield started
    finally:
        for replica in started:
            replica.stop()


def addresses(replicas: Sequence[Replica]) -> list[str]:
    return [r.address for r in replicas]


def scheduler_scrape(scheduler: Service) -> Samples:
    """The scheduler's metrics, once they hold its frontend process's: /metrics asks the frontend
    over its link and leaves it out if it does not answer in a few seconds (its CPU time is
    then 0)."""
    found: list[Samples] = []

    def complete() -> bool:
        found.append(scrape(scheduler.metrics_url))
        return total(found[-1], "stepahead_frontend_cpu_seconds_total") > 0

    wait_until(complete, f"{scheduler.address}'s frontend in its metrics")
    return found[-1]


def finished(replicas: Sequence[Replica]) -> list[float]:
    """Requests each scheduler has ended so far."""
    return [total(scheduler_scrape(r.scheduler), FINISHED) for r in replicas]


def finished_once(replicas: Sequence[Replica], start: Sequence[float], added: int) -> list[float]:
    """The schedulers' counts once `added` more requests than `start` have been counted (a
    request is counted just after its last message)."""
    counts: list[list[float]] = []

    def counted() -> bool:
        counts.append(finished(replicas))
        return sum(counts[-1]) - sum(start) >= added

    wait_until(counted, f"{added} more requests counted")
    return counts[-1]


def served_since(replicas: Sequence[Replica], before: Sequence[float], expected: int) -> list[int]:
    """Requests each replica ended since `before`, once they add up to `expected`."""
    after = finished_once(replicas, before, expected)
    return [round(a - b) for a, b in zip(after, before, strict=True)]


def prompt(i: int) -> str:
    return f"replica {i} " * (1 + i % 5)


async def stream_tokens(stub: generation_pb2_grpc.GenerationAsyncStub, i: int, n: int) -> list[int]:
    request = pb.GenerateRequest(
        text=prompt(i), sampling=pb.SamplingParams(max_new_tokens=n, ignore_eos=True)
    )
    return [t async for r in stub.Generate(request, timeout=CALL_TIMEOUT_S) for t in r.token_ids]


async def reach_every_replica(
    stub: generation_pb2_grpc.GenerationAsyncStub, replicas: Sequence[Replica]
) -> list[float]:
    """One-token calls, one at a time, until each replica has served one; then the counts once
    all of them are counted. A round_robin channel is ready once one address is connected, and
    picks only among the connected ones, so calls sent at once right after opening it may all
    go to the first."""
    start = finished(replicas)
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    calls = 0
    while True:
        calls += 1
        await stream_tokens(stub, calls, 1)
        now = await asyncio.to_thread(finished, replicas)
        if all(n > s for n, s in zip(now, start, strict=True)):
            return await asyncio.to_thread(finished_once, replicas, start, calls)
        assert time.monotonic() < deadline, f"calls reached only some replicas: {now} from {start}"


def check_tokens(outputs: Sequence[list[int]], lengths: Sequence[int]) -> None:
    for i, (tokens, n) in enumerate(zip(outputs, lengths, strict=True)):
        assert tokens == sim_expected(prompt(i).encode(), n), i


def test_round_robin_spreads_the_load_over_both_replicas(replicas: list[Replica]) -> None:
    lengths = [8 + i % 9 for i in range(40)]

    async def load() -> tuple[list[float], list[list[int]]]:
        async with open_target(addresses(replicas)) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            before = await reach_every_replica(stub, replicas)
            return before, await asyncio.gather(*(stream_tokens(stub, i, n) for i, n in enumerate(lengths)))

    before, outputs = asyncio.run(load())
    check_tokens(outputs, lengths)
    served = served_since(replicas, before, len(lengths))
    assert sum(served) == len(lengths) and min(served) > 0.25 * len(lengths), served


async def started_on(replica: Replica, rid: str, text: str, n: int) -> asyncio.Task[list[int]]:
    """A call sent to `replica` alone, once its first response is in (it is running there)."""
    channel = grpc.aio.insecure_channel(replica.address)
    req = pb.GenerateRequest(
        request_id=rid, text=text, sampling=pb.SamplingParams(max_new_tokens=n, ignore_eos=True)
    )
    call = generation_pb2_grpc.GenerationStub(channel).Generate(req, timeout=CALL_TIMEOUT_S)
    first = await call.read()
    assert isinstance(first, pb.GenerateResponse), first

    async def rest() -> list[int]:
        async with channel:
            tokens = list(first.token_ids)
            while isinstance(response := await call.read(), pb.GenerateResponse):
                tokens += response.token_ids
            return tokens

    return asyncio.create_task(rest())


async def aborted_on(replica: Replica, rid: str, call: asyncio.Task[list[int]]) -> list[int]:
    """Abort call `rid`, still running on `replica`: its tokens so far."""
    assert not call.done()
    async with grpc.aio.insecure_channel(replica.address) as channel:
        abort = pb.AbortRequest(request_id=rid)
        assert (
            await generation_pb2_grpc.GenerationStub(channel).Abort(abort, timeout=CALL_TIMEOUT_S)
        ).aborted
    return await call


def scheduled(replica: Replica) -> float:
    return total(scrape(replica.scheduler.metrics_url), SCHEDULED)


def test_killing_one_replicas_worker_mid_load_loses_nothing_on_either(replicas: list[Replica]) -> None:
    """The victim's worker is killed once the load has reached it, while a long call sent to the
    victim alone is seen running there (the worker stopped while the test looks)."""
    rng = random.Random(11)
    lengths = [rng.randint(100, 300) for _ in range(60)]
    victim = replicas[0]
    lost_before = len(lost_sessions(victim.scheduler))

    async def load_with_a_crash() -> tuple[list[float], list[list[int]], list[int]]:
        async with open_target(addresses(replicas)) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            before = await reach_every_replica(stub, replicas)
            anchor = await started_on(victim, "anchor", "anchor", LONG)  # runs until aborted
            admitted = await asyncio.to_thread(scheduled, victim)
            clients = [asyncio.create_task(stream_tokens(stub, i, n)) for i, n in enumerate(lengths)]
            reached = lambda: scheduled(victim) > admitted  # noqa: E731
            await asyncio.to_thread(wait_until, reached, "the load on the victim")
            with paused(victim.worker.proc):
                assert (await server_info(victim.address)).requests_running > 0
                victim.worker.proc.kill()  # SIGKILL: no goodbye on the stream
                victim.worker.proc.wait(STOP_TIMEOUT_S)
            victim.worker = await asyncio.to_thread(spawn_worker, SIM, victim.worker.port)
            outputs = await asyncio.gather(*clients)
            return before, outputs, await aborted_on(victim, "anchor", anchor)

    before, outputs, anchor = asyncio.run(load_with_a_crash())
    check_tokens(outputs, lengths)
    assert 0 < len(anchor) < LONG and anchor == sim_expected(b"anchor", len(anchor))
    served = served_since(replicas, [before[0] + 1, before[1]], len(lengths))  # + the anchor
    assert sum(served) == len(lengths) and min(served) > 0, served
    wait_until(lambda: len(lost_sessions(victim.scheduler)) > lost_before, "the loss logged")
    waiting = lost_sessions(victim.scheduler)[lost_before:]
    assert waiting[0] > 0, "".join(victim.scheduler.output)  # requests were in flight
    assert not lost_sessions(replicas[1].scheduler)
    for replica in replicas:
        asyncio.run(wait_all_free(replica.address))


async def lands_on_the_live_replica(
    stub: generation_pb2_grpc.GenerationAsyncStub, victim: Replica, k: int
) -> bool:
    """Whether probe k, sent round robin, is served by the live replica: one the channel sends
    to the victim waits there for a worker, and is aborted."""
    rid = f"probe-{k}"
    probe = pb.GenerateRequest(
        request_id=rid, text="probe", sampling=pb.SamplingParams(max_new_tokens=1, ignore_eos=True)
    )
    call = asyncio.ensure_future(generate_on(stub, probe))
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    async with grpc.aio.insecure_channel(victim.address) as channel:
        victim_stub = generation_pb2_grpc.GenerationStub(channel)
        while not call.done():
            assert time.monotonic() < deadline, f"probe {k} neither served nor waiting on the victim"
            if (await server_info(victim.address)).requests_waiting:
                await victim_stub.Abort(pb.AbortRequest(request_id=rid), timeout=CALL_TIMEOUT_S)
            await asyncio.wait({call}, timeout=POLL_S)
    return (await call) == pb.FINISH_REASON_LENGTH


async def generate_on(stub: generation_pb2_grpc.GenerationAsyncStub, req: pb.GenerateRequest) -> int:
    """The call's finish reason."""
    return [r.finish_reason async for r in stub.Generate(req, timeout=CALL_TIMEOUT_S)][-1]


def test_new_calls_skip_a_replica_whose_worker_is_lost(replicas: list[Replica]) -> None:
    """Its scheduler reports NOT_SERVING without a worker session; round_robin's health check
    sends every new call to the other replica, and to both again once the worker is back.

    The channel hears of NOT_SERVING on its own: probes are sent until two in a row go to the
    live replica (with both in its rotation, consecutive calls alternate); from then on every
    call does."""
    victim = replicas[0]

    async def load() -> tuple[list[int], list[int]]:
        async with open_target(addresses(replicas)) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            await reach_every_replica(stub, replicas)
            port = victim.worker.port
            victim.worker.proc.kill()
            victim.worker.proc.wait(STOP_TIMEOUT_S)
            await wait_health(victim.address, health_pb2.HealthCheckResponse.NOT_SERVING)
            streak, k = 0, 0
            while streak < 2:
                k += 1
                streak = streak + 1 if await lands_on_the_live_replica(stub, victim, k) else 0
            await wait_all_free(victim.address)  # the probes it got are gone
            before = await asyncio.to_thread(finished, replicas)
            await asyncio.gather(*(stream_tokens(stub, i, 4) for i in range(10)))
            while_lost = await asyncio.to_thread(served_since, replicas, before, 10)
            victim.worker = await asyncio.to_thread(spawn_worker, SIM, port)
            await wait_health(victim.address, health_pb2.HealthCheckResponse.SERVING)
            again = await reach_every_replica(stub, replicas)
            return while_lost, await asyncio.to_thread(served_since, replicas, again, 0)

    while_lost, _ = asyncio.run(load())
    assert while_lost == [0, 10], while_lost  # reach_every_replica shows both serve again


async def wait_health(address: str, status: int) -> None:
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service=HEALTH_CHECKED_SERVICE)
        while True:
            try:
                if (await stub.Check(request, timeout=CALL_TIMEOUT_S)).status == status:  # type: ignore[attr-defined]
                    return
            except grpc.aio.AioRpcError:
                pass  # tried again
            assert time.monotonic() < deadline, f"{address} not {name} after {SETTLE_TIMEOUT_S:g}s"
            await asyncio.sleep(POLL_S)


def lost_sessions(scheduler: Service) -> list[int]:
    """For each worker loss the scheduler logged: how many requests waited for a worker."""
    return [int(m.group(1)) for m in LOST_RE.finditer("".join(list(scheduler.output)))]


def test_loadgen_with_both_replicas_loads_each(replicas: list[Replica], tmp_path: Path) -> None:
    before = finished(replicas)
    argv = ["--server", ",".join(addresses(replicas)), "--num-prompts", "16", "--warmup", "4"]
    argv += ["--connections", "2", "--random-input-len", "8", "--random-output-len", "4", "--ignore-eos"]
    assert run_loadgen([*argv, "--no-progress"]) == 0
    served = served_since(replicas, before, 20)
    assert sum(served) == 20 and min(served) > 0.25 * 20, served


def run_client(servers: str, *flags: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "stepahead_client", "Hi", "--max-new-tokens", "3", "--ignore-eos"]
    return subprocess.run(
        [*argv, "--server", servers, *flags], capture_output=True, text=True, timeout=CALL_TIMEOUT_S
    )


def assert_served(out: subprocess.CompletedProcess[str]) -> None:
    assert out.returncode == 0, out.stderr
    assert "FINISH_REASON_LENGTH; 2 prompt + 3 completion tokens" in out.stderr


def with_a_dead_server(servers: Sequence[str]) -> Iterator[str]:
    """Each server alone in a list with an address nothing listens on, in turn in the first and
    the second place: a call that succeeds reached the live one, wherever it is listed."""
    dead = f"127.0.0.1:{unused_port()}"
    for i, server in enumerate(servers):
        yield ",".join([dead, server] if i % 2 == 0 else [server, dead])


def test_the_cli_client_reaches_each_replica_it_is_given(replicas: list[Replica]) -> None:
    by_name = [f"localhost:{r.scheduler.port}" for r in replicas]  # names in a list are resolved
    for servers in with_a_dead_server(by_name):
        assert_served(run_client(servers))
    assert_served(run_client(",".join(addresses(replicas))))
    assert_served(run_client(f"dns:///localhost:{replicas[1].scheduler.port}"))


def test_the_cli_client_keeps_tls_and_the_api_key_over_a_list(tmp_path: Path) -> None:
    pki = write_pki(tmp_path)
    flags = ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key), "--api-key", API_KEY]
    schedulers: list[Service] = []
    try:
        for _ in range(2):
            schedulers.append(spawn_scheduler_in_process(SIM, flags))
            wait_serving(schedulers[-1].address, credentials=server_auth(pki))
        tls = ["--tls-ca", str(pki.ca)]
        for servers in with_a_dead_server([s.address for s in schedulers]):
            assert_served(run_client(servers, *tls, "--api-key", API_KEY))
        refused = run_client(",".join(s.address for s in schedulers), *tls)
        assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
    finally:
        for scheduler in schedulers:
            scheduler.stop()


# ---- bench.replicas: figures from fixed deltas -------------------------------------------------


def samples(**values: float) -> Samples:
    return {(name, frozenset()): value for name, value in values.items()}


def scheduler_samples(finished: float) -> Samples:
    return samples(
        stepahead_requests_finished_total=finished,
        stepahead_generation_tokens_total=60_000,
        process_cpu_seconds_total=1.0,
        stepahead_frontend_cpu_seconds_total=2.0,
    )


def worker_samples(busy_s: float) -> Samples:
    return samples(
        stepahead_device_busy_seconds_total=busy_s,
        stepahead_device_idle_seconds_total=10.0 - busy_s,
        process_cpu_seconds_total=0.5,
    )


def replica_run(tok_s: float = 12_000.0) -> ReplicaFigures:
    """Two replicas over 10 s: 30 and 10 requests, busy 0.9 and 0.8, 120,000 tokens."""
    measured = Measured(
        summary(tok_s),
        (scheduler_samples(30), scheduler_samples(10)),
        (worker_samples(9.0), worker_samples(8.0)),
        client_cpu_s=3.0,
    )
    return replica_figures(measured, 12_800.0)


def test_replica_figures_split_busy_and_cpu_per_token() -> None:
    f = replica_run()
    assert f.request_shares == (0.75, 0.25) and f.device_busy == pytest.approx((0.9, 0.8))
    assert f.fraction_of_ideal == pytest.approx(12_000 / 12_800)
    assert f.us_per_token(f.scheduler_cpu_s) == pytest.approx(50.0)  # 2 x (1 + 2) s over 120,000
    assert f.us_per_token(f.worker_cpu_s) == pytest.approx(1e6 / 120_000)
    assert f.cpus_used == pytest.approx(1.0)  # (6 + 1 + 3) s in 10 s
    assert f.cpus_by_side == pytest.approx((0.6, 0.1, 0.3))


def point(replicas: int, per_replica: int, tok_s: float) -> Point:
    return Point(replicas, per_replica, FULL.workload(replicas * per_replica), replica_run(tok_s))


@pytest.mark.parametrize(("two_at_64", "met"), [(11_400.0, True), (9_000.0, False)])
def test_the_scaling_table_and_the_target(two_at_64: float, met: bool) -> None:
    points = [
        point(1, 64, 6_000.0),
        point(1, 128, 12_000.0),
        point(2, 64, two_at_64),
        point(2, 128, 18_000.0),
    ]
    assert target_met(points) is met
    rows = scaling_table(points)
    assert rows[2] == f"| 64 | 6,000 | {two_at_64:,.0f} | {two_at_64 / 6_000:.3f}x |"
    assert rows[3] == "| 128 | 12,000 | 18,000 | 1.500x |"
    assert next(target_lines(points)).endswith(", met" if met else ", not met")
    assert target_met(points[:2]) is None  # no second replica: not measured
