"""The engine core with frontend processes: faults of one frontend or of the core, facts that
span frontends, streaming intervals, and what the core imports."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest

from bench.promtext import Samples, scrape, total
from stepahead.processes import Service, serving_pair, spawn_worker, wait_serving
from stepahead.v1 import generation_pb2 as pb
from stepahead.v1 import generation_pb2_grpc
from tests.live import channels_by_frontend, frontend_flags, server_info, unused_port, wait_all_free
from worker_svc.backends import sim_continuation as sim_expected

SIM = ["--model", "sim", "--sim-step-ms", "3", "--sim-token-us", "0", "--check-invariants"]
HELLO_RE = re.compile(r"frontend (\d+) \(pid (\d+)\) serves port")


def frontend_pids(scheduler: Service) -> dict[int, list[int]]:
    """Every frontend process the core has seen attach, by index, oldest first."""
    pids: dict[int, list[int]] = {}
    for line in list(scheduler.output):
        if m := HELLO_RE.search(line):
            pids.setdefault(int(m.group(1)), []).append(int(m.group(2)))
    return pids


def request(text: str, n: int, rid: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=rid, text=text, sampling=pb.SamplingParams(max_new_tokens=n, ignore_eos=True)
    )


async def tokens_of(channel: grpc.aio.Channel, req: pb.GenerateRequest) -> list[int]:
    stub = generation_pb2_grpc.GenerationStub(channel)
    return [t async for r in stub.Generate(req, timeout=60) for t in r.token_ids]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_until(condition: object, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if callable(condition) and condition():
            return
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def test_a_killed_frontend_fails_only_its_clients_frees_their_slots_and_is_replaced() -> None:
    with serving_pair(SIM, frontend_flags(2)) as (_, scheduler):

        async def scenario() -> tuple[list[list[int] | BaseException], list[list[int]]]:
            groups = await channels_by_frontend(scheduler.address, 2, per_frontend=2)
            victim = [
                asyncio.create_task(tokens_of(c, request(f"doomed {i}", 2000)))
                for i, c in enumerate(groups["1"])
            ]
            kept = [
                asyncio.create_task(tokens_of(c, request(f"kept {i}", 300)))
                for i, c in enumerate(groups["0"])
            ]
            await asyncio.sleep(0.5)
            os.kill(frontend_pids(scheduler)[1][0], signal.SIGKILL)
            lost = await asyncio.gather(*victim, return_exceptions=True)
            return lost, await asyncio.gather(*kept)

        lost, kept = asyncio.run(scenario())
        assert all(
            isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.UNAVAILABLE for e in lost
        )
        assert kept == [sim_expected(f"kept {i}".encode(), 300) for i in range(2)]
        asyncio.run(wait_all_free(scheduler.address))  # the dead frontend's requests freed their slots
        wait_until(lambda: len(frontend_pids(scheduler).get(1, [])) == 2)  # a new frontend 1 attached
        assert total(scrape(scheduler.metrics_url), "stepahead_frontend_restarts_total") == 1

        async def served_by_the_new_one() -> list[int]:
            groups = await channels_by_frontend(scheduler.address, 2, per_frontend=1)
            return await tokens_of(groups["1"][0], request("after", 5))

        assert asyncio.run(served_by_the_new_one()) == sim_expected(b"after", 5)


def test_when_the_core_dies_the_frontends_exit() -> None:
    with serving_pair(SIM, frontend_flags(2)) as (_, scheduler):
        pids = [p[0] for p in frontend_pids(scheduler).values()]
        assert len(pids) == 2 and all(alive(pid) for pid in pids)
        scheduler.proc.kill()
        scheduler.proc.wait(10)
        wait_until(lambda: not any(alive(pid) for pid in pids))


def test_duplicate_ids_and_aborts_work_across_frontends() -> None:
    with serving_pair(SIM, frontend_flags(2)) as (_, scheduler):

        async def scenario() -> tuple[grpc.StatusCode, bool, int, bool]:
            groups = await channels_by_frontend(scheduler.address, 2, per_frontend=1)
            a, b = groups["0"][0], groups["1"][0]
            call = generation_pb2_grpc.GenerationStub(a).Generate(
                request("shared id", 5000, "dup"), timeout=60
            )
            await call.read()  # live on frontend 0
            with pytest.raises(grpc.aio.AioRpcError) as duplicate:
                await tokens_of(b, request("again", 3, "dup"))
            stub_b = generation_pb2_grpc.GenerationStub(b)
            aborted = await stub_b.Abort(pb.AbortRequest(request_id="dup"), timeout=10)
            last = pb.GenerateResponse()
            while isinstance(response := await call.read(), pb.GenerateResponse):
                last = response
            again = await stub_b.Abort(pb.AbortRequest(request_id="dup"), timeout=10)
            await wait_all_free(scheduler.address)
            return duplicate.value.code(), aborted.aborted, last.finish_reason, again.aborted

        code, aborted, finish, again = asyncio.run(scenario())
        assert code == grpc.StatusCode.ALREADY_EXISTS
        assert aborted and finish == pb.FINISH_REASON_ABORT and not again


def test_max_waiting_counts_every_frontend() -> None:
    flags = ["--max-running", "2", "--max-waiting", "2", *frontend_flags(2)]
    with serving_pair([*SIM, "--request-slots", "2"], flags) as (_, scheduler):

        async def scenario() -> tuple[list[list[int] | BaseException], list[list[int] | BaseException]]:
            groups = await channels_by_frontend(scheduler.address, 2, per_frontend=2)
            channels = [c for group in groups.values() for c in group]
            admitted = []
            for i, c in enumerate(channels):  # one at a time: 2 run, then 2 wait (from both frontends)
                admitted.append(asyncio.create_task(tokens_of(c, request(f"a{i}", 200))))
                await live_count(scheduler.address, i + 1)
            late = [tokens_of(c, request(f"b{i}", 5)) for i, c in enumerate(channels)]
            refused = await asyncio.gather(*late, return_exceptions=True)
            return refused, await asyncio.gather(*admitted, return_exceptions=True)

        refused, admitted = asyncio.run(scenario())
        assert all(isinstance(e, grpc.aio.AioRpcError) for e in refused), refused  # on both frontends
        assert {e.code() for e in refused if isinstance(e, grpc.aio.AioRpcError)} == {
            grpc.StatusCode.RESOURCE_EXHAUSTED
        }
        assert admitted == [sim_expected(f"a{i}".encode(), 200) for i in range(4)]
        asyncio.run(wait_all_free(scheduler.address))


async def live_count(address: str, n: int) -> None:
    for _ in range(500):
        info = await server_info(address)
        if info.requests_running + info.requests_waiting == n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{n} requests never became live")


@pytest.mark.parametrize("frontends", [0, 2])
def test_stream_interval_batches_tokens_without_changing_them(frontends: int) -> None:
    with serving_pair(SIM, ["--stream-interval", "4", *frontend_flags(frontends)]) as (_, scheduler):

        async def scenario() -> list[pb.GenerateResponse]:
            async with grpc.aio.insecure_channel(scheduler.address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                return [r async for r in stub.Generate(request("interval", 30), timeout=60)]

        responses = asyncio.run(scenario())
        assert [t for r in responses for t in r.token_ids] == sim_expected(b"interval", 30)
        assert all(len(r.token_ids) >= 4 for r in responses[:-1])  # never fewer than 4 but at the finish
        assert len(responses) <= 30 // 4 + 1


def test_metrics_of_every_frontend_add_up_to_what_clients_received() -> None:
    with serving_pair(SIM, frontend_flags(2)) as (_, scheduler):

        async def scenario() -> tuple[Samples, int]:
            groups = await channels_by_frontend(scheduler.address, 2, per_frontend=2)
            before = scrape(scheduler.metrics_url)
            channels = [c for group in groups.values() for c in group]
            got = await asyncio.gather(
                *(tokens_of(c, request(f"m{i}", 20 + i)) for i, c in enumerate(channels))
            )
            return before, sum(map(len, got))

        before, received = asyncio.run(scenario())
        after = scrape(scheduler.metrics_url)

        def grew(name: str, **labels: str) -> float:
            return total(after, name, **labels) - total(before, name, **labels)

        assert received == 20 + 21 + 22 + 23
        assert grew("stepahead_generation_tokens_total") == received
        assert grew("stepahead_requests_finished_total", reason="length") == 4
        assert grew("stepahead_time_to_first_token_seconds_count") == 4
        assert total(after, "stepahead_frontends") == 2
        assert total(after, "stepahead_frontend_cpu_seconds_total") > 0


def test_the_core_imports_neither_torch_nor_the_worker() -> None:
    code = (
        "import sys; import scheduler_svc.core, scheduler_svc.__main__, scheduler_svc.frontend_process; "
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('worker_svc')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def busy_port() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


@pytest.mark.parametrize(
    ("module", "flag", "extra"),
    [
        ("scheduler_svc", "--port", ["--frontends", "0"]),
        ("scheduler_svc", "--port", ["--frontends", "2"]),
        ("scheduler_svc", "--metrics-port", []),
        ("scheduler_svc", "--http-port", ["--frontends", "0"]),
        ("scheduler_svc", "--http-port", ["--frontends", "2"]),
        ("worker_svc", "--port", ["--model", "sim"]),
        ("worker_svc", "--metrics-port", ["--model", "sim"]),
    ],
)
def test_a_port_in_use_names_the_flag_to_change(module: str, flag: str, extra: list[str]) -> None:
    with busy_port() as taken:
        port = str(taken.getsockname()[1])
        args = {"--port": str(unused_port()), "--metrics-port": str(unused_port())}
        if module == "scheduler_svc":
            args["--http-port"] = str(unused_port())
        args[flag] = port
        argv = [sys.executable, "-m", module, *extra, *(x for kv in args.items() for x in kv)]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert flag in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_requests_arriving_during_a_worker_outage_wait_for_the_next_worker() -> None:
    port = unused_port()
    worker = spawn_worker(SIM, port=port)
    scheduler = None
    try:
        from stepahead.processes import spawn_scheduler

        scheduler = spawn_scheduler(worker.address, frontend_flags(2))
        wait_serving(scheduler.address)
        worker.proc.kill()
        worker.proc.wait(10)

        async def during_outage() -> list[list[int]]:
            async with grpc.aio.insecure_channel(scheduler.address) as channel:
                calls = [asyncio.create_task(tokens_of(channel, request(f"o{i}", 10))) for i in range(5)]
                await asyncio.sleep(1.0)  # they arrive while no worker is connected
                nonlocal worker
                worker = spawn_worker(SIM, port=port)
                return await asyncio.gather(*calls)

        assert asyncio.run(during_outage()) == [sim_expected(f"o{i}".encode(), 10) for i in range(5)]
    finally:
        for service in (scheduler, worker):
            if service is not None and service.proc.poll() is None:
                service.stop()
