"""Launch checks: each malformed launch is refused naming its field, before any work."""

from __future__ import annotations

import contextlib
import gc
import math
import os
import resource
from collections.abc import Iterator
from dataclasses import replace

import pytest

from stepahead.protocol import (
    MAX_CONSTRAINT_BYTES,
    MAX_THINKING_HEADER_BYTES,
    Constraint,
    GrammarConstraint,
    Launch,
    LogitsProcessing,
    NewRequest,
    launch_from_proto,
    launch_to_proto,
)
from stepahead.v1 import worker_pb2
from tests.harness import make_engine
from worker_svc.engine import LaunchError, WorkerEngine
from worker_svc.launch_check import DEFAULT_MAX_BATCH_TOKENS, LaunchLimits, check_launch, step_budget

LIMITS = LaunchLimits(kv_slots=64, request_slots=4, max_context_len=32, vocab_size=256, max_batch_tokens=16)
MB = 2**20


def req(
    slot: int, temperature: float = 0.7, top_p: float = 0.9, top_k: int = 40, seed: int = 1
) -> NewRequest:
    return NewRequest(slot, temperature, top_p, top_k, seed)


def valid(**changes: object) -> Launch:
    """A 3-token prefill of slot 0 (registered here) and a decode of slot 1."""
    base = Launch(
        7,
        released_slots=[2],
        new_requests=[req(0)],
        row_req_slots=[0, 1],
        row_start_pos=[0, 5],
        row_num_tokens=[3, 1],
        row_from_future=[False, True],
        row_sample=[True, True],
        prompt_ids=[10, 20, 30],
        kv_slots=[4, 5, 6, 7],
    )
    return replace(base, **changes)  # type: ignore[arg-type]


