"""The scheduler: request table, batching, slot accounting and the two loops.

Each loop iteration is the seed's steps, one method each:
  pick_batch -> launch_step -> queue_result -> process_results
The serial loop processes batch k right after launching it; the overlap loop
processes batch k-1 after launching batch k, while the worker runs k.
Both use the same batching policy and the same FutureMap relay.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import grpc

from scheduler_svc.allocator import SlotAllocator
from scheduler_svc.batch import SampledRow, ScheduledBatch
from scheduler_svc.late_pick import LatePick, LatePickConfig
from scheduler_svc.request import FinishReason, Request, SamplingParams
from scheduler_svc.telemetry import SchedulerTelemetry
from scheduler_svc.text import RequestText
from scheduler_svc.tokenizer import Tokenizer, load_tokenizer
from scheduler_svc.transport import WorkerTransport, WorkerUnavailable
from stepahead.protocol import Launch, StepResult, WorkerInfo, WorkerStepError

log = logging.getLogger("stepahead.scheduler")

Mode = Literal["overlap", "serial"]
StepHandle = asyncio.Future[StepResult]


@dataclass(frozen=True)
class SchedulerConfig:
    mode: Mode = "overlap"
    max_batch_tokens: int = 512  # token budget of one step; longer prompts are chunked
    max_running: int = 0  # 0: as many as the worker has request slots
    reconnect_backoff_s: tuple[float, float] = (0.1, 2.0)
    worker_retry_timeout_s: float = 30.0  # live requests wait this long for a worker to come back
    max_waiting: int = 1024  # new requests beyond this many waiting ones are refused
    late_pick: LatePickConfig = field(default_factory=LatePickConfig)


@dataclass
class SchedulerStats:
    steps: int = 0
    preemptions: int = 0
    dropped_inflight_tokens: int = 0
    results_out_of_order: int = 0


class SchedulerNotReady(RuntimeError):
    """No worker session yet (or it was lost)."""


class Scheduler:
    def __init__(
        self, transport: WorkerTransport, config: SchedulerConfig, telemetry: SchedulerTelemetry | None = None
    ) -> None:
        self.transport = transport
        self.config = config
        self.telemetry = telemetry or SchedulerTelemetry(config.mode)
        self.stats = SchedulerStats()
        self.requests: dict[str, Request] = {}
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        # NOTE: holds at most one entry whenever a batch is picked.
        self.result_queue: collections.deque[tuple[ScheduledBatch, StepHandle]] = collections.deque()
        self.info: WorkerInfo | None = None
        self.tokenizer: Tokenizer | None = None
        self.kv = SlotAllocator(0, "kv slots")
        self.req_slots = SlotAllocator(0, "request slots")
        self.on_ready: Callable[[bool], None] = lambda ready: None
        self._pending_releases: list[int] = []
        self._next_step_id = 1
        self._arrivals = 0
        self._work = asyncio.Event()
        self._closing = False
        self._worker_clock_offset = 0.0  # worker clock minus ours
        self._lost_at: float | None = None  # when the worker session was lost
        self._model_identity: tuple[str, int, tuple[int, ...], bytes] | None = None
        self.late_pick = LatePick(config.late_pick)
        self.idle = False  # parked with nothing live, in flight, or unreleased

    # ---- requests in and out ---------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.info is not None

    @property
    def overloaded(self) -> bool:
        """The waiting queue is full: admitted requests keep their latency, new ones are refused."""
        return len(self.waiting) >= self.config.max_waiting

    def new_request(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> Request:
        if self.tokenizer is None:
            raise SchedulerNotReady("the worker is not connected")
        self._arrivals += 1
        return Request(rid, prompt_ids, params, self._arrivals, RequestText(self.tokenizer, params.stop))

    def add_request(self, req: Request) -> None:
        assert req.rid not in self.requests, "the server checks request ids"
        self.requests[req.rid] = req
        self.waiting.append(req)
        self._work.set()

    def abort(self, rid: str) -> bool:
        """End a live request at once; its slots are reused safely (see _release)."""
        req = self.requests.get(rid)
        if req is None:
            return False
        self._finish(req, FinishReason.ABORT)
        self._work.set()
        return True

    # ---- the loops ---------------------------------------------------------------------

    async def run(self) -> None:
        """Serve until close(): connect, loop, and start over if the worker is lost."""
        while not self._closing:
            await self._connect_with_backoff()
            try:
                await (self._overlap_loop() if self.config.mode == "overlap" else self._serial_loop())
            except (WorkerUnavailable, WorkerStepError) as exc:
                self._worker_lost(exc)
            except Exception as exc:  # a bug must not stop serving silently: start a new session
                log.exception("scheduler loop failed; starting a new worker session")
                await self.transport.close()
                self._worker_lost(exc)

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
            if len(self.result_queue) > 1 or (batch is None and self.result_queue):
                await self.process_results(*self.result_queue.popleft())
                await self._until_late_pick()
            elif batch is None:
                await self._wait_for_work()

    async def _until_late_pick(self) -> None:
        """Hold the pick of k+1 until shortly before forward k ends (see LatePick)."""
        if len(self.result_queue) != 1:
            return
        in_flight, handle = self.result_queue[0]
        worker_now = time.time() + self._worker_clock_offset
        delay = self.late_pick.delay(in_flight.num_tokens, worker_now, self._next_step_id)
        if delay > 0:
            await asyncio.wait({handle}, timeout=delay)

    async def _wait_for_work(self) -> None:
        """Idle: first tell the worker about released slots, then sleep until work comes."""
        if self._pending_releases:
            batch = ScheduledBatch(Launch(step_id=self._take_step_id()))
            await self.process_results(batch, await self.launch_step(batch))
            return
        self._work.clear()
        self.idle = True
        await self._work.wait()
        self.idle = False

    def _take_step_id(self) -> int:
        self._next_step_id += 1
        return self._next_step_id - 1

    # ---- step 1: pick ------------------------------------------------------------------

    def pick_batch(self) -> ScheduledBatch | None:
        """Decode and continue prefills of running requests (in arrival order),
        then admit waiting ones, all under the step's token budget."""
        with self.telemetry.phase("pick", self._next_step_id):
            batch = ScheduledBatch(Launch(step_id=self._next_step_id))
            budget = self.config.max_batch_tokens
            preempted = self._schedule_running(batch, budget)
            if not preempted:
                self._admit_waiting(batch, budget - batch.num_tokens)
            self._update_gauges()
        if not batch.launch.num_rows:
            return None
        self._take_step_id()
        self.telemetry.observe_batch(batch.forward_mode, batch.launch.num_rows, batch.num_tokens)
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> bool:
        """Returns whether KV ran out and requests were preempted."""
        preempted = False
        for req in list(self.running):
            if budget <= batch.num_tokens:
                break
            if req.req_slot is None:  # preempted earlier in this pick
                continue
            if req.wants_decode():
                need = 1
            elif req.in_prefill:
                need = min(req.num_known - req.num_computed, budget - batch.num_tokens)
            else:
                continue
            if not self.kv.can_allocate(need):
                preempted = True
                if not self._preempt_until_free(need, req):
                    break
            self._add_row(batch, req, need)
        return preempted

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        """First come, first served: stop at the first request that does not fit."""
        while self.waiting and budget > 0 and self.req_slots.num_free:
            req = self.waiting[0]
            chunk = min(req.num_known, budget)
            # Leave one KV slot per running request for its next decode.
            if not self.kv.can_allocate(chunk + len(self.running)):
                break
            self.waiting.popleft()
            self._note_first_scheduled(req)
            req.req_slot = self.req_slots.allocate_one()
            self.running.append(req)
            batch.register(req)
            self._add_row(batch, req, chunk)
            budget -= chunk

    def _note_first_scheduled(self, req: Request) -> None:
        if req.first_scheduled_time is None:  # not again on a recompute
            req.first_scheduled_time = time.time()
            self.telemetry.queue_time.observe(req.first_scheduled_time - req.arrival_time)
            self.telemetry.prompt_tokens.inc(len(req.prompt_ids))

    def _add_row(self, batch: ScheduledBatch, req: Request, num_tokens: int) -> None:
        kv_slots = self.kv.allocate(num_tokens)
        req.kv_slots.extend(kv_slots)
        samples = True
        if req.in_prefill:
            start = req.num_computed
            samples = start + num_tokens == req.num_known
            batch.add_prefill(req, req.known_ids(start, start + num_tokens), kv_slots, samples)
        else:
            batch.add_decode(req, kv_slots[0])
        req.num_computed += num_tokens
        req.num_inflight += samples

    def _preempt_until_free(self, need: int, req: Request) -> bool:
        """Preempt the latest arrivals until `need` KV slots are free; False if
        `req` itself had to go."""
        while not self.kv.can_allocate(need):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        self.stats.preemptions += 1
        self.telemetry.preemptions.inc()
        self._requeue_for_recompute(req)

    def _requeue_for_recompute(self, req: Request) -> None:
        """Back to the head of the queue, to be recomputed from prompt + processed output.

        NOTE: its in-flight token is dropped (the attempt changes) and sampled
        again on recompute; greedy and seeded sampling give the same token.
        """
        self._release(req)
        self.running.remove(req)
        req.attempt += 1
        req.num_computed = 0
        req.num_inflight = 0
        self.waiting.appendleft(req)

    # ---- step 2: launch ----------------------------------------------------------------

    async def launch_step(self, batch: ScheduledBatch) -> StepHandle:
        """Send the batch; returns at once with a handle on its result."""
        with self.telemetry.phase("launch", batch.step_id):
            assert self.info is not None
            batch.epoch = self.info.epoch
            batch.launch.released_slots = self._pending_releases
            self._pending_releases = []
            self.stats.steps += 1
            sent = time.time()
            handle = await self.transport.launch(batch.launch)
        handle.add_done_callback(lambda _: self.telemetry.worker_latency.observe(time.time() - sent))
        return handle

    # ---- step 3: queue -----------------------------------------------------------------

    def queue_result(self, batch: ScheduledBatch, handle: StepHandle) -> None:
        self.result_queue.append((batch, handle))
        self.telemetry.observe_result_queue(len(self.result_queue))

    # ---- step 4: process ---------------------------------------------------------------

    async def process_results(self, batch: ScheduledBatch, handle: StepHandle) -> None:
        """Wait for the batch's tokens, then update requests, check stops, stream."""
        self.telemetry.observe_result_queue(len(self.result_queue))
        with self.telemetry.phase("wait", batch.step_id):
            result = await handle
        if (result.step_id, result.epoch) != (batch.step_id, batch.epoch):
            self.stats.results_out_of_order += 1
            raise WorkerUnavailable(
                f"result of step {result.step_id} (session {result.epoch}) for step {batch.step_id} "
                f"(session {batch.epoch}): never applied"
            )
        self.late_pick.observe(batch.num_tokens, result)
        with self.telemetry.phase("process", batch.step_id):
            now = time.time()
            for row, token in zip(batch.sampled, result.token_ids, strict=True):
                self._process_row(row, token, now)
            self._update_gauges()

    def _process_row(self, row: SampledRow, token: int, now: float) -> None:
        req = row.request
        if req.finished or row.attempt != req.attempt:
            # Finished (or preempted) while this batch was in flight: never streamed.
            self.stats.dropped_inflight_tokens += 1
            self.telemetry.dropped_inflight_tokens.inc()
            return
        req.num_inflight -= 1
        req.output_ids.append(token)
        self._note_token_time(req, now)
        if self._is_stop_token(req, token):
            req.stream.put(token, "")
            self._finish(req, FinishReason.STOP)
            return
        text, stopped = req.text.push(token)
        req.stream.put(token, text)
        if stopped:
            self._finish(req, FinishReason.STOP)
        elif len(req.output_ids) >= req.params.max_new_tokens:
            self._finish(req, FinishReason.LENGTH)

    def _note_token_time(self, req: Request, now: float) -> None:
        t = self.telemetry
        if req.last_token_time is None:
            t.ttft.observe(now - req.arrival_time)
        else:
            t.itl.observe(now - req.last_token_time)
        req.last_token_time = now
        t.generation_tokens.inc()

    def _update_gauges(self) -> None:
        t = self.telemetry
        t.running.set(len(self.running))
        t.waiting.set(len(self.waiting))
        if self.kv.capacity:
            t.kv_usage.set(self.kv.num_used / self.kv.capacity)

    def _is_stop_token(self, req: Request, token: int) -> bool:
        assert self.info is not None
        if token in req.params.stop_token_ids:
            return True
        return not req.params.ignore_eos and token in self.info.eos_token_ids

    # ---- endings -----------------------------------------------------------------------

    def _finish(self, req: Request, reason: FinishReason) -> None:
        stopped_on_string = reason == FinishReason.STOP and req.text.stopped
        if not stopped_on_string:
            req.stream.put_text(req.text.finish())
        req.finish_reason = reason
        self._release(req)
        self._forget(req)
        req.stream.close(reason)
        self.telemetry.finished[reason.name.lower()].inc()
        self.telemetry.e2e.observe(time.time() - req.arrival_time)

    def _release(self, req: Request) -> None:
        """Free the request's slots now, even if a batch in flight still holds it.

        NOTE: safe because the worker runs batches in launch order: every batch
        that can reuse these slots runs after the in-flight ones that hold them.
        """
        if req.req_slot is not None:
            self.req_slots.free([req.req_slot])
            self._pending_releases.append(req.req_slot)
            req.req_slot = None
        if req.kv_slots:
            self.kv.free(req.kv_slots)
            req.kv_slots = []

    def _forget(self, req: Request) -> None:
        self.requests.pop(req.rid, None)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    # ---- the worker session ------------------------------------------------------------

    async def _connect_with_backoff(self) -> None:
        delay, max_delay = self.config.reconnect_backoff_s
        while not self._closing:
            try:
                self._start_session(await self.transport.connect())
                return
            except WorkerUnavailable as exc:
                level = logging.WARNING if delay >= max_delay else logging.INFO
                log.log(level, "waiting for the worker (%s); retrying in %.1fs", exc, delay)
                self._expire_if_lost_too_long()
                await asyncio.sleep(delay)
                delay = min(delay * 2, max_delay)

    def _start_session(self, info: WorkerInfo) -> None:
        # First, before anything slow: the one-way delay of the Welcome is ignored.
        self._worker_clock_offset = info.worker_unix_time - time.time()
        if self._model_identity is not None and self._model_identity != _model_identity(info):
            self._fail_all(f"the worker came back serving another model ({info.model})")
            self.tokenizer = None
        self._model_identity = _model_identity(info)
        self._lost_at = None
        self.info = info
        if self.tokenizer is None:
            spec = info.tokenizer
            self.tokenizer = load_tokenizer(
                spec.kind, spec.hf_json, info.vocab_size, info.bos_token_id, info.eos_token_ids
            )
        running_cap = min(info.request_slots, self.config.max_running or info.request_slots)
        self.kv = SlotAllocator(info.kv_slots, "kv slots")
        self.req_slots = SlotAllocator(running_cap, "request slots")
        self._pending_releases = []
        self._next_step_id = 1
        log.info(
            "worker session %d: model %s, %d KV slots, %d request slots, mode %s",
            info.epoch,
            info.model,
            info.kv_slots,
            running_cap,
            self.config.mode,
        )
        self.telemetry.worker_connected.set(1)
        self.late_pick = LatePick(self.config.late_pick)
        self.telemetry.tracer.metadata(
            "worker_clock_offset", {"seconds": self._worker_clock_offset, "epoch": info.epoch}
        )
        self.on_ready(True)

    def _worker_lost(self, exc: Exception) -> None:
        """Every live request waits for the next session, to be recomputed from
        its prompt plus the tokens its client already has.

        NOTE: results of the lost session's batches never arrive (its stream is
        gone) and their requests' attempts change, so none of them is applied.
        """
        log.error("worker lost (%s); %d requests wait for a worker", exc, len(self.requests))
        self.telemetry.worker_connected.set(0)
        self.on_ready(False)
        self.info = None
        self._lost_at = self._lost_at or time.time()
        self.result_queue.clear()
        for req in reversed(list(self.running)):
            self._requeue_for_recompute(req)

    def _expire_if_lost_too_long(self) -> None:
        if self._lost_at is not None and time.time() - self._lost_at > self.config.worker_retry_timeout_s:
            self._fail_all(f"no worker for {self.config.worker_retry_timeout_s:.0f}s")

    def _fail_all(self, why: str) -> None:
        """End every live request with UNAVAILABLE: none is dropped silently."""
        for req in list(self.requests.values()):
            self._forget(req)
            req.stream.fail(grpc.StatusCode.UNAVAILABLE, why)
            self.telemetry.finished["error"].inc()
        self.running.clear()
        self.waiting.clear()


def _model_identity(info: WorkerInfo) -> tuple[str, int, tuple[int, ...], bytes]:
    """What must not change under a live request for its recompute to be the same."""
    return info.model, info.vocab_size, info.eos_token_ids, info.tokenizer.hf_json


def random_seed() -> int:
    return random.SystemRandom().getrandbits(63)
