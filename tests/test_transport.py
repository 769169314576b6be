"""The worker link: one object per session, so nothing of an old session reaches the next."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

import pytest

from scheduler_svc.engine.transport import WorkerUnavailable
from scheduler_svc.process.grpc_transport import GrpcTransport
from stepahead.processes import spawn_worker, wait_serving
from stepahead.protocol import Launch
from tests.live import CALL_TIMEOUT_S

pytestmark = pytest.mark.anyio

# No core here sends the idle heartbeats a scheduler does: the worker's timeout for a silent
# session is a hang guard's, so the pauses between the test's steps never end one.
SIM = ["--model", "sim", "--sim-step-ms", "1", "--scheduler-timeout", str(CALL_TIMEOUT_S)]
T = TypeVar("T")


async def within(step: Awaitable[T]) -> T:
    """`step`, with a hang guard (milliseconds expected)."""
    return await asyncio.wait_for(step, CALL_TIMEOUT_S)


async def test_a_new_session_is_untouched_by_the_old_one() -> None:
    worker = spawn_worker(SIM)
    try:
        wait_serving(worker.address)
        transport = GrpcTransport(worker.address)
        old = await within(transport.connect())
        new = await within(transport.connect())  # closes the old session first
        assert new.info.epoch > old.info.epoch
        with pytest.raises(WorkerUnavailable):
            await within(old.launch(Launch(step_id=1)))
        result = await within(await within(new.launch(Launch(step_id=1))))
        assert (result.step_id, result.epoch) == (1, new.info.epoch)
        await within(old.close())  # a late close of the old one must not end the new one
        result = await within(await within(new.launch(Launch(step_id=2))))
        assert result.step_id == 2
        await within(transport.close())
    finally:
        worker.stop()
