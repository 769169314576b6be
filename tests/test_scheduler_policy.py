"""Batching policy, slot accounting and the overlap handoff, against a fake worker."""

from __future__ import annotations

import asyncio

import pytest

from scheduler_svc.contract import FinishReason, Mode
from scheduler_svc.engine.core import CoreConfig, EngineCore
from scheduler_svc.engine.policy import PolicyConfig
from scheduler_svc.frontend.frontend import Frontend, FrontendConfig
from scheduler_svc.frontend.streams import Completions
from scheduler_svc.process.link.local import LocalCore
from tests.fake_worker import FakeWorker
from tests.harness import Served, WorkItem, consume, params, run_workload, wait_drained
from worker_svc.backends import sim_continuation as expected

pytestmark = pytest.mark.anyio


def linked(worker: FakeWorker, mode: Mode = "overlap", budget: int = 128) -> tuple[EngineCore, Frontend]:
    config = CoreConfig(mode=mode, policy=PolicyConfig(max_batch_tokens=budget))
    core = EngineCore(worker, config)
    frontend = Frontend(FrontendConfig(mode))
    LocalCore(core, frontend)
    return core, frontend


async def connected(
    worker: FakeWorker, mode: Mode = "overlap", budget: int = 128
) -> tuple[EngineCore, Frontend]:
    core, frontend = linked(worker, mode, budget)
    assert core._start_session(await worker.connect())
    return core, frontend


def add(frontend: Frontend, rid: str, prompt: list[int], max_new: int) -> Completions:
    return frontend.submit(rid, prompt, params(max_new, ignore_eos=True))


async def test_long_prompt_is_prefilled_in_chunks_under_the_budget() -> None:
    worker = FakeWorker(4096, 8)
    core, frontend = await connected(worker, budget=128)
    add(frontend, "long", [65] * 300, 4)
    chunks = []
    for _ in range(3):
        batch = core.pick_batch()
        assert batch is not None
        chunks.append((batch.launch.row_num_tokens, batch.launch.row_sample, batch.launch.row_start_pos))
        await core.process_results(batch, await core.launch_step(batch))
    assert chunks == [([128], [False], [0]), ([128], [False], [128]), ([44], [True], [256])]


async def test_decodes_and_new_prefills_share_a_step_in_arrival_order() -> None:
    worker = FakeWorker(4096, 8)
    core, frontend = await connected(worker, budget=64)
    add(frontend, "a", [1, 2, 3], 8)
    first = core.pick_batch()
    assert first is not None and first.forward_mode == "prefill"
    add(frontend, "b", [4] * 100, 8)
    second = core.pick_batch()
    assert second is not None and second.forward_mode == "mixed"
    launch = second.launch
    assert launch.row_from_future == [True, False]  # a's decode reads the FutureMap
    assert launch.row_num_tokens == [1, 63]  # b gets the rest of the budget
    assert [r.req_slot for r in launch.new_requests] == [launch.row_req_slots[1]]


async def test_a_request_whose_inflight_tokens_reach_max_new_tokens_is_not_scheduled() -> None:
    worker = FakeWorker(4096, 8, hold=True)
    core, frontend = await connected(worker)
    add(frontend, "one", [7, 8], 1)
    add(frontend, "two", [9], 2)
    batch1 = core.pick_batch()
    assert batch1 is not None
    h1 = await core.launch_step(batch1)
    batch2 = core.pick_batch()  # "one" has its only token in flight
    assert batch2 is not None
    assert batch2.launch.row_req_slots == [core.policy.requests["two", 0].req_slot]
    h2 = await core.launch_step(batch2)
    assert core.pick_batch() is None  # "two" too now has both tokens in flight
    worker.complete_next()
    worker.complete_next()
    await core.process_results(batch1, h1)
    await core.process_results(batch2, h2)
    assert not core.policy.requests and core.stats.dropped_inflight_tokens == 0