NAN, INF = math.nan, math.inf
BAD_LAUNCHES: list[tuple[str, dict[str, object], str]] = [
    ("short row column", {"row_sample": [True]}, r"row_sample: 1 entries for 2 rows"),
    ("long row column", {"row_start_pos": [0, 5, 9]}, r"row_start_pos: 3 entries for 2 rows"),
    ("empty row", {"row_num_tokens": [0, 1], "prompt_ids": [], "kv_slots": [7]}, r"row_num_tokens\[0\]: 0"),
    (
        "row over budget",
        {"row_num_tokens": [10_000_000, 1]},
        r"row_num_tokens\[0\]: 10000000 tokens exceed the step budget of 16",
    ),
    ("row of 2**31 tokens", {"row_num_tokens": [1, 2**31]}, r"row_num_tokens\[1\]: 2147483648 tokens"),
    (
        "launch over budget",
        {"row_num_tokens": [16, 1], "prompt_ids": [1] * 16, "kv_slots": list(range(17))},
        r"row_num_tokens: 17 tokens in all exceed the step budget of 16",
    ),
    (
        "decode row of 2 tokens",
        {"row_num_tokens": [3, 2], "kv_slots": [4, 5, 6, 7, 8]},
        r"row_num_tokens\[1\]: 2 tokens in a row_from_future row",
    ),
    ("too few kv slots", {"kv_slots": [4, 5, 6]}, r"kv_slots: 3 slots for 4 tokens"),
    ("too many kv slots", {"kv_slots": [4, 5, 6, 7, 8]}, r"kv_slots: 5 slots for 4 tokens"),
    ("too few prompt ids", {"prompt_ids": [10, 20]}, r"prompt_ids: 2 ids for 3 tokens"),
    ("ids for a decode row", {"prompt_ids": [10, 20, 30, 40]}, r"prompt_ids: 4 ids for 3 tokens"),
    ("id past the vocabulary", {"prompt_ids": [10, 256, 30]}, r"prompt_ids\[1\]: 256 is outside the vocab"),
    ("negative id", {"prompt_ids": [-1, 20, 30]}, r"prompt_ids\[0\]: -1 is outside the vocabulary"),
    ("negative start", {"row_start_pos": [-1, 5]}, r"row_start_pos\[0\]: -1 is negative"),
    (
        "decode past the context",
        {"row_start_pos": [0, 32]},
        r"row_start_pos\[1\]: positions 32..32 exceed the context length of 32",
    ),
    ("prefill across the end", {"row_start_pos": [30, 5]}, r"row_start_pos\[0\]: positions 30..32"),
    ("start at 2**31", {"row_start_pos": [2**31, 5]}, r"row_start_pos\[0\]: positions 2147483648"),
    ("row slot past the table", {"row_req_slots": [0, 4]}, r"row_req_slots\[1\]: 4 is outside the request"),
    (
        "kv slot past the pool",
        {"kv_slots": [4, 5, 6, 64]},
        r"kv_slots\[3\]: 64 is outside the KV pool \[0, 64\)",
    ),
    ("negative kv slot", {"kv_slots": [4, -5, 6, 7]}, r"kv_slots\[1\]: -5 is outside the KV pool"),
    ("released slot past the table", {"released_slots": [9]}, r"released_slots\[0\]: 9 is outside"),
    ("slot released twice", {"released_slots": [2, 3, 2]}, r"released_slots\[2\]: slot 2 appears twice"),
    ("new slot past the table", {"new_requests": [req(4)]}, r"new_requests\[0\]\.req_slot: 4 is outside"),
    (
        "slot registered twice",
        {"new_requests": [req(0), req(3), req(0)]},
        r"new_requests\[2\]\.req_slot: slot 0 appears twice",
    ),
    ("NaN temperature", {"new_requests": [req(0, temperature=NAN)]}, r"new_requests\[0\]\.temperature"),
    ("inf temperature", {"new_requests": [req(0, temperature=INF)]}, r"new_requests\[0\]\.temperature"),
    ("-inf temperature", {"new_requests": [req(0, temperature=-INF)]}, r"new_requests\[0\]\.temperature"),
    (
        "negative temperature",
        {"new_requests": [req(0, temperature=-0.5)]},
        r"new_requests\[0\]\.temperature: must",
    ),
    ("NaN top_p", {"new_requests": [req(0), req(3, top_p=NAN)]}, r"new_requests\[1\]\.top_p: must be in"),
    ("inf top_p", {"new_requests": [req(0, top_p=INF)]}, r"new_requests\[0\]\.top_p"),
    ("zero top_p", {"new_requests": [req(0, top_p=0.0)]}, r"new_requests\[0\]\.top_p"),
    ("top_p above 1", {"new_requests": [req(0, top_p=1.5)]}, r"new_requests\[0\]\.top_p"),
    ("negative top_k", {"new_requests": [req(0, top_k=-1)]}, r"new_requests\[0\]\.top_k: must be >= 0"),
]


@pytest.mark.parametrize(
    ("changes", "message"), [c[1:] for c in BAD_LAUNCHES], ids=[c[0] for c in BAD_LAUNCHES]
)
def test_a_malformed_launch_is_refused_naming_its_field(changes: dict[str, object], message: str) -> None:
    with pytest.raises(LaunchError, match=f"^{message}"):
        check_launch(valid(**changes), LIMITS)


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"new_requests": [req(0, temperature=0.0, top_p=1.0, top_k=0, seed=2**64 - 1)]},
        {"new_requests": [req(0, top_p=1e-30, top_k=10**6)]},  # tiny top_p and huge top_k are legal
        {"row_num_tokens": [15, 1], "prompt_ids": [255] * 15, "kv_slots": list(range(48, 64))},
        {"row_start_pos": [29, 31]},  # both rows end at the last position
        {"released_slots": [], "new_requests": []},
    ],
)
def test_a_well_formed_launch_passes(changes: dict[str, object]) -> None:
    check_launch(valid(**changes), LIMITS)


def processed(**fields: object) -> dict[str, object]:
    """Launch changes: slot 0 registered with these processing fields, and a plain slot 3."""
    processing = replace(LogitsProcessing(prompt_len=3), **fields)  # type: ignore[arg-type]
    return {"new_requests": [req(3), replace(req(0), processing=processing)]}


