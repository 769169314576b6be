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

import grpc
import httpx2
import pytest

from bench.promtext import Samples, scrape, total
from stepahead.processes import (
    START_TIMEOUT_S,
    STOP_TIMEOUT_S,
    Service,
    serving_pair,
    spawn_scheduler,
    spawn_worker,
    wait_serving,
)
from stepahead.v1 import generation_pb2 as pb
from stepahead.v1 import generation_pb2_grpc
from tests.live import (
    CALL_TIMEOUT_S,
    channels_by_frontend,
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
    return [t async for r in stub.Generate(req, timeout=CALL_TIMEOUT_S) for t in r.token_ids]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_killed_frontend_fails_only_its_clients_frees_their_slots_and_is_replaced() -> None:
    """Frontend 1 dies while its clients' requests and frontend 0's are seen running (the worker
    stopped meanwhile: none can end by itself)."""
    with serving_pair(SIM, frontend_flags(2)) as (worker, scheduler):
        asyncio.run(wait_frontends_serving(scheduler.address, 2))

        async def scenario() -> tuple[list[list[int] | BaseException], list[list[int]]]:
            groups = await channels_by_frontend(scheduler.address, 2, per_frontend=2)
            victim = [
                await started_call(generation_pb2_grpc.GenerationStub(c), request(f"doomed {i}", 2000))
                for i, c in enumerate(groups["1"])
            ]
            kept = [
                await started_call(generation_pb2_grpc.GenerationStub(c), request(f"kept {i}", 1000))
                for i, c in enumerate(groups["0"])
            ]
            with paused(worker.proc):
                assert (await server_info(scheduler.address)).requests_running == 4
                os.kill(frontend_pids(scheduler)[1][0], signal.SIGKILL)
            lost = await asyncio.gather(*victim, return_exceptions=True)
            return lost, await asyncio.gather(*kept)

        lost, kept = asyncio.run(scenario())
        assert all(
            isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.UNAVAILABLE for e in lost
        ), lost
        assert kept == [sim_expected(f"kept {i}".encode(), 1000) for i in range(2)]
        asyncio.run(wait_all_free(scheduler.address))  # the dead frontend's requests freed their slots
        wait_until(lambda: len(frontend_pids(scheduler).get(1, [])) == 2, "a new frontend 1 attached")
        assert total(scrape(scheduler.metrics_url), "stepahead_frontend_restarts_total") == 1

        async def served_by_the_new_one() -> list[int]:
            await wait_frontends_serving(scheduler.address, 2)
            groups = await channels_by_frontend(scheduler.address, 2, per_frontend=1)
            return await tokens_of(groups["1"][0], request("after", 5))

        assert asyncio.run(served_by_the_new_one()) == sim_expected(b"after", 5)


def test_when_the_core_dies_the_frontends_exit() -> None:
    with serving_pair(SIM, frontend_flags(2)) as (_, scheduler):
        pids = [p[0] for p in frontend_pids(scheduler).values()]
        assert len(pids) == 2 and all(alive(pid) for pid in pids)
        scheduler.proc.kill()
        scheduler.proc.wait(STOP_TIMEOUT_S)
        wait_until(lambda: not any(alive(pid) for pid in pids), "the frontends gone")


def test_the_frontends_run_below_the_core_s_priority() -> None:
    """--frontend-nice (default 5): on a shared box the kernel runs the core's loop before its
    frontends'; 0 keeps them level."""
    for flags, added in ([], 5), (["--frontend-nice", "0"], 0), (["--frontend-nice", "11"], 11):
        with serving_pair(SIM, [*frontend_flags(2), *flags]) as (_, scheduler):
            core = os.getpriority(os.PRIO_PROCESS, scheduler.proc.pid)
            pids = [p[0] for p in frontend_pids(scheduler).values()]
            assert len(pids) == 2
            assert [os.getpriority(os.PRIO_PROCESS, pid) - core for pid in pids] == [added, added]


def test_duplicate_ids_and_aborts_work_across_frontends() -> None:
    with serving_pair(SIM, frontend_flags(2)) as (worker, scheduler):
        asyncio.run(wait_frontends_serving(scheduler.address, 2))

        async def scenario() -> tuple[grpc.StatusCode, bool, int, bool]:
            groups = await channels_by_frontend(scheduler.address, 2, per_frontend=1)
            a, b = groups["0"][0], groups["1"][0]
            call = generation_pb2_grpc.GenerationStub(a).Generate(
                request("shared id", 5000, "dup"), timeout=CALL_TIMEOUT_S
            )
            await call.read()  # live on frontend 0 ...
            stub_b = generation_pb2_grpc.GenerationStub(b)
            with paused(worker.proc):  # ... and still live for both calls below
                with pytest.raises(grpc.aio.AioRpcError) as duplicate:
                    await tokens_of(b, request("again", 3, "dup"))
                aborted = await stub_b.Abort(pb.AbortRequest(request_id="dup"), timeout=CALL_TIMEOUT_S)
            last = pb.GenerateResponse()
            while isinstance(response := await call.read(), pb.GenerateResponse):
                last = response
            again = await stub_b.Abort(pb.AbortRequest(request_id="dup"), timeout=CALL_TIMEOUT_S)
            await wait_all_free(scheduler.address)
            return duplicate.value.code(), aborted.aborted, last.finish_reason, again.aborted

        code, aborted, finish, again = asyncio.run(scenario())
        assert code == grpc.StatusCode.ALREADY_EXISTS
        assert aborted and finish == pb.FINISH_REASON_ABORT and not again


LONG = 8000  # tokens: 24 s of the sim at 3 ms a step, whatever the machine


def test_max_waiting_counts_every_frontend() -> None:
    """2 running (long requests, one from each frontend, that cannot end before the test aborts
    them) and 2 waiting (one from each): a new request is refused on both frontends. Once the
    long ones are aborted, the waiting ones are served in full."""
    flags = ["--max-running", "2", "--max-waiting", "2", *frontend_flags(2)]
    with serving_pair([*SIM, "--request-slots", "2", "--kv-slots", "65536"], flags) as (_, scheduler):
        asyncio.run(wait_frontends_serving(scheduler.address, 2))

        async def scenario() -> tuple[list[list[int] | BaseException], list[list[int]], list[list[int]]]:
            groups = await channels_by_frontend(scheduler.address, 2, per_frontend=2)
            (a0, a1), (b0, b1) = groups["0"], groups["1"]
            running = [
                await started_call(generation_pb2_grpc.GenerationStub(c), request(f"r{i}", LONG, f"r{i}"))
                for i, c in enumerate((a0, b0))
            ]
            await wait_info(scheduler.address, lambda i: i.requests_running == 2, "2 running")
            waiting = [
                asyncio.create_task(tokens_of(c, request(f"w{i}", 200))) for i, c in enumerate((a1, b1))
            ]
            await wait_info(scheduler.address, lambda i: i.requests_waiting == 2, "2 waiting")
            late = [tokens_of(c, request(f"late{i}", 5)) for i, c in enumerate((a0, a1, b0, b1))]
            refused = await asyncio.gather(*late, return_exceptions=True)
            info = await server_info(scheduler.address)
            assert (info.requests_running, info.requests_waiting) == (2, 2), info  # held throughout
            stub = generation_pb2_grpc.GenerationStub(a0)
            for i in range(2):
                assert (await stub.Abort(pb.AbortRequest(request_id=f"r{i}"), timeout=CALL_TIMEOUT_S)).aborted
            return refused, await asyncio.gather(*running), await asyncio.gather(*waiting)

        refused, running, waiting = asyncio.run(scenario())
        assert all(isinstance(e, grpc.aio.AioRpcError) for e in refused), refused  # on both frontends
        assert {e.code() for e in refused if isinstance(e, grpc.aio.AioRpcError)} == {
            grpc.StatusCode.RESOURCE_EXHAUSTED
        }
        for i, tokens in enumerate(running):
            assert 0 < len(tokens) < LONG and tokens == sim_expected(f"r{i}".encode(), len(tokens))
        assert waiting == [sim_expected(f"w{i}".encode(), 200) for i in range(2)]
        asyncio.run(wait_all_free(scheduler.address))


@pytest.mark.parametrize("frontends", [0, 2])
def test_stream_interval_batches_tokens_without_changing_them(frontends: int) -> None:
    with serving_pair(SIM, ["--stream-interval", "4", *frontend_flags(frontends)]) as (_, scheduler):
        asyncio.run(wait_frontends_serving(scheduler.address, frontends))

        async def scenario() -> list[pb.GenerateResponse]:
            async with grpc.aio.insecure_channel(scheduler.address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                return [r async for r in stub.Generate(request("interval", 30), timeout=CALL_TIMEOUT_S)]

        responses = asyncio.run(scenario())
        assert [t for r in responses for t in r.token_ids] == sim_expected(b"interval", 30)
        assert all(len(r.token_ids) >= 4 for r in responses[:-1])  # never fewer than 4 but at the finish
        assert len(responses) <= 30 // 4 + 1


FINISHED = "stepahead_requests_finished_total"  # by the frontends, every reason
SCHEDULED = "stepahead_request_queue_time_seconds_count"  # by the core, once a request


def scrape_with_every_frontend(scheduler: Service) -> Samples:
    """The scheduler's metrics, taken while no request is live, once they hold every frontend's:
    each request the core has scheduled is then counted finished by the frontend that served
    it. (/metrics asks each frontend over its link and leaves out one that does not answer in
    a few seconds, so a scrape may miss one.)"""
    found: list[Samples] = []

    def complete() -> bool:
        found.append(scrape(scheduler.metrics_url))
        return total(found[-1], FINISHED) == total(found[-1], SCHEDULED)

    wait_until(complete, "a scrape with every frontend's metrics")
    return found[-1]


def test_metrics_of_every_frontend_add_up_to_what_clients_received() -> None:
    with serving_pair(SIM, frontend_flags(2)) as (_, scheduler):
        asyncio.run(wait_frontends_serving(scheduler.address, 2))

        async def scenario() -> tuple[Samples, int]:
            groups = await channels_by_frontend(scheduler.address, 2, per_frontend=2)
            before = await asyncio.to_thread(scrape_with_every_frontend, scheduler)
            channels = [c for group in groups.values() for c in group]
            got = await asyncio.gather(
                *(tokens_of(c, request(f"m{i}", 20 + i)) for i, c in enumerate(channels))
            )
            return before, sum(map(len, got))

        before, received = asyncio.run(scenario())
        after = scrape_with_every_frontend(scheduler)

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
        "import sys; import scheduler_svc.engine.core, scheduler_svc.process.app; "
        "import scheduler_svc.process.frontend_process; "
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('worker_svc')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=CALL_TIMEOUT_S)


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
        out = subprocess.run(argv, capture_output=True, text=True, timeout=START_TIMEOUT_S)
    assert out.returncode != 0
    assert flag in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_requests_arriving_during_a_worker_outage_wait_for_the_next_worker() -> None:
    port = unused_port()
    worker = spawn_worker(SIM, port=port)
    scheduler = None
    try:
        # A hang guard: the next worker comes in seconds.
        flags = ["--worker-retry-timeout", "600", "--http-port", str(unused_port()), *frontend_flags(2)]
        scheduler = spawn_scheduler(worker.address, flags)
        wait_serving(scheduler.address)
        asyncio.run(wait_frontends_serving(scheduler.address, 2))  # each knows the model
        worker.proc.kill()
        worker.proc.wait(STOP_TIMEOUT_S)

        async def during_outage() -> tuple[list[list[int]], list[httpx2.Response]]:
            nonlocal worker
            assert scheduler is not None
            await wait_info(scheduler.address, lambda i: not i.worker_connected, "the worker lost")
            url = f"{scheduler.http_url}/v1/completions"
            bodies = [
                {"prompt": f"h{i}", "max_tokens": 10, "ignore_eos": True, "stream": i == 1} for i in range(2)
            ]
            async with (
                grpc.aio.insecure_channel(scheduler.address) as channel,
                httpx2.AsyncClient(timeout=CALL_TIMEOUT_S) as http,
            ):
                calls = [asyncio.create_task(tokens_of(channel, request(f"o{i}", 10))) for i in range(5)]
                posts = [asyncio.create_task(http.post(url, json=body)) for body in bodies]
                # They arrived while no worker is connected (none can come before the next line):
                await wait_info(scheduler.address, lambda i: i.requests_waiting == 7, "7 waiting")
                worker = await asyncio.to_thread(spawn_worker, SIM, port)
                return await asyncio.gather(*calls), await asyncio.gather(*posts)

        grpc_tokens, http_responses = asyncio.run(during_outage())
        assert grpc_tokens == [sim_expected(f"o{i}".encode(), 10) for i in range(5)]
        # HTTP requests wait for the next worker as gRPC ones do (not a 503):
        whole, streamed = http_responses
        assert whole.status_code == 200 and whole.json()["usage"]["completion_tokens"] == 10, whole.text
        assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n"), streamed.text
        assert '"finish_reason": "length"' in streamed.text or '"finish_reason":"length"' in streamed.text
    finally:
        for service in (scheduler, worker):
            if service is not None and service.proc.poll() is None:
                service.stop()
