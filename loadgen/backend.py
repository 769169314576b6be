"""What the benchmark runner needs of an API it drives: connect, send one request, close."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from loadgen.timing import Clock, RequestTiming

BackendName = Literal["grpc", "openai", "openai-chat"]
BACKENDS: tuple[BackendName, ...] = ("grpc", "openai", "openai-chat")


class BackendError(RuntimeError):
    """The backend cannot start the run (the server cannot say which model it serves, ...)."""


@dataclass(frozen=True)
class Sampling:
    temperature: float
    ignore_eos: bool


class Backend(Protocol):
    @property
    def model(self) -> str | None:
        """The model the requests name; None for an API that names none."""
        ...

    async def connect(self) -> None:
        """Before the first request; raises BackendError when the run cannot go on."""
        ...

    async def send(self, timing: RequestTiming, clock: Clock) -> None:
        """Runs one request to its end, recording into `timing`; a failure is recorded, never raised."""
        ...

    async def close(self) -> None: ...
