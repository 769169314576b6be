"""The core's watchdog over a worker session: slow is not hung, and a lost worker is lost until a
session makes progress.

In process, against a host worker whose results the test holds (`FakeWorker(hold=True)`) and
whose words (results and keepalives, `last_heard`) the test controls: whether the worker speaks
is the scenario, forced; the timeouts are short because nothing in these tests is slow."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import grpc
import pytest

from scheduler_svc.engine.batch import ScheduledBatch
from scheduler_svc.engine.core import CoreConfig, EngineCore, StepHandle, done_within
from scheduler_svc.engine.transport import WorkerUnavailable
from scheduler_svc.frontend.frontend import Frontend, FrontendConfig
from scheduler_svc.process.link.local import LocalCore
from stepahead.protocol import Launch, StepResult
from tests.fake_worker import FakeWorker
from tests.harness import params

pytestmark = pytest.mark.anyio

TIMEOUT_S = 0.5  # --worker-step-timeout of these tests
GUARD_S = 60.0  # a hang guard, a hundred times what any wait here needs


class SpokenWorker(FakeWorker):
    """A host worker that is silent unless the test makes it speak."""

    def __init__(self) -> None:
        super().__init__(4096, 8, hold=True)
        self.heard = time.monotonic()

    @property
    def last_heard(self) -> float:
        return self.heard


@contextlib.asynccontextmanager
async def keepalives(worker: SpokenWorker, every_s: float) -> AsyncIterator[None]:
    """The worker says it is alive every `every_s` while the block runs."""

    async def speak() -> None:
        while True:
            worker.heard = time.monotonic()
            await asyncio.sleep(every_s)

    task = asyncio.create_task(speak())
    try:
        yield
    finally:
        task.cancel()


async def launched(worker: SpokenWorker) -> tuple[EngineCore, ScheduledBatch, StepHandle]:
    """A serial core over `worker`, with one request's first step launched."""
    core = EngineCore(worker, CoreConfig(mode="serial", worker_step_timeout_s=TIMEOUT_S))
    frontend = Frontend(FrontendConfig("serial"))
    LocalCore(core, frontend)
    assert core._start_session(await worker.connect())
    frontend.submit("r", [1, 2, 3], params(4, ignore_eos=True))
    batch = core.pick_batch()
    assert batch is not None
    return core, batch, await core.launch_step(batch)


async def test_a_step_longer_than_the_timeout_keeps_its_session_while_the_worker_speaks() -> None:
    worker = SpokenWorker()
    core, batch, handle = await launched(worker)
    async with keepalives(worker, TIMEOUT_S / 10):
        waiting = asyncio.create_task(core.process_results(batch, handle))
        await asyncio.sleep(4 * TIMEOUT_S)  # the step takes four timeouts
        assert not waiting.done()
        worker.complete_next()
        await asyncio.wait_for(waiting, GUARD_S)
    assert core.telemetry.step_timeouts._value.get() == 0
    assert core.policy.requests["r", 0].output_ids  # the step's token was applied


async def test_a_silent_worker_ends_the_session_after_the_timeout() -> None:
    core, batch, handle = await launched(SpokenWorker())
    with pytest.raises(WorkerUnavailable, match="said nothing for --worker-step-timeout"):
        await asyncio.wait_for(core.process_results(batch, handle), GUARD_S)
    assert core.telemetry.step_timeouts._value.get() == 1


class FlappingTransport:
    """A worker that accepts every session and never returns a result: each session is lost to
    the watchdog, and the next handshake succeeds at once."""

    def __init__(self) -> None:
        self.sessions = 0

    async def connect(self) -> FlappingSession:
        self.sessions += 1
        return FlappingSession()

    async def close(self) -> None:
        """Nothing to close."""


class FlappingSession(SpokenWorker):
    async def launch(self, launch: Launch) -> asyncio.Future[StepResult]:
        return asyncio.get_running_loop().create_future()  # never resolves


async def test_the_retry_timeout_counts_from_the_first_loss_of_a_run_of_lost_sessions() -> None:
    transport = FlappingTransport()
    # Reconnects at once: each lost session is followed by another within the retry timeout.
    config = CoreConfig(
        mode="overlap",
        worker_step_timeout_s=TIMEOUT_S,
        worker_retry_timeout_s=4 * TIMEOUT_S,
        reconnect_backoff_s=(0.01, 0.01),
    )
    core = EngineCore(transport, config)
    frontend = Frontend(FrontendConfig("overlap"))
    LocalCore(core, frontend)
    running = asyncio.create_task(core.run())
    try:
        async with asyncio.timeout(GUARD_S):
            while frontend.tokenizer is None:  # the first session's Welcome
                await asyncio.sleep(0.01)
        call = frontend.submit("r", [1, 2, 3], params(4, ignore_eos=True))
        while call.error is None:
            await asyncio.wait_for(call.ready.wait(), GUARD_S)
            assert not [chunk for _, chunk in call.take() if chunk.token_ids]
        code, message = call.error
        assert code == grpc.StatusCode.UNAVAILABLE and "--worker-retry-timeout" in message
        assert transport.sessions >= 2  # sessions were opened and lost again meanwhile
    finally:
        await core.close()
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running


async def test_waiting_for_a_step_s_result_neither_cancels_it_nor_misses_it() -> None:
    """The watchdog's wait for a step's result (`done_within`): it times out with the result
    still pending, a cancelled wait leaves the result to come, and a result that comes ends the
    wait at once."""
    loop = asyncio.get_running_loop()
    result: asyncio.Future[StepResult] = loop.create_future()
    assert not await done_within(result, 0.01)  # timed out
    assert not result.done()
    waiting = asyncio.ensure_future(done_within(result, GUARD_S))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert not result.done()  # a cancelled wait never cancels the step's result
    step = StepResult(7, [1])
    loop.call_later(0.01, result.set_result, step)
    started = time.monotonic()
    assert await done_within(result, GUARD_S)
    assert result.result() == step and time.monotonic() - started < GUARD_S
