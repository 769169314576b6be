"""The scheduling policy: request table, queues, request-slot accounting; KV slots are asked of
the one owner of them (`kv/manager.py: KvManager`).

Synchronous and free of gRPC and asyncio, in the spirit of vLLM's SchedulerInterface:

    add_request(req)                  admit into the waiting queue (or refuse)
    schedule() -> batch | None        pick the next batch under the token budget
    update_from_result(batch, ids)    apply a batch's sampled ids; outputs go to the outbox
    abort(rid) / abort_handle(...)    end requests; their slots are free at once
    stats, occupancy()                counters; what is held now (GetServerInfo)

The engine core (`scheduler_svc/engine/core.py`) drives it from the serial or overlap loop.
Token-level stops (EOS, `stop_token_ids`, `max_new_tokens`) are decided here; stop
strings are the frontends' (they abort the request when they find one).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass

from scheduler_svc.contract import MAX_COMPLETIONS, FinishReason, OutputSink, TokenLogprob
from scheduler_svc.engine.batch import SampledRow, ScheduledBatch
from scheduler_svc.engine.kv.allocator import SlotAllocator
from scheduler_svc.engine.kv.manager import KvManager
from scheduler_svc.engine.outputs import Outbox
from scheduler_svc.engine.request import Request
from scheduler_svc.engine.telemetry import SchedulerTelemetry
from stepahead.protocol import Launch, StepLogprobs, WorkerInfo


@dataclass(frozen=True)
class PolicyConfig:
    max_batch_tokens: int = 512  # token budget of one step; longer prompts are chunked
    max_running: int = 0  # 0: as many as the worker has request slots
    max_waiting: int = 1024  # new requests beyond this many waiting ones are refused
    prefix_cache: bool = True  # reuse the KV of cached prefixes (scheduler_svc/engine/kv/prefix_cache.py)


@dataclass
class SchedulerStats:
    steps: int = 0
    preemptions: int = 0
    dropped_inflight_tokens: int = 0
    results_out_of_order: int = 0


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
        self.requests: dict[tuple[str, int], Request] = {}  # by (request id, completion index)
        self._by_handle: dict[tuple[OutputSink | None, int], Request] = {}
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.eos_token_ids: frozenset[int] = frozenset()
        self.kv = KvManager(0, config.prefix_cache, telemetry)  # the one owner of KV slots
        self.req_slots = SlotAllocator(0, "request slots")
        self._pending_releases: list[int] = []
        self._next_step_id = 1
        self._arrivals = 0

    # ---- requests in and out ---------------------------------------------------------

    def add_request(self, req: Request) -> None:
        """Raises Refused for a live duplicate id or a full waiting queue."""
        if req.key in self.requests:
            raise Refused("ALREADY_EXISTS", f"request_id: {req.rid!r} is already live")
        if len(self.waiting) >= self.config.max_waiting:  # before any work is spent on it
            raise Refused(
                "RESOURCE_EXHAUSTED",
                f"{len(self.waiting)} requests are already waiting (--max-waiting); retry later",
            )
        self._arrivals += 1
        req.arrival_seq = self._arrivals
        self.requests[req.key] = req
        self._by_handle[req.owner, req.handle] = req
        self.waiting.append(req)

    def abort(self, rid: str) -> bool:
        """End a live request (every live completion of it) at once; its slots are reused
        safely (see _release)."""
        live = [r for i in range(MAX_COMPLETIONS) if (r := self.requests.get((rid, i))) is not None]
        for req in live:
            self.finish(req, FinishReason.ABORT)
        return bool(live)

    def abort_handle(self, owner: OutputSink | None, handle: int) -> None:
        """The owning frontend ended the request (client gone, stop string): no output."""
        req = self._by_handle.get((owner, handle))
        if req is not None:
            self._end(req, FinishReason.ABORT)

    def abort_owner(self, owner: OutputSink) -> int:
        """Every request of a frontend that is gone; returns how many."""
        mine = [req for (o, _), req in self._by_handle.items() if o is owner]
        for req in mine:
            self._end(req, FinishReason.ABORT)
        return len(mine)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._pending_releases)

    def occupancy(self) -> Occupancy:
        return Occupancy(
            kv_slots_free=self.kv.reclaimable,
            request_slots_free=self.req_slots.num_free,
            request_slots=self.req_slots.capacity,
            running=len(self.running),
            waiting=len(self.waiting),
            prefix_cache_slots=self.kv.tree.size,
            prefix_cache_hit_tokens=self.kv.cached_prompt_tokens,
        )

    # ---- pick --------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch | None:
        """Decode and continue prefills of running requests (in arrival order),
        then admit waiting ones, all under the step's token budget."""
        batch = ScheduledBatch(Launch(step_id=self._next_step_id))
        budget = self.config.max_batch_tokens
        preempted = self._schedule_running(batch, budget)
        if not preempted:
            self._admit_waiting(batch, budget - batch.num_tokens)
        self.update_gauges()
        if not batch.launch.num_rows:
            return None
        return self._seal(batch)

    def release_batch(self) -> ScheduledBatch | None:
        """A row-less launch that only tells the worker about released slots."""
        return self.empty_batch() if self._pending_releases else None

    def empty_batch(self) -> ScheduledBatch:
        """A row-less launch: released slots, if any; else only a sign of life for the worker."""
        return self._seal(ScheduledBatch(Launch(step_id=self._next_step_id)))

    def _seal(self, batch: ScheduledBatch) -> ScheduledBatch:
        batch.launch.released_slots, self._pending_releases = self._pending_releases, []
        self._next_step_id += 1
        self.stats.steps += 1
        return batch

    @property
    def next_step_id(self) -> int:
        return self._next_step_id

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
            if not self.kv.make_room(need):
                preempted = True
                if not self._preempt_until_free(need, req):
                    break
            self._add_row(batch, req, need)
        return preempted

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        """First come, first served: stop at the first request that does not fit."""
        while self.waiting and budget > 0 and self.req_slots.num_free:
            req = self.waiting[0]
            if self._waits_for_first_completion(req) or not self._reserve_kv(req, budget):
                break
            self.waiting.popleft()
            chunk = min(req.num_known - req.num_computed, budget)
            self._note_first_scheduled(req)
            req.req_slot = self.req_slots.allocate_one()
            self.running.append(req)
            batch.register(req, self.eos_token_ids)
            self._add_row(batch, req, chunk)
            budget -= chunk

    def _waits_for_first_completion(self, req: Request) -> bool:
        """Completion i > 0 of a call is admitted once completion 0's prompt is in the prefix
        cache (its first token processed), so that the n completions share the prompt's KV."""
        if not self.kv.caching or req.index == 0 or req.attempt or req.params.penalized:
            return False
        first = self.requests.get((req.rid, 0))
        return first is not None and first.req_slot is not None and not first.prompt_kept

    def _reserve_kv(self, req: Request, budget: int) -> bool:
        """Whether the waiting `req` fits: its first chunk past any cached prefix it reuses, and
        one KV slot per running request for its next decode. The prefix is locked first, so
        making room never evicts it; it is let go again when `req` does not fit."""
        reused = self.kv.reuse_prefix(req)
        chunk = min(req.num_known - req.num_computed, budget)
        if self.kv.make_room(chunk + len(self.running)):
            return True
        if reused:
            self.kv.release(req, computed=False)
            req.num_computed = 0
        return False

    def _note_first_scheduled(self, req: Request) -> None:
        if req.first_scheduled_time is None:  # not again on a recompute
            req.first_scheduled_time = time.time()
            self.telemetry.queue_time.observe(req.first_scheduled_time - req.arrival_time)
            self.telemetry.prompt_tokens.inc(len(req.prompt_ids))

    def _add_row(self, batch: ScheduledBatch, req: Request, num_tokens: int) -> None:
        kv_slots = self.kv.allocate(req, num_tokens)
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
        while not self.kv.make_room(need):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        self.stats.preemptions += 1
        self.telemetry.preemptions.inc()
        self._requeue_for_recompute(req)

    def _requeue_for_recompute(self, req: Request, computed: bool = True) -> None:
        """Back to the head of the queue, to be recomputed from prompt + processed output.

        NOTE: its in-flight token is dropped (the attempt changes) and sampled
        again on recompute; greedy and seeded sampling give the same token.
        """
        self._release(req, computed)
        self.running.remove(req)
        req.attempt += 1
        req.num_computed = 0
        req.num_inflight = 0
        req.prompt_kept = False
        self.waiting.appendleft(req)

    # ---- process -----------------------------------------------------------------------

    def update_from_result(
        self, batch: ScheduledBatch, token_ids: list[int], logprobs: StepLogprobs | None = None
    ) -> None:
        """Apply the sampled ids of `batch` (and their log-probabilities, when the worker sent
        them): new tokens and token-level finishes go to the outbox."""
        for i, (row, token) in enumerate(zip(batch.sampled, token_ids, strict=True)):
            self._process_row(row, token, _row_logprob(logprobs, i, row.request))
        self.update_gauges()

    def _process_row(self, row: SampledRow, token: int, logprob: TokenLogprob | None) -> None:
        req = row.request
        if req.finished or row.attempt != req.attempt:
            # Finished (or preempted) while this batch was in flight: never streamed.
            self.stats.dropped_inflight_tokens += 1
            self.telemetry.dropped_inflight_tokens.inc()
            return
        req.num_inflight -= 1
        req.output_ids.append(token)
        if not req.prompt_kept:  # its prefill is computed: later arrivals may reuse it
            self.kv.keep(req, min(req.num_computed, req.num_known))
            req.prompt_kept = True
        finish = self._token_finish(req, token)
        first = req.cached_prompt_tokens if len(req.output_ids) == 1 else None
        self.outbox.token(req, token, finish, logprob, first)
        if finish is not None:
            self._end(req, finish)

    def _token_finish(self, req: Request, token: int) -> FinishReason | None:
        p = req.params
        is_stop = token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids)
        # NOTE: the worker masks stop ids below min_tokens; a backend that does not (sim) may
        # still sample one, and then it is an ordinary token.
        if is_stop and p.stop_finishes(len(req.output_ids) - 1):
            return FinishReason.STOP
        if len(req.output_ids) >= p.max_new_tokens:
            return FinishReason.LENGTH
        return None

    def update_gauges(self) -> None:
        t = self.telemetry
        t.running.set(len(self.running))
        t.waiting.set(len(self.waiting))
        t.cache_slots.set(self.kv.tree.size)
        if self.kv.capacity:  # slots only the prefix cache holds are free for the asking
            t.kv_usage.set(self.kv.usage)

    # ---- endings -----------------------------------------------------------------------

    def finish(self, req: Request, reason: FinishReason) -> None:
        """End `req` and tell its frontend."""
        self.outbox.finish(req, reason)
        self._end(req, reason)

    def _end(self, req: Request, reason: FinishReason) -> None:
        req.finish_reason = reason
        self._release(req)
        self._forget(req)

    def _release(self, req: Request, computed: bool = True) -> None:
        """Free the request's slots now, even if a batch in flight still holds it; the prefix
        cache keeps what it computed (unless the worker session that holds its KV is gone).

        NOTE: safe because the worker runs batches in launch order: every batch
        that can reuse these slots runs after the in-flight ones that hold them.
        """
        if req.req_slot is not None:
            self.req_slots.free([req.req_slot])
            self._pending_releases.append(req.req_slot)
            req.req_slot = None
        self.kv.release(req, computed)

    def _forget(self, req: Request) -> None:
        self.requests.pop(req.key, None)
        self._by_handle.pop((req.owner, req.handle), None)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    # ---- worker sessions ---------------------------------------------------------------

    def begin_session(self, info: WorkerInfo) -> int:
        """Fresh slot accounting for a new worker session; returns the running cap."""
        running_cap = min(info.request_slots, self.config.max_running or info.request_slots)
        self.kv = KvManager(info.kv_slots, self.config.prefix_cache, self.telemetry)  # the KV is gone
        self.req_slots = SlotAllocator(running_cap, "request slots")
        self.eos_token_ids = frozenset(info.eos_token_ids)
        self._pending_releases = []
        self._next_step_id = 1
        return running_cap

    def requeue_all(self) -> None:
        """The worker session is gone: every running request waits to be recomputed.

        NOTE: results of the lost session's batches never arrive (its stream is
        gone) and their requests' attempts change, so none of them is applied.
        """
        for req in reversed(list(self.running)):
            self._requeue_for_recompute(req, computed=False)

    def fail_all(self, why: str) -> None:
        """End every live request with UNAVAILABLE: none is dropped silently."""
        for req in list(self.requests.values()):
            self._release(req, computed=False)
            self._forget(req)
            req.finish_reason = FinishReason.ABORT
            self.outbox.error(req, "UNAVAILABLE", why)
        self.running.clear()
        self.waiting.clear()


def _row_logprob(logprobs: StepLogprobs | None, i: int, req: Request) -> TokenLogprob | None:
    """Row i's log-probabilities, cut to what its request asked for (None: it asked none)."""
    if logprobs is None or not req.params.logprobs:
        return None
    chosen, top_ids, top_logprobs = logprobs.row(i, req.params.top_logprobs)
    return TokenLogprob(chosen, tuple(top_ids), tuple(top_logprobs))
