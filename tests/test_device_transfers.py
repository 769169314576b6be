"""Host<->device traffic of a step goes through `DeviceStreams` only; checked on the CPU.

On CUDA a hidden transfer or read back stalls the forward thread until the device drains,
which is the serial loop again; the CPU cannot show the stall, so these tests catch the call
(tests/transfer_guard.py) and check the staging buffers' reuse rule with fake events.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from stepahead.protocol import Launch
from tests.transfer_guard import (
    constrained_launches,
    guard_engine,
    run_back_to_back,
    sampled_rows,
    scripted_launches,
)
from worker_svc.backends import Draw, load_backend
from worker_svc.device_streams import (
    CpuStreams,
    HostStaging,
    HostValues,
    PendingCopy,
    to_device_columns,
    transfers_through,
)
from worker_svc.engine import EngineConfig, WorkerEngine
from worker_svc.forward_batch import ForwardBatch
from worker_svc.layers import KVCache
from worker_svc.loading import build_tiny

CPU = torch.device("cpu")


@dataclass(frozen=True)
class Transfer:
    dtype: torch.dtype
    count: int
    in_forward: bool


class RecordingStreams(CpuStreams):
    """CPU streams that record every transfer to the device and every copy back."""

    def __init__(self) -> None:
        super().__init__()
        self.transfers: list[Transfer] = []
        self.copied: list[torch.Tensor] = []
        self.masks = 0  # host tensors moved by `tensor_to_device` (grammar masks)
        self._in_forward = False

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        with super().forward():
            self._in_forward = True
            try:
                yield
            finally:
                self._in_forward = False

    def to_device(self, values: HostValues, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        self.transfers.append(Transfer(dtype, len(values), self._in_forward))
        return super().to_device(values, dtype)

    def tensor_to_device(self, host: torch.Tensor) -> torch.Tensor:
        self.masks += 1
        return super().tensor_to_device(host)

    def copy_to_host(self, values: torch.Tensor) -> PendingCopy:
        self.copied.append(values)
        return super().copy_to_host(values)


def tiny_engine(streams: CpuStreams, check_invariants: bool = False) -> WorkerEngine:
    backend = load_backend("tiny", CPU, torch.float32, 1.0, 0.0)
    engine = WorkerEngine(backend, EngineConfig(256, 8, check_invariants), streams)
    engine.begin_session().result()
    return engine


@pytest.fixture
def recorded() -> Iterator[tuple[WorkerEngine, RecordingStreams]]:
    streams = RecordingStreams()
    engine = tiny_engine(streams)
    yield engine, streams
    engine.shutdown()


def expected_transfers(launch: Launch) -> int:
    """Released slots 1, new requests 2 (integers, floats), the rows 1, the model's decode plan 1."""
    decode_plan = any(n == 1 for n in launch.row_num_tokens)
    return bool(launch.released_slots) + 2 * bool(launch.new_requests) + bool(launch.num_rows) + decode_plan


