"""The engine core: the serial and overlap loops over the scheduling policy, and the
worker session (connect, backoff, loss, recompute).

Each loop iteration is the seed's steps, one method each:
  pick_batch -> launch_step -> queue_result -> process_results
The serial loop processes batch k right after launching it; the overlap loop
processes batch k-1 after launching batch k, while the worker runs k (at
`--overlap-depth D`, batch k-D after launching k: `scheduler_svc/engine/depth.py`).
Both use the same batching policy and the same FutureMap relay.

The core imports neither torch nor `worker_svc`, and knows tokens only: frontends
(`scheduler_svc/frontend/frontend.py`) own text, stop strings and client streams, and reach the
core through `attach`/`add`/`abort_handle`; outputs leave through the `Outbox`, one
message per frontend per step.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field

from scheduler_svc.contract import DEFAULT_MODE, FrontendLink, Intake, Mode, OutputSink
from scheduler_svc.engine.batch import ScheduledBatch
from scheduler_svc.engine.depth import DepthConfig, OverlapDepth
from scheduler_svc.engine.late_pick import LatePick, LatePickConfig
from scheduler_svc.engine.outputs import Outbox
from scheduler_svc.engine.policy import PolicyConfig, Refused, SchedulerStats, SchedulingPolicy
from scheduler_svc.engine.request import Request
from scheduler_svc.engine.telemetry import SchedulerTelemetry
from scheduler_svc.engine.transport import (
    DEFAULT_SILENCE_TIMEOUT_S,
    WorkerSession,
    WorkerTransport,
    WorkerUnavailable,
)
from stepahead.protocol import StepResult, WorkerInfo, WorkerStepError

log = logging.getLogger("stepahead.core")

StepHandle = asyncio.Future[StepResult]


@dataclass(frozen=True)
class CoreConfig:
    mode: Mode = DEFAULT_MODE
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    reconnect_backoff_s: tuple[float, float] = (0.1, 2.0)
    worker_retry_timeout_s: float = 30.0  # live requests wait this long for a worker to come back
    # A worker that says nothing (no result, no Keepalive) for this long while a step of it is
    # pending is hung (e.g. stopped): its session ends as a crash would. A slow step is not a
    # hung one: the worker sends Keepalives while it computes.
    worker_step_timeout_s: float = DEFAULT_SILENCE_TIMEOUT_S
    idle_heartbeat_s: float = 2.0  # idle: a row-less launch this often, so a hung worker is found
    late_pick: LatePickConfig = field(default_factory=LatePickConfig)
    depth: DepthConfig = field(default_factory=DepthConfig)  # overlap: batches launched ahead
    # The longest the frontends' messages are held unread while a step's result is awaited
    # (`Intake`): a longer step reads them as they come, so that an abort or a query waits no
    # longer than this. 0: never held.
    intake_hold_s: float = 0.05


class EngineCore:
    def __init__(
        self, transport: WorkerTransport, config: CoreConfig, telemetry: SchedulerTelemetry | None = None
    ) -> None:
        self.transport = transport
        self.config = config
        self.telemetry = telemetry or SchedulerTelemetry(config.mode)
        self.outbox = Outbox()
        self.policy = SchedulingPolicy(config.policy, self.outbox, self.telemetry)
        # NOTE: holds at most `depth.current` entries whenever a batch is picked.
        self.result_queue: collections.deque[tuple[ScheduledBatch, StepHandle]] = collections.deque()
        self.telemetry.result_queue_depth.set_function(lambda: len(self.result_queue))
        self.depth = OverlapDepth(config.depth)
        self.telemetry.depth_configured.set(config.depth.depth)
        self.telemetry.depth.set(self.depth.current if config.mode == "overlap" else 0)
        self._last_result: tuple[StepResult, float] | None = None  # processed, not yet followed by a launch
        self.session: WorkerSession | None = None
        self.info: WorkerInfo | None = None  # the last session's, kept while the worker is away
        self.frontends: set[FrontendLink] = set()
        self.late_pick = LatePick(config.late_pick)
        self.idle = False  # parked with nothing live, in flight, or unreleased
        self._work = asyncio.Event()
        self._closing = False
        self._worker_clock_offset = 0.0  # worker clock minus ours
        self._lost_at: float | None = None  # when the worker session was lost
        self._expiry: asyncio.TimerHandle | None = None  # --worker-retry-timeout, on its own clock
        self._model_identity: tuple[str, int, tuple[int, ...], bytes] | None = None
        self.intake: Intake | None = None  # the frontend processes' link, when it has one

    # ---- frontends ---------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.session is not None

    @property
    def stats(self) -> SchedulerStats:
        return self.policy.stats

    def attach(self, frontend: FrontendLink) -> None:
        self.frontends.add(frontend)
        frontend.worker_state(self.info, self.ready)

    def detach(self, frontend: FrontendLink) -> None:
        """The frontend is gone: its requests end now and free their slots."""
        self.frontends.discard(frontend)
        ended = self.policy.abort_owner(frontend)
        if ended:
            log.warning("a frontend went away: %d of its requests ended", ended)
        self._work.set()

    def add(self, reqs: list[Request]) -> None:
        """Admit what fits; refusals go back to the owner as errors."""
        for req in reqs:
            try:
                self.policy.add_request(req)
            except Refused as refusal:
                self.outbox.error(req, refusal.code, str(refusal))
        self.outbox.flush()
        self._work.set()

    def abort_handles(self, owner: OutputSink, handles: list[int]) -> None:
        for handle in handles:
            self.policy.abort_handle(owner, handle)
        self._work.set()

    def abort(self, rid: str) -> bool:
        """End a live request at once, whichever frontend owns it."""
        aborted = self.policy.abort(rid)
        self.outbox.flush()
        self._work.set()
        return aborted

    # ---- the loops ---------------------------------------------------------------------

    async def run(self) -> None:
        """Serve until close(): connect, loop, and start over if the worker is lost."""
        while not self._closing:
            await self._connect_with_backoff()
            try:
                await (self._overlap_loop() if self.config.mode == "overlap" else self._serial_loop())
            except (WorkerUnavailable, WorkerStepError) as exc:
                await self._worker_lost(exc)
            except Exception as exc:  # a bug must not stop serving silently: start a new session
                log.exception("core loop failed; starting a new worker session")
                await self._worker_lost(exc)

    async def close(self) -> None:
        self._closing = True
        self._work.set()

    async def _serial_loop(self) -> None:
        while not self._closing:
            batch = self.pick_batch()
            if batch is None:
                await self._wait_for_work()
                continue
            handle = await self.launch_step(batch)
            await self.process_results(batch, handle)

    async def _overlap_loop(self) -> None:
        while not self._closing:
            batch = self.pick_batch()
            if batch is not None:
                handle = await self.launch_step(batch)
                self.queue_result(batch, handle)
            if len(self.result_queue) > self.depth.current or (batch is None and self.result_queue):
                await self.process_results(*self.result_queue.popleft())
                await self._until_late_pick()
            elif batch is None:
                await self._wait_for_work()

    async def _until_late_pick(self) -> None:
        """Hold the pick of k+1 until shortly before forward k ends (see LatePick)."""
        if not self.late_pick.config.enabled or len(self.result_queue) != 1:
            return
        in_flight, handle = self.result_queue[0]
        worker_now = time.time() + self._worker_clock_offset
        delay = self.late_pick.delay(in_flight.num_tokens, worker_now, self.policy.next_step_id)
        if delay > 0 and not handle.done():
            await done_within(handle, delay)

    async def _wait_for_work(self) -> None:
        """Idle: first tell the worker about released slots, then sleep until work comes,
        with a row-less launch every `idle_heartbeat_s` (the watchdog's and the worker's sign
        of life)."""
        self._last_result = None  # the time until the next launch is idle, not the loop's work
        release = self.policy.release_batch()
        if release is not None:
            await self.process_results(release, await self.launch_step(release))
            return
        self._work.clear()
        self.idle = True
        try:
            await asyncio.wait_for(self._work.wait(), self.config.idle_heartbeat_s)
        except TimeoutError:
            heartbeat = self.policy.empty_batch()
            await self.process_results(heartbeat, await self.launch_step(heartbeat))
        finally:
            self.idle = False

    # ---- step 1: pick ------------------------------------------------------------------

    def pick_batch(self) -> ScheduledBatch | None:
        with self.telemetry.phase("pick", self.policy.next_step_id):
            batch = self.policy.schedule()
        if batch is not None:
            self.telemetry.observe_batch(batch.forward_mode, batch.launch.num_rows, batch.num_tokens)
        return batch

    # ---- step 2: launch ----------------------------------------------------------------

    async def launch_step(self, batch: ScheduledBatch) -> StepHandle:
        """Send the batch; returns at once with a handle on its result."""
        with self.telemetry.phase("launch", batch.step_id):
            assert self.session is not None and self.info is not None
            batch.epoch = self.info.epoch
            batch.launched_at = time.monotonic()
            sent = time.time()
            handle = await self.session.launch(batch.launch)
        handle.add_done_callback(lambda _: self.telemetry.worker_latency.observe(time.time() - sent))
        self._observe_depth()
        return handle

    def _observe_depth(self) -> None:
        """The last processed result's link round trip and device time, and the time from its
        arrival to this launch: what the overlap depth must cover."""
        if self._last_result is None:
            return
        (result, seen_at), self._last_result = self._last_result, None
        self.depth.observe(result.link_rtt_s, time.monotonic() - seen_at, result.forward_seconds)
        self.telemetry.observe_depth(self.depth.current, result.link_rtt_s)

    # ---- step 3: queue -----------------------------------------------------------------

    def queue_result(self, batch: ScheduledBatch, handle: StepHandle) -> None:
        self.result_queue.append((batch, handle))
        self.telemetry.observe_result_queue(len(self.result_queue))

    # ---- step 4: process ---------------------------------------------------------------

    async def process_results(self, batch: ScheduledBatch, handle: StepHandle) -> None:
        """Wait for the batch's tokens, then update requests, check token stops, and send
        each frontend its rows in one message."""
        self.telemetry.observe_result_queue(len(self.result_queue))
        with self.telemetry.phase("wait", batch.step_id):
            try:
                result = await self._result_in_time(batch, handle)
            except WorkerStepError as exc:
                if exc.step_id == batch.step_id:  # the run loop then recomputes the rest
                    self.policy.step_failed(batch, exc.message)
                    self.outbox.flush()
                raise
        self._last_result = (result, time.monotonic())
        if (result.step_id, result.epoch) != (batch.step_id, batch.epoch):
            self.stats.results_out_of_order += 1
            raise WorkerUnavailable(
                f"result of step {result.step_id} (session {result.epoch}) for step {batch.step_id} "
                f"(session {batch.epoch}): never applied"
            )
        if self._lost_at is not None:
            self._recovered()
        if self.late_pick.config.enabled:
            self.late_pick.observe(batch.num_tokens, result)
        with self.telemetry.phase("process", batch.step_id):
            self.policy.update_from_result(
                batch,
                result.token_ids,
                result.logprobs,
                result.grammar_finished,
                result.token_counts,
                result.drafts_found,
                result.prompt_logprobs,
            )
            self.outbox.flush()

    async def _result_in_time(self, batch: ScheduledBatch, handle: StepHandle) -> StepResult:
        """The watchdog: the step's result, unless the worker falls silent (no result and no
        Keepalive) for --worker-step-timeout while it is pending. However long the step takes,
        a worker that keeps saying it is alive keeps its session."""
        if handle.done():  # already here (the usual case at depth 1): no timer to set
            return handle.result()
        intake, hold_s = self.intake, self.config.intake_hold_s
        if intake is None or hold_s <= 0:
            return await self._await_result(batch, handle)
        intake.hold()
        expiry = asyncio.get_running_loop().call_later(hold_s, intake.release)
        try:
            return await self._await_result(batch, handle)
        finally:
            expiry.cancel()
            intake.release()

    async def _await_result(self, batch: ScheduledBatch, handle: StepHandle) -> StepResult:
        timeout = self.config.worker_step_timeout_s
        session = self.session
        assert session is not None
        while True:
            heard = max(batch.launched_at, session.last_heard)
            left = max(heard + timeout - time.monotonic(), 0.0)
            if await done_within(handle, left):
                return handle.result()
            await asyncio.sleep(0)  # a word that arrived meanwhile is read before judging
            if handle.done() or session.last_heard > heard:
                continue
            self.telemetry.step_timeouts.inc()
            raise WorkerUnavailable(
                f"step {batch.step_id}: the worker said nothing for --worker-step-timeout {timeout:g}s "
                "(a hung or stopped worker?)"
            )

    # ---- the worker session ------------------------------------------------------------

    async def _connect_with_backoff(self) -> None:
        delay, max_delay = self.config.reconnect_backoff_s
        while not self._closing:
            try:
                session = await self.transport.connect()  # bounded by the transport's silence timeout
            except WorkerUnavailable as exc:
                level = logging.WARNING if delay >= max_delay else logging.INFO
                log.log(level, "waiting for the worker (%s); retrying in %.1fs", exc, delay)
            else:
                if self._start_session(session):
                    return
                await session.close()
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_delay)

    def _start_session(self, session: WorkerSession) -> bool:
        """False if the session cannot be used (then the caller retries)."""
        info = session.info
        # First, before anything slow: the one-way delay of the Welcome is ignored.
        self._worker_clock_offset = info.worker_unix_time - time.time()
        try:
            self._check_model(info)
            running_cap = self.policy.begin_session(info)
        except Exception:
            log.exception("worker session %d unusable; retrying", info.epoch)
            return False
        # NOTE: --worker-retry-timeout keeps counting until the session returns a result: a
        # worker that accepts sessions and loses them again is still lost.
        self.session, self.info = session, info
        self.late_pick = LatePick(self.config.late_pick)
        self.depth = OverlapDepth(self.config.depth)  # another link, maybe: measured afresh
        log.info(
            "worker session %d: model %s, %d KV slots, %d request slots, mode %s",
            *(info.epoch, info.model, info.kv_slots, running_cap, self.config.mode),
        )
        self.telemetry.worker_connected.set(1)
        self.telemetry.tracer.metadata(
            "worker_clock_offset", {"seconds": self._worker_clock_offset, "epoch": info.epoch}
        )
        self._broadcast_worker_state()
        self._work.set()
        return True

    def _check_model(self, info: WorkerInfo) -> None:
        """Live requests cannot be recomputed on another model: they fail."""
        identity = _model_identity(info)
        if self._model_identity is not None and self._model_identity != identity:
            self.policy.fail_all(f"the worker came back serving another model ({info.model})")
            self.outbox.flush()
        self._model_identity = identity

    async def _worker_lost(self, exc: Exception) -> None:
        """Every live request waits for the next session, to be recomputed from
        its prompt plus the tokens its frontend already has."""
        log.error("worker lost (%s); %d requests wait for a worker", exc, len(self.policy.requests))
        session, self.session = self.session, None
        self.telemetry.worker_connected.set(0)
        if self._lost_at is None:
            self._lost_at = time.time()
            retry = self.config.worker_retry_timeout_s
            self._expiry = asyncio.get_running_loop().call_later(retry, self._expire_if_lost_too_long)
        self.result_queue.clear()
        self._last_result = None
        self.policy.requeue_all()
        self._broadcast_worker_state()
        if session is not None:
            await session.close()

    def _broadcast_worker_state(self) -> None:
        for frontend in list(self.frontends):
            frontend.worker_state(self.info, self.ready)

    def _recovered(self) -> None:
        """The first result since the worker was lost: it is back."""
        self._lost_at = None
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None

    def _expire_if_lost_too_long(self) -> None:
        """Live requests end with UNAVAILABLE once the worker has been gone too long (counted
        from the first loss of a run of lost sessions, until one returns a result); requests
        that arrive later wait for a full timeout of their own."""
        retry = self.config.worker_retry_timeout_s
        if self._lost_at is not None:
            self.policy.fail_all(f"no worker for {retry:g}s (--worker-retry-timeout)")
            self.outbox.flush()
            self._lost_at = time.time()
            self._expiry = asyncio.get_running_loop().call_later(retry, self._expire_if_lost_too_long)


async def done_within(future: asyncio.Future[StepResult], seconds: float) -> bool:
    """Whether `future` is done within `seconds`; waiting never cancels it. What
    `asyncio.wait_for(asyncio.shield(future), seconds)` does, at about half its cost: every step
    waits once for its result."""
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()

    def wake(_: object) -> None:
        if not waiter.done():
            waiter.set_result(None)

    future.add_done_callback(wake)
    timer = loop.call_later(seconds, wake, None)
    try:
        await waiter
    finally:
        timer.cancel()
        future.remove_done_callback(wake)
    return future.done()


def _model_identity(info: WorkerInfo) -> tuple[str, int, tuple[int, ...], bytes]:
    """What must not change under a live request for its recompute to be the same."""
    return info.model, info.vocab_size, info.eos_token_ids, info.tokenizer.hf_json
