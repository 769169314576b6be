"""The quarantine (`scheduler_svc/engine/quarantine.py`): a request whose rows make every step fail
(a poison request, `tests/poison.py`) ends alone with INTERNAL, and every other request completes
with the tokens of an undisturbed run; a step that fails once costs no request.

In process, on the sim worker engine behind the in-process transport, which fails a step's
future with `WorkerStepError` as the wire does. The services' test is in `test_faults.py`."""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest

from scheduler_svc.engine.batch import ScheduledBatch
from scheduler_svc.engine.core import CoreConfig, EngineCore
from scheduler_svc.engine.policy import PolicyConfig
from scheduler_svc.engine.quarantine import FAILURES_ALONE
from scheduler_svc.frontend.frontend import Frontend
from scheduler_svc.frontend.streams import Completions
from stepahead.protocol import Launch
from tests.harness import Served, make_engine, params, start_core, wait_drained
from tests.poison import PoisonRows, poison, poison_seed
from worker_svc.backends import sim_continuation
from worker_svc.engine import WorkerEngine, _Ran
from worker_svc.inprocess import InProcessTransport

pytestmark = pytest.mark.anyio

GUARD_S = 60.0  # a hang guard: each workload here takes under a second
PROMPT = 8  # prompt tokens of every request here
TOKENS = 24  # tokens each asks for


def prompt(i: int) -> list[int]:
    return [40 + (i * 7 + j) % 80 for j in range(PROMPT)]


async def read(call: Completions) -> tuple[list[list[int]], tuple[grpc.StatusCode, str] | None]:
    """Each completion's tokens, and the call's error."""
    tokens: list[list[int]] = [[] for _ in call.clients]
    while not call.done:
        await call.ready.wait()
        for index, chunk in call.take():
            tokens[index].extend(chunk.token_ids)
        if call.error is not None:
            return tokens, call.error
    return tokens, None


async def serve(
    engine: WorkerEngine, calls: list[tuple[str, list[int], int, int]], *, mode: str = "overlap"
) -> tuple[dict[str, tuple[list[list[int]], tuple[grpc.StatusCode, str] | None]], EngineCore]:
    """Serve (rid, prompt, seed, n) calls submitted together; each call's tokens and error."""
    config = CoreConfig(mode=mode, policy=PolicyConfig(max_batch_tokens=256), worker_retry_timeout_s=600)  # type: ignore[arg-type]
    served, task = await start_core(InProcessTransport(engine), config)
    try:
        async with asyncio.timeout(GUARD_S):
            submitted = [
                (rid, served.frontend.submit(rid, ids, params(TOKENS, ignore_eos=True, seed=seed), n))
                for rid, ids, seed, n in calls
            ]
            got = {rid: await read(call) for rid, call in submitted}
            await wait_drained(served.core)
    finally:
        await served.core.close()
        task.cancel()
    assert_all_free(served)
    return got, served.core


def assert_all_free(served: Served) -> None:
    policy = served.core.policy
    assert not policy.requests and not policy.quarantine.parked and not policy.quarantine.active
    assert policy.req_slots.num_free == policy.req_slots.capacity


@pytest.mark.parametrize("mode", ["overlap", "serial"])
@pytest.mark.parametrize("where", [0, PROMPT + 3])  # in its first prefill; at its fourth token
async def test_a_poison_request_ends_alone_and_the_others_complete(mode: str, where: int) -> None:
    engine = make_engine("sim", kv_slots=4096, request_slots=16, sim_step_ms=0.0)
    rows = poison(engine)
    try:
        calls = [(f"r{i}", prompt(i), poison_seed(where) if i == 5 else i, 1) for i in range(12)]
        got, core = await serve(engine, calls, mode=mode)
    finally:
        engine.shutdown()
    tokens, error = got.pop("r5")
    assert error is not None and error[0] == grpc.StatusCode.INTERNAL, error
    assert "the worker failed every step of this request alone" in error[1] and "poisoned row" in error[1]
    # It had the tokens of the positions up to `where` (the row computing `where` samples the next).
    assert tokens[0] == sim_continuation(prompt(5), TOKENS)[: max(where - PROMPT + 1, 0)]
    for rid, (tokens, error) in got.items():
        assert error is None, (rid, error)
        assert tokens == [sim_continuation(prompt(int(rid[1:])), TOKENS)], rid
    stats = core.stats
    assert stats.poison_requests == 1
    # One failure names all 12 (they decode together); then halving, and the failures alone. (The
    # worker may fail more: a step launched behind a failed one runs in process, unprocessed.)
    assert FAILURES_ALONE <= stats.step_failures <= math.ceil(math.log2(12)) + 2
    assert rows.failed_steps >= stats.step_failures