def test_tiny_moves_host_values_only_through_the_streams(
    recorded: tuple[WorkerEngine, RecordingStreams], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, streams = recorded
    launches = scripted_launches().launches
    guard = guard_engine(engine, monkeypatch)
    tokens = run_back_to_back(engine, launches)
    assert not guard.violations, "\n".join(guard.violations)
    assert [len(t) for t in tokens] == [sampled_rows(launch) for launch in launches]
    assert all(t.in_forward for t in streams.transfers)
    assert len(streams.transfers) == sum(expected_transfers(launch) for launch in launches)
    float_transfers = [t for t in streams.transfers if t.dtype == torch.float32]
    assert len(float_transfers) == sum(bool(launch.new_requests) for launch in launches)


def test_constrained_rows_move_their_masks_only_through_the_streams(
    recorded: tuple[WorkerEngine, RecordingStreams], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step with constrained rows waits for its masks (by design) but reads nothing back from
    the device and moves each mask by the streams' one path; back to back equals one at a time."""
    engine, streams = recorded
    launches = constrained_launches().launches
    guard = guard_engine(engine, monkeypatch)
    back_to_back = run_back_to_back(engine, launches)
    assert not guard.violations, "\n".join(guard.violations)
    masked_steps = sum(any(s in (0, 1, 2) for s in launch.row_req_slots) for launch in launches[1:])
    assert streams.masks >= masked_steps
    plain = tiny_engine(CpuStreams())
    try:
        assert back_to_back == [plain.submit(launch).result().token_ids for launch in launches]
    finally:
        plain.shutdown()


def test_guarded_back_to_back_launches_equal_launches_one_at_a_time(
    recorded: tuple[WorkerEngine, RecordingStreams], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, _ = recorded
    launches = scripted_launches().launches
    guard_engine(engine, monkeypatch)
    back_to_back = run_back_to_back(engine, launches)
    plain = tiny_engine(CpuStreams())
    try:
        one_at_a_time = [plain.submit(launch).result() for launch in launches]
    finally:
        plain.shutdown()
    assert back_to_back == [r.token_ids for r in one_at_a_time]


def _int(batch: ForwardBatch) -> object:
    return int(batch.positions[0])


HIDDEN: dict[str, Callable[[ForwardBatch], object]] = {
    "a host list made a tensor": lambda batch: torch.tensor([1, 2], device=batch.positions.device),
    "a tensor moved to a device": lambda batch: torch.zeros(2).to(batch.positions.device),
    "a non-blocking copy": lambda batch: torch.zeros(2).to("cpu", non_blocking=True),
    "item()": lambda batch: batch.positions[0].item(),
    "tolist()": lambda batch: batch.positions.tolist(),
    "cpu()": lambda batch: batch.positions.cpu(),
    "int(tensor)": _int,
    "bool(tensor)": lambda batch: bool(batch.positions.any()),
    "numpy()": lambda batch: batch.positions.numpy(),
    "copy_ across devices": lambda batch: torch.empty(2, device="meta").copy_(batch.positions[:2]),
    "synchronize()": lambda batch: torch.cuda.synchronize(),
}


@pytest.mark.parametrize("hide", HIDDEN.values(), ids=HIDDEN.keys())
def test_the_guard_catches_each_kind_of_hidden_transfer(
    recorded: tuple[WorkerEngine, RecordingStreams],
    monkeypatch: pytest.MonkeyPatch,
    hide: Callable[[ForwardBatch], object],
) -> None:
    engine, _ = recorded
    compute = engine.backend.compute

    def compute_with_a_hidden_transfer(batch: ForwardBatch, sampling: Any) -> Draw:
        with contextlib.suppress(Exception):  # synchronize() without CUDA, copy_ to meta
            hide(batch)
        return compute(batch, sampling)

    monkeypatch.setattr(engine.backend, "compute", compute_with_a_hidden_transfer)
    guard = guard_engine(engine, monkeypatch)
    run_back_to_back(engine, scripted_launches().launches[:1])
    assert guard.violations, "the guard missed it"
    assert all("test_device_transfers.py" in v for v in guard.violations), guard.violations


def test_the_forward_thread_runs_in_inference_mode(recorded: tuple[WorkerEngine, RecordingStreams]) -> None:
    engine, streams = recorded
    gc.collect()  # inference mode must not end with a collected guard object
    run_back_to_back(engine, scripted_launches().launches[:2])
    assert streams.copied and all(t.is_inference() for t in streams.copied)


def test_the_model_enters_no_grad_mode_of_its_own() -> None:
    model = build_tiny(torch.float32, CPU)
    n = 4
    req_to_token = torch.zeros((1, model.config.max_context_len), dtype=torch.int64)
    req_to_token[0, :n] = torch.arange(n)
    batch = ForwardBatch(
        input_ids=torch.tensor([72, 101, 108, 108]),
        positions=torch.arange(n),
        out_kv_slots=torch.arange(n),
        row_req_slots=torch.tensor([0]),
        row_token_starts=[0],
        row_num_tokens=[n],
        row_ctx_lens=[n],
        sample_token_index=torch.tensor([n - 1]),
        req_to_token=req_to_token,
    )
    logits = model(batch, KVCache.allocate(model.config, 8, torch.float32, CPU))
    assert logits.shape == (1, model.config.vocab_size)
    assert not logits.is_inference() and not logits.requires_grad


def test_columns_go_through_the_running_steps_streams() -> None:
    streams = RecordingStreams()
    with streams.forward(), transfers_through(streams):
        a, b, empty = to_device_columns([[1, 2], [3], []], CPU)
    assert (a.tolist(), b.tolist(), empty.tolist()) == ([1, 2], [3], [])
    assert streams.transfers == [Transfer(torch.int64, 3, True)]
    (outside,) = to_device_columns([[4]], CPU)  # no step running: a direct copy
    assert outside.tolist() == [4] and len(streams.transfers) == 1


# ---- the staging buffers' reuse rule, with fake events ----------------------------------------


class FakeEvent:
    """Complete once the test says the device has passed it."""

    def __init__(self) -> None:
        self.pending = False

    def record(self) -> None:
        self.pending = True

    def query(self) -> bool:
        return not self.pending


def staging(arena_bytes: int) -> tuple[HostStaging, list[FakeEvent]]:
    events: list[FakeEvent] = []

    def new_event() -> FakeEvent:
        events.append(FakeEvent())
        return events[-1]

    return HostStaging(lambda n: torch.zeros(n, dtype=torch.uint8), new_event, arena_bytes), events


def test_an_arena_is_written_again_only_once_its_copies_have_run() -> None:
    ring, events = staging(64)
    ring.begin_step()
    first = ring.stage([1, 2, 3], torch.int64)
    ring.end_step()
    ring.begin_step()  # the device has not reached step 1's copies: a second arena
    second = ring.stage([4, 5, 6], torch.int64)
    ring.end_step()
    assert ring.arenas == 2
    assert first.tolist() == [1, 2, 3] and second.tolist() == [4, 5, 6]
    events[0].pending = False  # step 1's copies have run
    ring.begin_step()
    third = ring.stage([7, 8, 9], torch.int64)
    ring.end_step()
    assert ring.arenas == 2 and third.data_ptr() == first.data_ptr()
    assert second.tolist() == [4, 5, 6]


def test_an_arena_outgrown_mid_step_keeps_what_it_staged() -> None:
    ring, _ = staging(16)
    ring.begin_step()
    small = ring.stage([1, 2], torch.int64)
    large = ring.stage(list(range(100)), torch.int64)
    floats = ring.stage([0.5, 0.25, 2.0], torch.float32)
    after_floats = ring.stage([7], torch.int64)  # aligned again after three 4-byte values
    ring.end_step()
    assert small.tolist() == [1, 2] and large.tolist() == list(range(100))
    assert floats.tolist() == [0.5, 0.25, 2.0] and after_floats.tolist() == [7]


def test_staging_outside_a_step_is_refused() -> None:
    ring, _ = staging(64)
    with pytest.raises(RuntimeError, match="outside a step"):
        ring.stage([1], torch.int64)
