"""A request registered with a cached prefix (`NewRequest.prefix_kv_slots`) reads the KV slots
an earlier request computed for those positions, and continues exactly as if it had computed
them itself; bad prefixes are refused before anything is written."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from stepahead.protocol import Launch, LogitsProcessing, NewRequest
from tests.harness import make_engine
from worker_svc.engine import LaunchError, WorkerEngine

SHARED = [72, 101, 108, 108, 111, 44, 32, 119]  # a prefix both prompts start with
FIRST = [*SHARED, 111, 114, 108, 100]
SECOND = [*SHARED, 97, 118, 101]
DECODES = 6


def tiny() -> WorkerEngine:
    engine = make_engine("tiny", kv_slots=256, request_slots=4, dtype=torch.float64)
    engine.begin_session().result()
    return engine


@pytest.fixture
def engine() -> Iterator[WorkerEngine]:
    e = tiny()
    yield e
    e.shutdown()


def prefill(step: int, slot: int, ids: list[int], start: int, kv: list[int], new: NewRequest) -> Launch:
    return Launch(
        step,
        new_requests=[new],
        row_req_slots=[slot],
        row_start_pos=[start],
        row_num_tokens=[len(ids)],
        row_from_future=[False],
        row_sample=[True],
        prompt_ids=ids,
        kv_slots=kv,
    )


def decode(step: int, slot: int, position: int, kv: int) -> Launch:
    return Launch(step, [], [], [slot], [position], [1], [True], [True], [], [kv])


def greedy(slot: int, prefix: tuple[int, ...] = ()) -> NewRequest:
    """Greedy, with the log-probabilities: they show any difference in the KV read."""
    logprobs = LogitsProcessing(prompt_len=len(SHARED), logprobs=True)
    return NewRequest(slot, 0.0, 1.0, 0, 0, logprobs, prefix_kv_slots=prefix)


def generate(
    engine: WorkerEngine, step: int, first: Launch, slot: int, kv_from: int
) -> list[tuple[int, float]]:
    """`first` (a prefill), then DECODES decodes launched one step ahead: each sampled id and
    its log-probability."""
    position = first.row_start_pos[0] + first.row_num_tokens[0]
    launches = [first] + [decode(step + 1 + i, slot, position + i, kv_from + i) for i in range(DECODES)]
    results = [engine.submit(launch).result(timeout=60) for launch in launches]
    return [(r.token_ids[0], r.logprobs.chosen[0]) for r in results if r.logprobs is not None]


def test_a_cached_prefix_gives_the_tokens_of_a_full_prefill(engine: WorkerEngine) -> None:
    # The first request computes FIRST into KV slots 0..; the second reuses the shared part.
    generate(engine, 1, prefill(1, 0, FIRST, 0, list(range(len(FIRST))), greedy(0)), 0, 100)
    cached = tuple(range(len(SHARED)))
    rest = SECOND[len(SHARED) :]
    own = list(range(40, 40 + len(rest)))
    step = 2 + DECODES
    reused = generate(engine, step, prefill(step, 1, rest, len(SHARED), own, greedy(1, cached)), 1, 200)
    fresh = tiny()
    try:
        full = prefill(1, 0, SECOND, 0, list(range(len(SECOND))), greedy(0))
        expected = generate(fresh, 1, full, 0, 100)
        assert [t for t, _ in reused] == [t for t, _ in expected]
        assert [lp for _, lp in reused] == pytest.approx([lp for _, lp in expected], abs=1e-9)
        assert len(reused) == DECODES + 1
    finally:
        fresh.shutdown()


def test_without_the_prefix_slots_the_same_rows_read_other_kv(engine: WorkerEngine) -> None:
    """The check above can fail: rows that start after a prefix the worker was not told about
    read whatever its slot table held."""
    generate(engine, 1, prefill(1, 0, FIRST, 0, list(range(len(FIRST))), greedy(0)), 0, 100)
    rest = SECOND[len(SHARED) :]
    step = 2 + DECODES
    launch = prefill(step, 1, rest, len(SHARED), list(range(40, 40 + len(rest))), greedy(1))
    unmapped = generate(engine, step, launch, 1, 200)
    fresh = tiny()
    try:
        expected = generate(fresh, 1, prefill(1, 0, SECOND, 0, list(range(11)), greedy(0)), 0, 100)
        assert [lp for _, lp in unmapped] != pytest.approx([lp for _, lp in expected], abs=1e-6)
    finally:
        fresh.shutdown()


@pytest.mark.parametrize(
    ("prefix", "message"),
    [
        ((0, 1, 256), r"new_requests\[0\]\.prefix_kv_slots\[2\]: 256"),
        (tuple(range(2048)), r"new_requests\[0\]\.prefix_kv_slots: 2048 is outside \[0, 2047\]"),
    ],
)
def test_a_bad_prefix_is_refused_naming_the_field(
    engine: WorkerEngine, prefix: tuple[int, ...], message: str
) -> None:
    with pytest.raises(LaunchError, match=message):
        engine.submit(prefill(1, 0, [65], 0, [5], greedy(0, prefix))).result(timeout=60)
    assert engine.stats().live_request_slots == 0
