"""The worker engine in the scheduler's process: same ordered threads, no socket.

A `scheduler_svc.engine.transport.WorkerTransport` for tests and for the baseline of what the
process boundary costs (`python -m stepahead_colocated`).
"""

from __future__ import annotations

import asyncio
import time

from stepahead.protocol import Launch, StepResult, WorkerInfo, WorkerStepError
from stepahead.speculative import SpeculativeConfig
from worker_svc.engine import WorkerEngine


class InProcessSession:
    def __init__(self, engine: WorkerEngine, info: WorkerInfo) -> None:
        self._engine = engine
        self.info = info

    @property
    def last_heard(self) -> float:
        """The engine shares this process: it is never silent while this one runs."""
        return time.monotonic()

    async def launch(self, launch: Launch) -> asyncio.Future[StepResult]:
        """A step that fails fails its future with WorkerStepError, as over the wire (the worker
        logs it, reports it and ends the session)."""
        done = asyncio.wrap_future(self._engine.submit(launch))
        failed: asyncio.Future[StepResult] = asyncio.get_running_loop().create_future()

        def copy(_: object) -> None:
            if failed.done():
                return
            if done.cancelled():
                failed.cancel()
            elif (exc := done.exception()) is not None:
                failed.set_exception(WorkerStepError(launch.step_id, str(exc)))
            else:
                failed.set_result(done.result())

        done.add_done_callback(copy)
        return failed

    async def close(self) -> None:
        """The engine belongs to whoever built it."""


class InProcessTransport:
    def __init__(self, engine: WorkerEngine, speculative: SpeculativeConfig | None = None) -> None:
        """`speculative`: each session's speculative decoding (None: none)."""
        self._engine = engine
        self._speculative = speculative

    async def connect(self) -> InProcessSession:
        info = await asyncio.wrap_future(self._engine.begin_session(speculative=self._speculative))
        return InProcessSession(self._engine, info)

    async def close(self) -> None:
        """The engine belongs to whoever built it."""
