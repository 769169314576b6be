"""The worker engine and its FutureMap: order, sentinel, slot deltas."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import pytest
import torch

from stepahead.protocol import Launch, NewRequest
from tests.harness import make_engine
from worker_svc.backends import sim_next_token
from worker_svc.engine import EngineStats, LaunchError, SessionEnded, WorkerEngine
from worker_svc.future_map import SENTINEL, FutureMap, FutureMapSentinelError

CPU = torch.device("cpu")


def test_future_map_starts_unwritten_and_reading_the_sentinel_is_an_error() -> None:
    fmap = FutureMap(8, CPU, check_sentinel=True)
    fmap.store(torch.tensor([2, 5]), torch.tensor([11, 12]))
    assert fmap.read(torch.tensor([5, 2])).tolist() == [12, 11]
    with pytest.raises(FutureMapSentinelError):
        fmap.read(torch.tensor([2, 3]))
    assert fmap.sentinel_reads == 1
    fmap.reset(torch.tensor([2]))
    with pytest.raises(FutureMapSentinelError):
        fmap.read(torch.tensor([2]))
    unchecked = FutureMap(4, CPU, check_sentinel=False)
    assert unchecked.read(torch.tensor([0])).tolist() == [SENTINEL]


def new(slot: int) -> NewRequest:
    return NewRequest(slot, 0.0, 1.0, 0, 0)


def prefill(step: int, slot: int, ids: list[int], kv: list[int], **kw: object) -> Launch:
    return Launch(
        step,
        row_req_slots=[slot],
        row_start_pos=[0],
        row_num_tokens=[len(ids)],
        row_from_future=[False],
        row_sample=[True],
        prompt_ids=ids,
        kv_slots=kv,
        **kw,  # type: ignore[arg-type]
    )


def decode(step: int, slots: list[int], positions: list[int], kv: list[int]) -> Launch:
    n = len(slots)
    return Launch(
        step,
        row_req_slots=slots,
        row_start_pos=positions,
        row_num_tokens=[1] * n,
        row_from_future=[True] * n,
        row_sample=[True] * n,
        kv_slots=kv,
    )


@pytest.fixture
def engine() -> Iterator[WorkerEngine]:
    e = make_engine("sim", kv_slots=64, request_slots=4, sim_step_ms=0.0)
    e.begin_session().result()
    yield e
    e.shutdown()


def test_decode_reads_the_token_the_previous_batch_stored(engine: WorkerEngine) -> None:
    # Both launches are queued before either result is read: the decode's
    # input exists only on the device, in the FutureMap.
    first = engine.submit(prefill(1, 0, [72, 105], [0, 1], new_requests=[new(0)]))
    second = engine.submit(decode(2, [0], [2], [2]))
    t1 = first.result().token_ids
    t2 = second.result().token_ids
    assert t1 == [sim_next_token(105, 2)]
    assert t2 == [sim_next_token(t1[0], 3)]
    assert engine.stats().steps_executed == 2


def test_a_decode_before_any_sample_reads_the_sentinel_and_fails(engine: WorkerEngine) -> None:
    engine.submit(Launch(1, new_requests=[new(1)])).result()
    with pytest.raises(FutureMapSentinelError):
        engine.submit(decode(2, [1], [0], [0])).result()
    assert engine.stats().sentinel_reads == 1


def test_a_released_slot_is_unwritten_again(engine: WorkerEngine) -> None:
    engine.submit(prefill(1, 0, [1], [0], new_requests=[new(0)])).result()
    engine.submit(Launch(2, released_slots=[0], new_requests=[new(0)])).result()
    with pytest.raises(FutureMapSentinelError):
        engine.submit(decode(3, [0], [1], [1])).result()


def test_out_of_order_launch_is_refused(engine: WorkerEngine) -> None:
    with pytest.raises(LaunchError, match="step 2 launched after step 0"):
        engine.submit(Launch(2)).result()
    assert engine.stats().out_of_order_launches == 1


@pytest.mark.parametrize(
    ("launch", "message"),
    [
        (prefill(1, 0, [1], [64], new_requests=[new(0)]), r"kv_slots\[0\]: 64 is outside the KV pool"),
        (prefill(1, 3, [1], [0]), r"row_req_slots\[0\]: request slot 3 is not registered"),
        (prefill(1, 0, [1, 2], [0], new_requests=[new(0)]), "kv_slots: 1 slots for 2 tokens"),
        (prefill(1, 0, [999], [0], new_requests=[new(0)]), r"prompt_ids\[0\]: 999 is outside the vocab"),
    ],
)
def test_malformed_launches_are_refused(engine: WorkerEngine, launch: Launch, message: str) -> None:
    with pytest.raises(LaunchError, match=message):
        engine.submit(launch).result()
    assert engine.stats().steps_executed == 0


def test_live_request_slots_follow_registrations_and_releases(engine: WorkerEngine) -> None:
    engine.submit(Launch(1, new_requests=[new(0), new(2)])).result()
    assert engine.stats().live_request_slots == 2
    engine.submit(Launch(2, released_slots=[0, 2])).result()
    assert engine.stats().live_request_slots == 0
    epoch = engine.stats().epoch
    assert engine.begin_session().result().epoch == epoch + 1
    assert engine.stats().last_step_id == 0


def test_a_new_session_starts_its_counters_at_zero(engine: WorkerEngine) -> None:
    engine.submit(Launch(1, new_requests=[new(1)])).result()
    with pytest.raises(FutureMapSentinelError):
        engine.submit(decode(2, [1], [0], [0])).result()
    with pytest.raises(LaunchError, match="step 5 launched after step 2"):
        engine.submit(Launch(5)).result()
    before = engine.stats()
    assert (before.steps_executed, before.last_step_id) == (2, 2)
    assert (before.sentinel_reads, before.out_of_order_launches, before.live_request_slots) == (1, 1, 1)
    engine.begin_session().result()
    assert engine.stats() == EngineStats(before.epoch + 1, 0, 0, 0, 0, 0)


@contextlib.contextmanager
def forward_thread_busy(engine: WorkerEngine) -> Iterator[None]:
    """The forward thread held (as by a long step of the session before) until the block ends:
    what is submitted meanwhile is queued, whatever the machine's speed."""
    gate = threading.Event()
    engine._forward_thread.submit(gate.wait)
    try:
        yield
    finally:
        gate.set()


def test_launches_queued_when_a_new_session_begins_are_dropped_unrun(engine: WorkerEngine) -> None:
    with forward_thread_busy(engine):
        stale = [engine.submit(Launch(9)), engine.submit(decode(1, [0], [0], [0]))]
        begun = engine.begin_session()
    begun.result()
    for future in stale:
        with pytest.raises(SessionEnded):
            future.result()
    engine.submit(Launch(1, new_requests=[new(0)])).result()
    stats = engine.stats()
    assert (stats.out_of_order_launches, stats.sentinel_reads, stats.steps_executed) == (0, 0, 1)


def test_an_ended_session_s_queued_launches_are_dropped_and_its_ticket_ends_nothing_later(
    engine: WorkerEngine,
) -> None:
    ticket = engine.session_ticket
    with forward_thread_busy(engine):
        queued = engine.submit(Launch(1, new_requests=[new(0)]), ticket)
        engine.end_session(ticket)
    with pytest.raises(SessionEnded):
        queued.result()
    engine.begin_session().result()
    engine.end_session(ticket)  # the old session's end, heard late: the new one is not ended
    engine.submit(Launch(1, new_requests=[new(0)]), engine.session_ticket).result()
    assert engine.stats().steps_executed == 1
