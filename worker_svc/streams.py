"""The forward stream and the copy stream, on CUDA and on the CPU.

CUDA: the forward runs on its own stream; a copy stream waits for it, copies
the sampled ids into pinned host memory and records an event that is waited
on only when the result is sent.
CPU: torch has no streams or events there, so the worker's single ordered
forward thread plays the forward stream; the forward has finished when the
thread returns, and the "copy" is a plain host read.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Protocol

import torch


class PendingCopy(Protocol):
    """Sampled ids on their way to the host."""

    def wait(self) -> list[int]: ...

    def forward_seconds(self) -> float: ...


class DeviceStreams(Protocol):
    device: torch.device

    def forward(self) -> contextlib.AbstractContextManager[None]: ...

    def copy_to_host(self, tokens: torch.Tensor, started: float) -> PendingCopy: ...

    def to_device(self, values: list[int]) -> torch.Tensor: ...


class _ReadyCopy:
    def __init__(self, tokens: list[int], seconds: float) -> None:
        self._tokens = tokens
        self._seconds = seconds

    def wait(self) -> list[int]:
        return self._tokens

    def forward_seconds(self) -> float:
        return self._seconds


class CpuStreams:
    """The calling (forward) thread is the stream: work is done on return."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        yield

    def copy_to_host(self, tokens: torch.Tensor, started: float) -> PendingCopy:
        return _ReadyCopy(tokens.tolist(), time.perf_counter() - started)

    def to_device(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64)


class _CudaCopy:
    def __init__(
        self, host: torch.Tensor, start: torch.cuda.Event, end: torch.cuda.Event, done: torch.cuda.Event
    ) -> None:
        self._host, self._start, self._end, self._done = host, start, end, done

    def wait(self) -> list[int]:
        self._done.synchronize()
        tokens: list[int] = self._host.tolist()
        return tokens

    def forward_seconds(self) -> float:
        return float(self._start.elapsed_time(self._end)) / 1000.0


class CudaStreams:
    """A forward stream, a copy stream, pinned host buffers, one event per batch."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._forward_stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self._copy_stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self._start: torch.cuda.Event | None = None

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        with torch.cuda.stream(self._forward_stream):
            self._start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            self._start.record()
            yield

    def copy_to_host(self, tokens: torch.Tensor, started: float) -> PendingCopy:
        assert self._start is not None, "copy_to_host outside forward()"
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end.record(self._forward_stream)
        self._copy_stream.wait_stream(self._forward_stream)
        with torch.cuda.stream(self._copy_stream):
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record()
        # NOTE: the copy stream reads `tokens` after the forward stream may free them.
        tokens.record_stream(self._copy_stream)
        return _CudaCopy(host, self._start, end, done)

    def to_device(self, values: list[int]) -> torch.Tensor:
        host = torch.tensor(values, dtype=torch.int64).pin_memory()
        return host.to(self.device, non_blocking=True)


def make_streams(device: torch.device) -> DeviceStreams:
    if device.type == "cuda":
        return CudaStreams(device)
    return CpuStreams()
