"""Admission: who of the waiting requests joins the next batch, first come, first served, and
with which first chunk; completions i > 0 of a call wait for completion 0's prompt to be cached;
KV is reserved for the first chunk past any cached prefix the request reuses (plus one slot per
running request for its next decode).
"""

from __future__ import annotations

import time

from scheduler_svc.engine.batch import ScheduledBatch
from scheduler_svc.engine.request import Request
from scheduler_svc.engine.requests import RequestTable
from scheduler_svc.engine.running import add_row
from scheduler_svc.engine.slots import SessionSlots
from scheduler_svc.engine.telemetry import SchedulerTelemetry


class AdmissionManager:
    def __init__(self, table: RequestTable, slots: SessionSlots, telemetry: SchedulerTelemetry) -> None:
        self.table = table
        self.slots = slots
        self.telemetry = telemetry

    def admit(self, batch: ScheduledBatch, budget: int) -> None:
        """First come, first served: stop at the first request that does not fit."""
        waiting, slots = self.table.waiting, self.slots
        now, prompt_tokens = time.time(), 0
        while waiting and budget > 0 and slots.req_slots.num_free:
            req = waiting[0]
            if self._waits_for_first_completion(req) or not self._reserve_kv(req, budget):
                break
            chunk = min(req.num_known - req.num_computed, budget)
            if req.first_scheduled_time is None:  # not again on a recompute
                req.first_scheduled_time = now
                self.telemetry.queue_time.observe(now - req.arrival_time)
                prompt_tokens += len(req.prompt_ids)
            slots.assign(req)
            self.table.start(req)
            batch.register(req, slots.eos_token_ids)
            add_row(slots.kv, batch, req, chunk)
            budget -= chunk
        if prompt_tokens:
            self.telemetry.prompt_tokens.inc(prompt_tokens)

    def _waits_for_first_completion(self, req: Request) -> bool:
        """Completion i > 0 of a call is admitted once completion 0's prompt is in the prefix
        cache (its first token processed), so that the n completions share the prompt's KV."""
        if not self.slots.kv.caching or req.index == 0 or req.attempt or req.params.computes_prompt:
            return False
        first = self.table.requests.get((req.rid, 0))
        return first is not None and first.req_slot is not None and not first.prompt_kept

    def _reserve_kv(self, req: Request, budget: int) -> bool:
        """Whether the waiting `req` fits: its first chunk past any cached prefix it reuses, and
        one KV slot per running request for its next decode. The prefix is locked first, so
        making room never evicts it; it is let go again when `req` does not fit."""
        kv = self.slots.kv
        reused = kv.reuse_prefix(req)
        chunk = min(req.num_known - req.num_computed, budget)
        if kv.make_room(chunk + len(self.table.running)):
            return True
        if reused:
            kv.release(req, computed=False)
            req.num_computed = 0
        return False
