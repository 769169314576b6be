"""The forward stream and the copy stream, on CUDA and on the CPU.

CUDA: the forward runs on its own stream; every host value a step needs goes to
the device by one path (`DeviceStreams.to_device`): written into pinned staging
buffers reused across steps, copied without blocking on the forward stream. A
copy stream waits for the forward, copies the sampled ids into pinned host
memory and records an event that is waited on only when the result is sent: one copy
and one event per step, whatever it carries (the ids, or the ids packed with their
log-probabilities).
CPU: torch has no streams or events there, so the worker's single ordered
forward thread plays the forward stream; the forward has finished when the
thread returns, and the "copy" is a plain host read.

Both report when each forward ran, in Unix seconds, so that device gaps and
traces line up with the scheduler's clock.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

HostValues = Sequence[int] | Sequence[float]


@dataclass(frozen=True)
class StepTiming:
    forward_start: float  # Unix seconds
    forward_end: float
    copy_end: float

    @property
    def forward_seconds(self) -> float:
        return self.forward_end - self.forward_start

    @property
    def copy_seconds(self) -> float:
        return self.copy_end - self.forward_end


class PendingCopy(Protocol):
    """A step's result tensor on its way to the host."""

    def wait(self) -> tuple[torch.Tensor, StepTiming]:
        """The tensor on the host, once copied, and when its step ran."""
        ...


