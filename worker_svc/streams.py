"""The forward stream and the copy stream, on CUDA and on the CPU.

CUDA: the forward runs on its own stream; a copy stream waits for it, copies
the sampled ids into pinned host memory and records an event that is waited
on only when the result is sent.
CPU: torch has no streams or events there, so the worker's single ordered
forward thread plays the forward stream; the forward has finished when the
thread returns, and the "copy" is a plain host read.

Both report when each forward ran, in Unix seconds, so that device gaps and
traces line up with the scheduler's clock.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch


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
    """Sampled ids on their way to the host."""

    def wait(self) -> tuple[list[int], StepTiming]: ...


class DeviceStreams(Protocol):
    device: torch.device

    def forward(self) -> contextlib.AbstractContextManager[None]: ...

    def copy_to_host(self, tokens: torch.Tensor) -> PendingCopy: ...

    def to_device(self, values: list[int]) -> torch.Tensor: ...


class _HostCopy:
    """The copy thread reads the ids, so the forward thread is free for the next batch."""

    def __init__(self, tokens: torch.Tensor, forward_start: float, forward_end: float) -> None:
        self._tokens = tokens
        self._forward_start = forward_start
        self._forward_end = forward_end

    def wait(self) -> tuple[list[int], StepTiming]:
        host: list[int] = self._tokens.tolist()
        return host, StepTiming(self._forward_start, self._forward_end, time.time())


class CpuStreams:
    """The calling (forward) thread is the stream: work is done on return.

    NOTE: the sampled ids tensor is never written after its forward, so the
    copy thread may read it while the next forward runs.
    """

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self._started = 0.0

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        self._started = time.time()
        yield

    def copy_to_host(self, tokens: torch.Tensor) -> PendingCopy:
        return _HostCopy(tokens, self._started, time.time())

    def to_device(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64)


class _DeviceClock:
    """Maps CUDA events to Unix seconds through one event recorded at a known time."""

    def __init__(self, stream: torch.cuda.Stream) -> None:
        torch.cuda.synchronize(stream.device)
        self._origin = _timing_event()
        self._origin.record(stream)
        self._origin.synchronize()
        self._origin_unix = time.time()

    def unix(self, event: torch.cuda.Event) -> float:
        return self._origin_unix + float(self._origin.elapsed_time(event)) / 1000.0


def _timing_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


class _CudaCopy:
    def __init__(self, host: torch.Tensor, events: tuple[torch.cuda.Event, ...], clock: _DeviceClock) -> None:
        self._host, self._events, self._clock = host, events, clock

    def wait(self) -> tuple[list[int], StepTiming]:
        start, end, done = self._events
        done.synchronize()
        tokens: list[int] = self._host.tolist()
        timing = StepTiming(self._clock.unix(start), self._clock.unix(end), self._clock.unix(done))
        return tokens, timing


class CudaStreams:
    """A forward stream, a copy stream, pinned host buffers, one event per batch."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._forward_stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self._copy_stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self._clock = _DeviceClock(self._forward_stream)
        self._start = _timing_event()

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        with torch.cuda.stream(self._forward_stream):
            self._start = _timing_event()
            self._start.record()
            yield

    def copy_to_host(self, tokens: torch.Tensor) -> PendingCopy:
        end = _timing_event()
        end.record(self._forward_stream)
        self._copy_stream.wait_stream(self._forward_stream)
        with torch.cuda.stream(self._copy_stream):
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            done = _timing_event()
            done.record()
        # NOTE: the copy stream reads `tokens` after the forward stream may free them.
        tokens.record_stream(self._copy_stream)
        return _CudaCopy(host, (self._start, end, done), self._clock)

    def to_device(self, values: list[int]) -> torch.Tensor:
        host = torch.tensor(values, dtype=torch.int64).pin_memory()
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
    def __init__(self, tokens: torch.Tensor, start: float, end: float) -> None:
        self._tokens, self._start, self._end = tokens, start, end

    def wait(self) -> tuple[list[int], StepTiming]:
        time.sleep(max(self._end - time.time(), 0.0))
        host: list[int] = self._tokens.tolist()
        return host, StepTiming(self._start, self._end, time.time())


class SimStreams:
    """Streams for the `sim` device: a launch returns as soon as its time is queued
    on the timeline, so the forward thread prepares batch k+1 while k "runs", as it
    does on CUDA; the copy thread waits until the step's simulated end."""

    def __init__(self, device: SimDevice) -> None:
        self.device = torch.device("cpu")
        self._sim = device

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        yield

    def copy_to_host(self, tokens: torch.Tensor) -> PendingCopy:
        return _SimCopy(tokens, *self._sim.take_last_run())

    def to_device(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64)


def make_streams(device: torch.device) -> DeviceStreams:
    if device.type == "cuda":
        return CudaStreams(device)
    return CpuStreams()
