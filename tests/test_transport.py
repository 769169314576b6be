"""The worker link: one object per session, so nothing of an old session reaches the next."""

from __future__ import annotations

import pytest

from scheduler_svc.transport import GrpcTransport, WorkerUnavailable
from stepahead.processes import spawn_worker, wait_serving
from stepahead.protocol import Launch

pytestmark = pytest.mark.anyio

SIM = ["--model", "sim", "--sim-step-ms", "1"]


async def test_a_new_session_is_untouched_by_the_old_one() -> None:
    worker = spawn_worker(SIM)
    try:
        wait_serving(worker.address)
        transport = GrpcTransport(worker.address)
        old = await transport.connect()
        new = await transport.connect()  # closes the old session first
        assert new.info.epoch > old.info.epoch
        with pytest.raises(WorkerUnavailable):
            await old.launch(Launch(step_id=1))
        result = await (await new.launch(Launch(step_id=1)))
        assert (result.step_id, result.epoch) == (1, new.info.epoch)
        await old.close()  # a late close of the old one must not end the new one
        result = await (await new.launch(Launch(step_id=2)))
        assert result.step_id == 2
        await transport.close()
    finally:
        worker.stop()