FIELD = r"new_requests\[1\]\.processing\."
BAD_PROCESSING: list[tuple[str, dict[str, object], str]] = [
    ("prompt past the context", processed(prompt_len=33), FIELD + r"prompt_len: 33 is outside \[0, 32\]"),
    ("negative prompt_len", processed(prompt_len=-1), FIELD + r"prompt_len: -1 is outside"),
    ("min_tokens past the context", processed(min_tokens=33), FIELD + r"min_tokens: 33 is outside"),
    ("top_logprobs above 20", processed(top_logprobs=21), FIELD + r"top_logprobs: 21 is outside \[0, 20\]"),
    ("zero repetition", processed(repetition_penalty=0.0), FIELD + r"repetition_penalty: must be"),
    ("negative repetition", processed(repetition_penalty=-1.0), FIELD + r"repetition_penalty"),
    ("NaN repetition", processed(repetition_penalty=NAN), FIELD + r"repetition_penalty"),
    ("inf repetition", processed(repetition_penalty=INF), FIELD + r"repetition_penalty"),
    ("presence above 2", processed(presence_penalty=2.5), FIELD + r"presence_penalty: must be .* \[-2, 2\]"),
    ("NaN presence", processed(presence_penalty=NAN), FIELD + r"presence_penalty"),
    ("frequency below -2", processed(frequency_penalty=-2.01), FIELD + r"frequency_penalty"),
    ("inf frequency", processed(frequency_penalty=-INF), FIELD + r"frequency_penalty"),
    (
        "stop id past the vocab",
        processed(stop_ids=(2, 256)),
        FIELD + r"stop_ids\[1\]: 256 is outside the vocab",
    ),
    ("negative stop id", processed(stop_ids=(-1,)), FIELD + r"stop_ids\[0\]: -1 is outside"),
    (
        "bias id past the vocab",
        processed(logit_bias=tuple((i, 1.0) for i in range(250, 257))),
        FIELD + r"bias_ids\[6\]: 256 is outside the vocabulary",
    ),
    (
        "301 bias entries",
        processed(logit_bias=tuple((i % 256, 1.0) for i in range(301))),
        FIELD + r"bias_ids: 301 entries exceed the most of 300",
    ),
    ("bias above 100", processed(logit_bias=((1, 1.0), (2, 100.5))), FIELD + r"bias_values\[1\]: must be"),
    ("NaN bias", processed(logit_bias=((1, NAN),)), FIELD + r"bias_values\[0\]: must be"),
    ("-inf bias", processed(logit_bias=((1, -INF),)), FIELD + r"bias_values\[0\]"),
]


@pytest.mark.parametrize(
    ("changes", "message"), [c[1:] for c in BAD_PROCESSING], ids=[c[0] for c in BAD_PROCESSING]
)
def test_malformed_processing_is_refused_naming_its_field(changes: dict[str, object], message: str) -> None:
    with pytest.raises(LaunchError, match=f"^{message}"):
        check_launch(valid(**changes), LIMITS)


@pytest.mark.parametrize(
    "changes",
    [
        processed(),
        processed(prompt_len=32, min_tokens=32, top_logprobs=20, logprobs=True),
        processed(repetition_penalty=1e-3, presence_penalty=-2.0, frequency_penalty=2.0),
        processed(
            stop_ids=(0, 255), logit_bias=tuple((i, 100.0 - i) for i in range(200)) + ((5, -100.0),) * 100
        ),
    ],
)
def test_well_formed_processing_passes(changes: dict[str, object]) -> None:
    check_launch(valid(**changes), LIMITS)


def constrained(kind: str, text: str, replay: tuple[int, ...] = ()) -> dict[str, object]:
    """Launch changes: slot 0 registered with this grammar, and a plain slot 3."""
    grammar = GrammarConstraint(Constraint(kind, text), replay)  # type: ignore[arg-type]
    return {"new_requests": [req(3), replace(req(0), grammar=grammar)]}


GRAMMAR = r"new_requests\[1\]\.grammar\."
BAD_GRAMMARS: list[tuple[str, dict[str, object], str]] = [
    (
        "unknown kind",
        constrained("xml", "<a/>"),
        GRAMMAR + r"kind: one of json, regex, choice, grammar, thinking, got 'xml'",
    ),
    (
        "text over 64 KiB",
        constrained("regex", "a" * (MAX_CONSTRAINT_BYTES + 1)),
        GRAMMAR + r"text: at most 65536",
    ),
    (
        "a thinking constraint over 64 KiB and its header",
        constrained("thinking", "0 regex\n" + "a" * (MAX_CONSTRAINT_BYTES + MAX_THINKING_HEADER_BYTES)),
        GRAMMAR + r"text: at most 65600",
    ),
    (
        "replay past the vocab",
        constrained("regex", "a+", (97, 256)),
        GRAMMAR + r"replay_ids\[1\]: 256 is outside",
    ),
    (
        "replay past the context",
        constrained("regex", "a+", (97,) * 33),
        GRAMMAR + r"replay_ids: 33 is outside",
    ),
]