async def test_every_completion_of_a_poison_call_ends_and_its_error_reaches_the_client() -> None:
    engine = make_engine("sim", kv_slots=4096, request_slots=16, sim_step_ms=0.0)
    poison(engine)
    try:
        calls = [("a", prompt(1), 1, 1), ("p", prompt(2), poison_seed(PROMPT + 1), 3), ("b", prompt(3), 3, 2)]
        got, core = await serve(engine, calls)
    finally:
        engine.shutdown()
    assert got["p"][1] is not None and got["p"][1][0] == grpc.StatusCode.INTERNAL
    assert got["a"] == ([sim_continuation(prompt(1), TOKENS)], None)
    assert got["b"] == ([sim_continuation(prompt(3), TOKENS)] * 2, None)
    assert core.stats.poison_requests == 1  # the call's other completions went with it


@pytest.mark.parametrize("live", [1, 6])
async def test_a_step_that_fails_once_costs_no_request(live: int) -> None:
    """A transient fault (one failed step, of one request or several): every request is
    recomputed and completes."""
    engine = make_engine("sim", kv_slots=4096, request_slots=16, sim_step_ms=0.0)
    run, steps = engine._run, [0]

    def failing_once(launch: Launch) -> _Ran:
        if launch.num_rows:
            steps[0] += 1
            if steps[0] == 6:
                raise RuntimeError("a transient fault")
        return run(launch)

    engine._run = failing_once  # type: ignore[method-assign]
    try:
        got, core = await serve(engine, [(f"r{i}", prompt(i), i, 1) for i in range(live)])
    finally:
        engine.shutdown()
    assert all(got[f"r{i}"] == ([sim_continuation(prompt(i), TOKENS)], None) for i in range(live))
    assert (core.stats.step_failures, core.stats.poison_requests) == (1, 0)


async def test_requests_that_arrive_during_the_quarantine_wait_and_complete() -> None:
    """A request that arrives as the quarantine starts (forced: submitted right after the first
    failure is handled) is parked, counted as waiting, then served."""
    engine = make_engine("sim", kv_slots=4096, request_slots=16, sim_step_ms=0.0)
    rows: PoisonRows = poison(engine)
    config = CoreConfig(policy=PolicyConfig(max_batch_tokens=256), worker_retry_timeout_s=600)
    late: list[Completions] = []
    parked: set[str] = set()
    waiting_seen: list[int] = []

    def instrument(core: EngineCore) -> None:
        policy = core.policy
        step_failed, hold_back = policy.step_failed, policy.quarantine.hold_back

        def failed_then_arrive(batch: ScheduledBatch, why: str) -> None:
            step_failed(batch, why)
            if not late:
                late.append(
                    served_frontend[0].submit("late", prompt(9), params(TOKENS, ignore_eos=True, seed=9))
                )

        def recording() -> None:
            hold_back()
            parked.update(r.rid for r in policy.quarantine.parked)
            waiting_seen.append(policy.occupancy().waiting)

        policy.step_failed = failed_then_arrive  # type: ignore[method-assign]
        policy.quarantine.hold_back = recording  # type: ignore[method-assign]

    served_frontend: list[Frontend] = []
    served, task = await start_core(InProcessTransport(engine), config, instrument)
    served_frontend.append(served.frontend)
    try:
        async with asyncio.timeout(GUARD_S):
            first = [
                served.frontend.submit(f"r{i}", prompt(i), params(TOKENS, ignore_eos=True, seed=s), 1)
                for i, s in enumerate([0, 1, poison_seed(PROMPT + 2), 3])
            ]
            results = [await read(call) for call in first]
            results.append(await read(late[0]))
            await wait_drained(served.core)
    finally:
        await served.core.close()
        task.cancel()
        engine.shutdown()
    assert "late" in parked and max(waiting_seen) >= 2  # parked: the late one and a suspect
    assert [error is None for _, error in results] == [True, True, False, True, True]
    for i, (tokens, _) in zip([0, 1, 3, 9], [results[k] for k in (0, 1, 3, 4)], strict=True):
        assert tokens == [sim_continuation(prompt(i), TOKENS)]
    assert rows.failed_steps >= FAILURES_ALONE
    assert_all_free(served)
