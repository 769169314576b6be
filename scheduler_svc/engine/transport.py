"""How the engine core reaches the worker.

`WorkerTransport.connect()` performs the handshake and returns a `WorkerSession`: one
object per session, closed when the session ends, so nothing of an old session (its
channel, its reader, its pending results) can touch the next one. `launch()` sends a
batch and returns at once with a future of its result; results resolve in launch order.

The gRPC transport is the product (`scheduler_svc.process.grpc_transport`);
`worker_svc.inprocess` provides one that runs the engine in the same process (the baseline for
what the process boundary costs). The engine sees only this interface.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from stepahead.protocol import (
    Launch,
    StepResult,
    WorkerInfo,
)


class WorkerUnavailable(ConnectionError):
    """The worker cannot be reached, or its session ended."""


class WorkerSession(Protocol):
    info: WorkerInfo

    @property
    def last_heard(self) -> float:
        """When the worker last said anything (time.monotonic()): a result, or a Keepalive
        while a step computes. The core's watchdog ends a session only after a long silence."""
        ...

    async def launch(self, launch: Launch) -> asyncio.Future[StepResult]: ...

    async def close(self) -> None: ...


class WorkerTransport(Protocol):
    async def connect(self) -> WorkerSession: ...

    async def close(self) -> None: ...


DEFAULT_SILENCE_TIMEOUT_S = 10.0  # --worker-step-timeout: a worker silent this long is hung
