"""The scheduling policy: the thin facade the engine core drives, in the spirit of vLLM's
SchedulerInterface. Synchronous and free of gRPC and asyncio:

    add_request(req)                  admit into the waiting queue (or refuse)
    schedule() -> batch | None        pick the next batch under the token budget
    release_batch(), empty_batch()    row-less launches: released slots; a sign of life
    update_from_result(batch, ids)    apply a batch's sampled ids; outputs go to the outbox
    abort(rid) / abort_handle(...)    end requests; their slots are free at once
    abort_owner(owner)                end every request of a frontend that is gone
    begin_session(info)               fresh slot accounting for a new worker session
    requeue_all() / fail_all(why)     the session is lost: recompute every running request / fail all
    step_failed(batch, why)           the worker failed a step: narrow down the request that did it
    stats, occupancy()                counters; what is held now (GetServerInfo)
    requests, waiting, running, kv, req_slots, eos_token_ids, next_step_id    to read

The work is done by small managers, one concern each (as mini-sglang splits its scheduler):
`requests.py: RequestTable` (the live requests, the waiting queue, the running list),
`admission.py: AdmissionManager` (who of the waiting joins a batch, KV reserved incl. a reused
prefix), `running.py: RunningManager` (the running requests' rows; preemption),
`results.py: ResultProcessor` (sampled ids to tokens, token-level stops, the outbox) and
`slots.py: SessionSlots` (what a worker session lends: KV slots, asked of their one owner
`kv/manager.py: KvManager`, request slots; when they go back) and `quarantine.py: Quarantine`
(after a failed step, who may run while the request that failed it is found). The facade
composes them:
the step ids of launches, endings, worker sessions, gauges.

The engine core (`scheduler_svc/engine/core.py`) drives it from the serial or overlap loop.
Token-level stops (EOS, `stop_token_ids`, `max_new_tokens`) are decided here; stop
strings are the frontends' (they abort the request when they find one).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from scheduler_svc.contract import FinishReason, OutputSink
from scheduler_svc.engine.admission import AdmissionManager
from scheduler_svc.engine.batch import ScheduledBatch
from scheduler_svc.engine.kv.allocator import SlotAllocator
from scheduler_svc.engine.kv.manager import KvManager
from scheduler_svc.engine.outputs import Outbox
from scheduler_svc.engine.quarantine import Quarantine
from scheduler_svc.engine.request import Request
from scheduler_svc.engine.requests import RequestTable
from scheduler_svc.engine.results import ResultProcessor
from scheduler_svc.engine.running import RunningManager
from scheduler_svc.engine.slots import SessionSlots
from scheduler_svc.engine.telemetry import SchedulerTelemetry
from stepahead.protocol import Launch, StepLogprobs, WorkerInfo
from stepahead.speculative import SpeculativeConfig


@dataclass(frozen=True)
class PolicyConfig:
    max_batch_tokens: int = 512  # token budget of one step; longer prompts are chunked
    max_running: int = 0  # 0: as many as the worker has request slots
    max_waiting: int = 1024  # new requests beyond this many waiting ones are refused
    prefix_cache: bool = True  # reuse the KV of cached prefixes (scheduler_svc/engine/kv/prefix_cache.py)
    speculative: SpeculativeConfig | None = None  # decode rows verify drafts (docs/SPECULATIVE.md)
    # Up to this many rows, a step's plain decode rows are picked and applied a row at a time
    # through the `array` views of the columns: for a few rows that costs less than the numpy
    # operations, each a microsecond or more whatever its length (0: always a column at a time).
    small_batch: int = 48


@dataclass
class SchedulerStats:
    steps: int = 0
    preemptions: int = 0
    dropped_inflight_tokens: int = 0
    results_out_of_order: int = 0
    step_failures: int = 0  # steps the worker failed (`step_failed`)
    poison_requests: int = 0  # requests ended for failing steps alone (`quarantine.py`)


@dataclass(frozen=True)
class Occupancy:
    """What the policy holds at this moment, as GetServerInfo reports it."""

    kv_slots_free: int  # free, or held only by the prefix cache (evictable)
    request_slots_free: int
    request_slots: int
    running: int
    waiting: int
    prefix_cache_slots: int
    prefix_cache_hit_tokens: int


class Refused(Exception):
    """A request the policy does not take: `code` is a gRPC status name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class SchedulingPolicy:
    def __init__(self, config: PolicyConfig, outbox: Outbox, telemetry: SchedulerTelemetry) -> None:
        self.config = config
        self.outbox = outbox
        self.telemetry = telemetry
        self.stats = SchedulerStats()  # counters the tests and benchmarks read (`EngineCore.stats`)
        self.table = RequestTable()
        draft_tokens = 0 if config.speculative is None else config.speculative.num_speculative_tokens
        self.slots = SessionSlots(config.prefix_cache, telemetry, draft_tokens)
        self.admission = AdmissionManager(self.table, self.slots, telemetry)
        self.running_manager = RunningManager(
            self.table, self.slots, self.stats, telemetry, config.small_batch
        )
        self.results = ResultProcessor(
            self.slots, outbox, self.stats, telemetry, self._end, config.small_batch
        )
        self.quarantine = Quarantine(self.table, self.running_manager.requeue_for_recompute)
        self._next_step_id = 1
        # What it holds, read when /metrics is scraped rather than set at every step.
        telemetry.running.set_function(lambda: len(self.table.running))
        telemetry.waiting.set_function(lambda: self.num_waiting)
        telemetry.cache_slots.set_function(lambda: self.slots.kv.tree.size)
        telemetry.kv_usage.set_function(lambda: self.slots.kv.usage)

    # ---- what it holds, to read ----------------------------------------------------------

    @property
    def requests(self) -> dict[tuple[str, int], Request]:
        """The live requests by (request id, completion index)."""
        return self.table.requests

    @property
    def waiting(self) -> collections.deque[Request]:
        return self.table.waiting

    @property
    def running(self) -> list[Request]:
        return self.table.running

    @property
    def num_waiting(self) -> int:
        """Live requests without a request slot: the waiting queue's, and those parked by the
        quarantine."""
        return len(self.table.waiting) + len(self.quarantine.parked)

    @property
    def kv(self) -> KvManager:
        """The one owner of KV slots (this worker session's)."""
        return self.slots.kv

    @property
    def req_slots(self) -> SlotAllocator:
        return self.slots.req_slots

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.slots.eos_token_ids

    # ---- requests in and out ---------------------------------------------------------

    def add_request(self, req: Request) -> None:
        """Raises Refused for a live duplicate id or a full waiting queue."""
        if req.key in self.table.requests:
            raise Refused("ALREADY_EXISTS", f"request_id: {req.rid!r} is already live")
        if (waiting := self.num_waiting) >= self.config.max_waiting:  # before any work is spent on it
            raise Refused(
                "RESOURCE_EXHAUSTED", f"{waiting} requests are already waiting (--max-waiting); retry later"
            )
        self.table.add(req)

    def abort(self, rid: str) -> bool:
        """End a live request (every live completion of it) at once; its slots are reused
        safely (see `SessionSlots.release`)."""
        live = self.table.completions(rid)
        for req in live:
            self.finish(req, FinishReason.ABORT)
        return bool(live)

    def abort_handle(self, owner: OutputSink | None, handle: int) -> None:
        """The owning frontend ended the request (client gone, stop string): no output."""
        req = self.table.by_handle(owner, handle)
        if req is not None:
            self._end(req, FinishReason.ABORT)

    def abort_owner(self, owner: OutputSink) -> int:
        """Every request of a frontend that is gone; returns how many."""
        mine = self.table.owned_by(owner)
        for req in mine:
            self._end(req, FinishReason.ABORT)
        return len(mine)

    def has_work(self) -> bool:
        return bool(self.table.waiting or self.table.running or self.slots.has_releases)

    def occupancy(self) -> Occupancy:
        kv, req_slots = self.slots.kv, self.slots.req_slots
        return Occupancy(
            kv_slots_free=kv.reclaimable,
            request_slots_free=req_slots.num_free,
            request_slots=req_slots.capacity,
            running=len(self.table.running),
            waiting=self.num_waiting,
            prefix_cache_slots=kv.tree.size,
            prefix_cache_hit_tokens=kv.cached_prompt_tokens,
        )

    # ---- pick --------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch | None:
        """Decode and continue prefills of running requests (in arrival order),
        then admit waiting ones, all under the step's token budget."""
        if self.quarantine.active:
            self.quarantine.hold_back()
        batch = ScheduledBatch(Launch(step_id=self._next_step_id))
        budget = self.config.max_batch_tokens
        preempted = self.running_manager.pick(batch, budget)
        if not preempted:
            self.admission.admit(batch, budget - batch.num_tokens)
        if not batch.launch.num_rows:
            return None
        return self._seal(batch)

    def release_batch(self) -> ScheduledBatch | None:
        """A row-less launch that only tells the worker about released slots."""
        return self.empty_batch() if self.slots.has_releases else None

    def empty_batch(self) -> ScheduledBatch:
        """A row-less launch: released slots, if any; else only a sign of life for the worker."""
        return self._seal(ScheduledBatch(Launch(step_id=self._next_step_id)))

    def _seal(self, batch: ScheduledBatch) -> ScheduledBatch:
        batch.launch.released_slots = self.slots.take_releases()
        self._next_step_id += 1
        self.stats.steps += 1
        return batch

    @property
    def next_step_id(self) -> int:
        return self._next_step_id

    # ---- process -----------------------------------------------------------------------

    def update_from_result(
        self,
        batch: ScheduledBatch,
        token_ids: list[int],
        logprobs: StepLogprobs | None = None,
        grammar_finished: tuple[int, ...] = (),
        token_counts: tuple[int, ...] = (),
        drafts_found: tuple[bool, ...] = (),
        prompt_logprobs: StepLogprobs | None = None,
    ) -> None:
        """Apply the sampled ids of `batch` (and their log-probabilities, when the worker sent
        them; `token_counts`: each sampling row's, when a verify row emitted more than one): new
        tokens and token-level finishes (a finished grammar's among them) go to the outbox;
        `prompt_logprobs`: of the prompt positions the batch scored (`ScheduledBatch.scored`)."""
        if batch.scored:
            self.results.apply_scores(batch, prompt_logprobs)
        self.results.apply(batch, token_ids, logprobs, grammar_finished, token_counts, drafts_found)
        if self.quarantine.active:
            self.quarantine.check()

    def step_failed(self, batch: ScheduledBatch, why: str) -> None:
        """The worker failed `batch`'s step (its session ends with it): its live requests are the
        quarantine's suspects (`quarantine.py`). The request found to fail steps alone ends with
        INTERNAL and the worker's message, with the other completions of its call.

        NOTE: a row's request is the one in its request slot now; one that ended after the launch
        may have left its slot to a later request, which is then a suspect in its place."""
        self.stats.step_failures += 1
        self.telemetry.step_failures.inc()
        requests = self.slots.rows.requests
        members = [r for s in dict.fromkeys(batch.launch.row_req_slots) if (r := requests[s]) is not None]
        poison = self.quarantine.failed(members)
        if poison is None:
            return
        self.stats.poison_requests += 1
        self.telemetry.poison_requests.inc()
        for req in self.table.completions(poison.rid):
            self._fail(req, "INTERNAL", f"the worker failed every step of this request alone: {why}")

    # ---- endings -----------------------------------------------------------------------

    def finish(self, req: Request, reason: FinishReason) -> None:
        """End `req` and tell its frontend."""
        self.outbox.finish(req, reason)
        self._end(req, reason)

    def _end(self, req: Request, reason: FinishReason) -> None:
        """Its slots are freed now (`SessionSlots.release`) and it leaves the table."""
        req.finish_reason = reason
        self.slots.release(req)
        self.table.forget(req)
        self.quarantine.forget(req)

    # ---- worker sessions ---------------------------------------------------------------

    def begin_session(self, info: WorkerInfo) -> int:
        """Fresh slot accounting for a new worker session; returns the running cap."""
        running_cap = min(info.request_slots, self.config.max_running or info.request_slots)
        self.slots.begin(info, running_cap)  # the KV is gone
        self._next_step_id = 1
        return running_cap

    def requeue_all(self) -> None:
        """The worker session is gone: every running request waits to be recomputed
        (`RunningManager.requeue_all`)."""
        self.running_manager.requeue_all()

    def fail_all(self, why: str) -> None:
        """End every live request with UNAVAILABLE: none is dropped silently."""
        for req in list(self.table.requests.values()):
            self._fail(req, "UNAVAILABLE", why)
        self.table.clear_queues()
        self.quarantine.clear()

    def _fail(self, req: Request, code: str, why: str) -> None:
        """End `req` with an error (a gRPC status name): its client gets `code` and `why`."""
        self.slots.release(req, computed=False)
        self.table.forget(req)
        self.quarantine.forget(req)
        req.finish_reason = FinishReason.ABORT
        self.outbox.error(req, code, why)