class DeviceStreams(Protocol):
    device: torch.device
    # The forward thread is the device: a device value read on the host waits for nothing, so
    # the forward thread may shape a step by one (speculative decoding's verify rows).
    host_reads_free: bool

    def forward(self) -> contextlib.AbstractContextManager[None]: ...

    def copy_to_host(self, values: torch.Tensor) -> PendingCopy:
        """`values`, once the forward has written them, on the host (one copy, one event)."""
        ...

    def early_to_host(self, values: torch.Tensor) -> Callable[[], torch.Tensor]:
        """`values`, just written on the forward stream, on their way to the host ahead of the
        step's copy (a verify row's drafts, for its grammar's masks): call it to wait for them
        (off the forward thread)."""
        ...

    def to_device(self, values: HostValues, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """`values` as a tensor on the device, enqueued on the forward stream (inside `forward()`)."""
        ...

    def tensor_to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A host tensor (pinned where the device needs it: grammar masks) on the device,
        enqueued on the forward stream without waiting."""
        ...


# NOTE: the streams whose forward is running on this thread, for code that has no
# handle on them (the model); set by the engine around each step (`transfers_through`).
_ACTIVE: contextvars.ContextVar[DeviceStreams | None] = contextvars.ContextVar("streams", default=None)


@contextlib.contextmanager
def transfers_through(streams: DeviceStreams) -> Iterator[None]:
    """Within the block, `to_device_columns` without explicit streams goes through `streams`."""
    token = _ACTIVE.set(streams)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def to_device_columns(
    columns: Sequence[Sequence[float]],
    device: torch.device,
    streams: DeviceStreams | None = None,
    dtype: torch.dtype = torch.int64,
) -> list[torch.Tensor]:
    """Columns of `dtype` (int64 unless told) on `device` in one transfer: device views of
    one packed tensor.

    Through `streams`, else the streams of the running step, else (outside the engine)
    a direct copy.
    """
    path = streams if streams is not None else _ACTIVE.get()
    packed = list(itertools.chain.from_iterable(columns))
    flat = path.to_device(packed, dtype) if path is not None else _direct_to_device(packed, device, dtype)
    return list(flat.split_with_sizes([len(column) for column in columns]))


def _direct_to_device(values: list[float], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    # Pinned, so that the copy does not block the host.
    return host.pin_memory().to(device, non_blocking=True)


class _HostCopy:
    """The copy thread reads the values, so the forward thread is free for the next batch."""

    def __init__(self, values: torch.Tensor, forward_start: float, forward_end: float) -> None:
        self._values = values
        self._forward_start = forward_start
        self._forward_end = forward_end

    def wait(self) -> tuple[torch.Tensor, StepTiming]:
        return self._values, StepTiming(self._forward_start, self._forward_end, time.time())


class CpuStreams:
    """The calling (forward) thread is the stream: work is done on return.

    NOTE: the tensor a step copies to the host is never written after its
    forward, so the copy thread may read it while the next forward runs.
    """

    host_reads_free = True

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self._started = 0.0

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        self._started = time.time()
        yield

    def copy_to_host(self, values: torch.Tensor) -> PendingCopy:
        return _HostCopy(values, self._started, time.time())

    def early_to_host(self, values: torch.Tensor) -> Callable[[], torch.Tensor]:
        return lambda: values

    def to_device(self, values: HostValues, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype)

    def tensor_to_device(self, host: torch.Tensor) -> torch.Tensor:
        return host


class StagingEvent(Protocol):
    def record(self) -> None:
        """On the current stream."""
        ...

    def query(self) -> bool:
        """Whether the work before the last record has completed; never waits."""
        ...


STAGING_ALIGN = 8  # bytes: every staged column starts at a multiple of the widest element


@dataclass
class _Arena:
    """One step's staging buffer, and the event recorded after that step's copies."""

    buffer: torch.Tensor  # uint8
    copied: StagingEvent
    used: int = 0
    recorded: bool = False
    retired: list[torch.Tensor] = field(default_factory=list)  # outgrown, still read by pending copies

    def reusable(self) -> bool:
        return not self.recorded or self.copied.query()


class HostStaging:
    """Host buffers that each step's host-to-device copies read from, reused across steps.

    NOTE: a non-blocking copy reads its source when the forward stream reaches it, which
    may be steps after the host wrote it. So each step writes into an arena of its own,
    and an arena is written again only once the event recorded after its step's copies
    has completed (`query`, never a wait): while the device is behind, the ring grows
    by one arena instead of the forward thread waiting for it.
    """

    def __init__(
        self,
        allocate: Callable[[int], torch.Tensor],
        new_event: Callable[[], StagingEvent],
        arena_bytes: int = 1 << 16,
    ) -> None:
        self._allocate = allocate
        self._new_event = new_event
        self._arena_bytes = arena_bytes
        self._ring: deque[_Arena] = deque()  # oldest step first
        self._current: _Arena | None = None

    @property
    def arenas(self) -> int:
        return len(self._ring) + (self._current is not None)

    def begin_step(self) -> None:
        if self._ring and self._ring[0].reusable():
            arena = self._ring.popleft()
            arena.used, arena.retired = 0, []
        else:
            arena = _Arena(self._allocate(self._arena_bytes), self._new_event())
        self._current = arena

    def end_step(self) -> None:
        """Record, on the current (forward) stream, that this step's copies are enqueued."""
        arena = self._current_arena()
        arena.copied.record()
        arena.recorded = True
        self._ring.append(arena)
        self._current = None

    def stage(self, values: HostValues, dtype: torch.dtype) -> torch.Tensor:
        """`values` written into this step's arena: the host tensor to copy from."""
        arena = self._current_arena()
        nbytes = len(values) * dtype.itemsize
        start = -(-arena.used // STAGING_ALIGN) * STAGING_ALIGN
        if start + nbytes > arena.buffer.numel():
            arena.retired.append(arena.buffer)
            arena.buffer = self._allocate(max(2 * arena.buffer.numel(), nbytes))
            start = 0
        host = arena.buffer[start : start + nbytes].view(dtype)
        host.copy_(torch.tensor(values, dtype=dtype))
        arena.used = start + nbytes
        return host

    def _current_arena(self) -> _Arena:
        if self._current is None:
            raise RuntimeError("host values staged outside a step (DeviceStreams.forward)")
        return self._current


class _DeviceClock:
    """Maps CUDA events to Unix seconds through an anchor event whose time is known.

    NOTE: CUDA reports elapsed times in float32 milliseconds, which lose resolution
    as the interval grows (about 60 us after 17 minutes), so the anchor moves to
    each completed batch's last event (`advance`): every interval stays one step long.
    """

    def __init__(self, stream: torch.cuda.Stream) -> None:
        torch.cuda.synchronize(stream.device)
        self._anchor = _timing_event()
        self._anchor.record(stream)
        self._anchor.synchronize()
        self._anchor_unix = time.time()

    def unix(self, event: torch.cuda.Event) -> float:
        return self._anchor_unix + float(self._anchor.elapsed_time(event)) / 1000.0

    def advance(self, event: torch.cuda.Event) -> None:
        """Anchor on `event`, which has completed."""
        self._anchor_unix = self.unix(event)
        self._anchor = event


def _timing_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


def _staging_event() -> StagingEvent:
    event: StagingEvent = torch.cuda.Event()  # type: ignore[no-untyped-call]
    return event


def _pinned_bytes(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class _CudaCopy:
    def __init__(self, host: torch.Tensor, events: tuple[torch.cuda.Event, ...], clock: _DeviceClock) -> None:
        self._host, self._events, self._clock = host, events, clock

    def wait(self) -> tuple[torch.Tensor, StepTiming]:
        start, end, done = self._events
        # NOTE: the one host wait of a step, on the copy thread.
        done.synchronize()
        timing = StepTiming(self._clock.unix(start), self._clock.unix(end), self._clock.unix(done))
        self._clock.advance(done)
        return self._host, timing


class CudaStreams:
    """A forward stream, a copy stream, pinned host buffers, one event per batch.

    NOTE: only the copy thread waits for the device (`_CudaCopy.wait`, on the batch's
    event); the forward thread only enqueues.
    """

    host_reads_free = False

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._forward_stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self._copy_stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self._clock = _DeviceClock(self._forward_stream)
        self._staging = HostStaging(_pinned_bytes, _staging_event)
        self._start = _timing_event()
        self._after_default_stream = False

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        with torch.cuda.stream(self._forward_stream):
            self._join_default_stream()
            self._staging.begin_step()
            self._start = _timing_event()
            self._start.record()
            try:
                yield
            finally:
                self._staging.end_step()

    def _join_default_stream(self) -> None:
        # NOTE: the weights, the KV pool and the engine's tables are filled on the
        # default stream when the worker is built, and CUDA does not order the
        # forward stream after it; every later step runs on the forward stream.
        if not self._after_default_stream:
            self._forward_stream.wait_stream(torch.cuda.default_stream(self.device))
            self._after_default_stream = True

    def copy_to_host(self, values: torch.Tensor) -> PendingCopy:
        end = _timing_event()
        end.record(self._forward_stream)
        self._copy_stream.wait_stream(self._forward_stream)
        with torch.cuda.stream(self._copy_stream):
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
            done = _timing_event()
            done.record()
        # NOTE: the copy stream reads `values` after the forward stream may free them.
        values.record_stream(self._copy_stream)
        return _CudaCopy(host, (self._start, end, done), self._clock)

    def early_to_host(self, values: torch.Tensor) -> Callable[[], torch.Tensor]:
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        host.copy_(values, non_blocking=True)  # on the forward stream, behind what wrote them
        copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
        copied.record()

        def wait() -> torch.Tensor:
            copied.synchronize()
            return host

        return wait

    def to_device(self, values: HostValues, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        if not values:
            return torch.empty(0, dtype=dtype, device=self.device)
        host = self._staging.stage(values, dtype)
        return host.to(self.device, non_blocking=True)

    def tensor_to_device(self, host: torch.Tensor) -> torch.Tensor:
        # NOTE: `host` is pinned and never written again: torch's pinned allocator keeps it
        # until the copy has run, and the copy does not block the forward thread.
        assert host.is_pinned(), "a non-blocking copy needs pinned memory"
        return host.to(self.device, non_blocking=True)


class SimDevice:
    """The `sim` device's timeline: work queues on it like kernels on a GPU stream,
    and a step runs from when the device is free, for its simulated time."""

    def __init__(self) -> None:
        self._free_at = 0.0
        self._last: tuple[float, float] | None = None

    def run(self, seconds: float) -> None:
        start = max(time.time(), self._free_at)
        self._free_at = start + seconds
        self._last = (start, self._free_at)

    def take_last_run(self) -> tuple[float, float]:
        """(start, end) of the run queued since the last call; an empty run when none was."""
        last, self._last = self._last, None
        if last is None:
            now = max(time.time(), self._free_at)
            return now, now
        return last


class _SimCopy:
    def __init__(self, values: torch.Tensor, start: float, end: float) -> None:
        self._values, self._start, self._end = values, start, end

    def wait(self) -> tuple[torch.Tensor, StepTiming]:
        time.sleep(max(self._end - time.time(), 0.0))
        return self._values, StepTiming(self._start, self._end, time.time())


class SimStreams:
    """Streams for the `sim` device: a launch returns as soon as its time is queued
    on the timeline, so the forward thread prepares batch k+1 while k "runs", as it
    does on CUDA; the copy thread waits until the step's simulated end."""

    host_reads_free = False  # as on CUDA: the sim's timeline is a GPU's

    def __init__(self, device: SimDevice) -> None:
        self.device = torch.device("cpu")
        self._sim = device

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        yield

    def copy_to_host(self, values: torch.Tensor) -> PendingCopy:
        return _SimCopy(values, *self._sim.take_last_run())

    def early_to_host(self, values: torch.Tensor) -> Callable[[], torch.Tensor]:
        return lambda: values

    def to_device(self, values: HostValues, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype)

    def tensor_to_device(self, host: torch.Tensor) -> torch.Tensor:
        return host


def make_streams(device: torch.device) -> DeviceStreams:
    if device.type == "cuda":
        return CudaStreams(device)
    return CpuStreams()