@pytest.mark.parametrize(
    ("changes", "message"), [c[1:] for c in BAD_GRAMMARS], ids=[c[0] for c in BAD_GRAMMARS]
)
def test_a_malformed_grammar_is_refused_naming_its_field(changes: dict[str, object], message: str) -> None:
    with pytest.raises(LaunchError, match=f"^{message}"):
        check_launch(valid(**changes), LIMITS)
    check_launch(valid(**constrained("regex", "a+", (97,) * 32)), LIMITS)  # at the limits: fine


def test_bias_lists_of_different_lengths_do_not_convert() -> None:
    message = launch_to_proto(valid(**processed(logit_bias=((1, 1.0), (2, 2.0)))))
    message.new_requests[1].processing.bias_values.pop()
    with pytest.raises(ValueError, match="zip"):
        launch_from_proto(message)


def test_a_launch_with_no_rows_carries_no_tokens() -> None:
    check_launch(Launch(1, released_slots=[0, 1, 2, 3]), LIMITS)
    with pytest.raises(LaunchError, match=r"^kv_slots: 1 slots for 0 tokens"):
        check_launch(Launch(1, kv_slots=[0]), LIMITS)
    with pytest.raises(LaunchError, match=r"^prompt_ids: 1 ids for 0 tokens"):
        check_launch(Launch(1, prompt_ids=[0]), LIMITS)


def test_the_step_budget_is_the_announced_one_or_derived_from_the_pool() -> None:
    assert step_budget(700, None) == 700
    assert step_budget(10**6, None) == DEFAULT_MAX_BATCH_TOKENS
    assert step_budget(4096, 512) == 512
    assert step_budget(700, 4096) == 700  # a launch never holds more tokens than the pool
    with pytest.raises(ValueError, match="max_batch_tokens"):
        step_budget(700, 0)


# ---- in the engine ----------------------------------------------------------------------------


@pytest.fixture
def engine() -> Iterator[WorkerEngine]:
    e = make_engine("sim", kv_slots=64, request_slots=4, sim_step_ms=0.0)
    e.begin_session().result()
    yield e
    e.shutdown()


def prefill(step: int, slot: int, n: int, **kw: object) -> Launch:
    return Launch(
        step,
        row_req_slots=[slot],
        row_start_pos=[0],
        row_num_tokens=[n],
        row_from_future=[False],
        row_sample=[True],
        prompt_ids=[65] * n,
        kv_slots=list(range(n)),
        **kw,  # type: ignore[arg-type]
    )


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def data_segment_bytes() -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmData:"))
    return int(line.split()[1]) * 1024


@contextlib.contextmanager
def data_limit(headroom: int) -> Iterator[None]:
    """Cap this process's data segment a little above its size, so that a launch
    expanded token by token fails with MemoryError instead of exhausting the host."""
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    cap = data_segment_bytes() + headroom
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


@pytest.mark.parametrize("claimed", [10_000_000, 2**31])
def test_a_tiny_launch_claiming_huge_rows_is_refused_without_allocating_them(
    engine: WorkerEngine, claimed: int
) -> None:
    engine.submit(prefill(1, 0, 2, new_requests=[req(0)])).result()  # warm the threads up
    hostile = Launch(2, row_req_slots=[0], row_start_pos=[0], row_num_tokens=[claimed])
    hostile.row_from_future, hostile.row_sample = [False], [True]
    wire = launch_to_proto(hostile).SerializeToString()
    assert len(wire) < 32
    launch = launch_from_proto(worker_pb2.Launch.FromString(wire))
    gc.collect()
    before = rss_bytes()
    with data_limit(256 * MB), pytest.raises(LaunchError, match=rf"^row_num_tokens\[0\]: {claimed} tokens"):
        engine.submit(launch).result()
    assert rss_bytes() - before < 4 * MB
    assert engine.stats().steps_executed == 1