async def test_a_finish_while_the_next_batch_is_in_flight_drops_its_extra_token() -> None:
    worker = FakeWorker(4096, 8, hold=True)
    core, frontend = await connected(worker)
    prompt = [72, 105]
    stop_token = expected(prompt, 1)[0]
    client = frontend.submit("s", prompt, params(16, stop_token_ids=frozenset({stop_token})))
    req = core.policy.requests["s", 0]
    b1 = core.pick_batch()
    assert b1 is not None
    h1 = await core.launch_step(b1)
    b2 = core.pick_batch()  # overlap: launched before b1's token is seen
    assert b2 is not None
    h2 = await core.launch_step(b2)
    worker.complete_next()
    await core.process_results(b1, h1)
    assert req.finish_reason == FinishReason.STOP
    assert (
        core.policy.kv.reclaimable == core.policy.kv.capacity and core.policy.req_slots.num_used == 0
    )  # freed with b2 in flight
    worker.complete_next()
    await core.process_results(b2, h2)
    assert core.stats.dropped_inflight_tokens == 1
    [(_, chunk)] = client.take()
    assert chunk.token_ids == [stop_token] and chunk.finish_reason == FinishReason.STOP


async def test_abort_frees_slots_at_once_and_the_slot_is_released_on_the_worker() -> None:
    worker = FakeWorker(4096, 8, hold=True)
    core, frontend = await connected(worker)
    add(frontend, "x", [1] * 10, 50)
    b1 = core.pick_batch()
    assert b1 is not None
    h1 = await core.launch_step(b1)
    slot = core.policy.requests["x", 0].req_slot
    assert core.abort("x")
    assert core.policy.kv.reclaimable == core.policy.kv.capacity and core.policy.req_slots.num_used == 0
    add(frontend, "y", [2] * 5, 3)
    b2 = core.pick_batch()
    assert b2 is not None
    assert b2.launch.row_req_slots == [slot]  # reused: the worker runs b2 after b1
    await core.launch_step(b2)
    assert worker.launches[-1].released_slots == [slot]
    worker.complete_next()
    await core.process_results(b1, h1)
    assert core.stats.dropped_inflight_tokens == 1


@pytest.mark.parametrize("mode", ["serial", "overlap"])
async def test_kv_exhaustion_preempts_and_recomputes_to_the_same_tokens(mode: Mode) -> None:
    worker = FakeWorker(kv_slots=160, request_slots=8)
    core, frontend = linked(worker, mode, budget=64)
    picks_with_queue: list[int] = []
    pick = core.pick_batch

    def recording_pick():  # type: ignore[no-untyped-def]
        picks_with_queue.append(len(core.result_queue))
        return pick()

    core.pick_batch = recording_pick  # type: ignore[method-assign]
    task = asyncio.create_task(core.run())
    while not frontend.ready:
        await asyncio.sleep(0.001)
    prompts = [[40 + i] * (20 + 7 * i) for i in range(6)]
    items = [WorkItem(f"p{i}", p, params(60, ignore_eos=True), 0.0) for i, p in enumerate(prompts)]
    views = await run_workload(Served(core, frontend), items)
    await wait_drained(core)
    await core.close()
    task.cancel()
    assert core.stats.preemptions > 0
    for item in items:
        assert views[item.rid].token_ids == expected(item.prompt_ids, 60)
    assert core.policy.kv.reclaimable == core.policy.kv.capacity and not worker.live_slots
    assert max(picks_with_queue) <= 1  # result_queue never holds two entries at a pick


async def test_waiting_requests_are_admitted_first_come_first_served() -> None:
    worker = FakeWorker(kv_slots=100, request_slots=8)
    core, frontend = await connected(worker, budget=200)
    add(frontend, "first", [1] * 60, 5)
    add(frontend, "second", [2] * 60, 5)
    add(frontend, "small", [3] * 5, 5)
    batch = core.pick_batch()
    assert batch is not None
    # "small" would fit beside "first" only by jumping the queue: it waits.
    assert [r.rid for r in core.policy.running] == ["first"]
    assert [r.rid for r in core.policy.waiting] == ["second", "small"]


async def test_streams_coalesce_tokens_for_a_lagging_client() -> None:
    worker = FakeWorker(4096, 8)
    core, frontend = await connected(worker)
    client = add(frontend, "lag", [5, 6], 6)
    for _ in range(6):
        batch = core.pick_batch()
        assert batch is not None
        await core.process_results(batch, await core.launch_step(batch))
    [view] = await consume(Served(core, frontend), client, None)  # the client reads only now
    assert view.messages == 1
    assert view.token_ids == expected([5, 6], 6) and view.finish_reason == FinishReason.LENGTH