def test_a_refused_launch_changes_no_slot(engine: WorkerEngine) -> None:
    engine.submit(Launch(1, new_requests=[req(0)])).result()
    bad = prefill(2, 1, 1, released_slots=[0], new_requests=[req(1)])
    bad.kv_slots = [64]
    with pytest.raises(LaunchError, match=r"^kv_slots\[0\]: 64 is outside the KV pool"):
        engine.submit(bad).result()
    stats = engine.stats()
    assert (stats.live_request_slots, stats.steps_executed) == (1, 1)


@pytest.mark.parametrize(("temperature", "top_p"), [(NAN, 1.0), (INF, 1.0), (1.0, NAN), (1.0, INF)])
def test_non_finite_sampling_constants_are_refused(
    engine: WorkerEngine, temperature: float, top_p: float
) -> None:
    launch = prefill(1, 0, 1, new_requests=[req(0, temperature=temperature, top_p=top_p)])
    with pytest.raises(LaunchError, match=r"^new_requests\[0\]\.(temperature|top_p): must be"):
        engine.submit(launch).result()
    assert engine.stats().live_request_slots == 0


def test_refused_processing_registers_nothing(engine: WorkerEngine) -> None:
    bad = replace(req(0), processing=LogitsProcessing(prompt_len=1, logit_bias=((999, 1.0),)))
    with pytest.raises(LaunchError, match=r"^new_requests\[0\]\.processing\.bias_ids\[0\]: 999"):
        engine.submit(prefill(1, 0, 1, new_requests=[bad])).result()
    assert engine.stats().live_request_slots == 0


def test_rows_name_slots_live_once_the_deltas_apply(engine: WorkerEngine) -> None:
    engine.submit(prefill(1, 0, 1, new_requests=[req(0)])).result()  # registered in its own launch
    with pytest.raises(LaunchError, match=r"^row_req_slots\[0\]: request slot 0 is not registered"):
        engine.submit(prefill(2, 0, 1, released_slots=[0])).result()


def test_a_row_may_not_name_a_slot_never_registered(engine: WorkerEngine) -> None:
    with pytest.raises(LaunchError, match=r"^row_req_slots\[0\]: request slot 3 is not registered"):
        engine.submit(prefill(1, 3, 1)).result()


def test_the_announced_budget_holds_for_its_session_only(engine: WorkerEngine) -> None:
    engine.begin_session(max_batch_tokens=2).result()
    assert engine.launch_limits.max_batch_tokens == 2
    with pytest.raises(LaunchError, match=r"^row_num_tokens\[0\]: 3 tokens exceed the step budget of 2"):
        engine.submit(prefill(1, 0, 3, new_requests=[req(0)])).result()
    engine.begin_session().result()
    assert engine.launch_limits.max_batch_tokens == 64  # the pool, below DEFAULT_MAX_BATCH_TOKENS
    assert len(engine.submit(prefill(1, 0, 3, new_requests=[req(0)])).result().token_ids) == 1
    with pytest.raises(ValueError, match="max_batch_tokens"):
        engine.begin_session(max_batch_tokens=0)


def test_a_valid_launch_still_runs_on_the_tiny_model() -> None:
    engine = make_engine("tiny", kv_slots=64, request_slots=4)
    try:
        engine.begin_session(max_batch_tokens=8).result()
        first = engine.submit(prefill(1, 0, 5, new_requests=[req(0), req(1, temperature=0.0)]))
        second = engine.submit(
            Launch(
                2,
                row_req_slots=[0, 1],
                row_start_pos=[5, 0],
                row_num_tokens=[1, 2],
                row_from_future=[True, False],
                row_sample=[True, True],
                prompt_ids=[72, 105],
                kv_slots=[5, 6, 7],
            )
        )
        tokens = first.result().token_ids + second.result().token_ids
        assert len(tokens) == 3 and all(0 <= t < engine.backend.vocab_size for t in tokens)
        assert engine.stats().steps_executed == 2
    finally:
        engine.shutdown()
