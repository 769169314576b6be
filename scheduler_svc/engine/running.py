"""The running requests' rows of the next batch: a decode row, or the next chunk of a prefill,
for each running request in the order of the running list; and preemption when KV runs out
(the latest arrivals first: back to the head of the waiting queue, to be recomputed).
`add_row` puts any request's row in a batch; admission uses it for a first chunk.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from scheduler_svc.engine.batch import ScheduledBatch
from scheduler_svc.engine.kv.manager import KvManager
from scheduler_svc.engine.request import Request
from scheduler_svc.engine.requests import RequestTable
from scheduler_svc.engine.rows import Column, SlotRows
from scheduler_svc.engine.slots import SessionSlots
from scheduler_svc.engine.telemetry import SchedulerTelemetry

if TYPE_CHECKING:
    from scheduler_svc.engine.policy import SchedulerStats


class RunningManager:
    def __init__(
        self,
        table: RequestTable,
        slots: SessionSlots,
        stats: SchedulerStats,
        telemetry: SchedulerTelemetry,
        small_batch: int,
    ) -> None:
        """`small_batch`: up to this many running requests, a step of plain decodes is picked a
        row at a time (`_pick_small`), not a column at a time (`PolicyConfig.small_batch`)."""
        self.table = table
        self.slots = slots
        self.stats = stats
        self.telemetry = telemetry
        self.small_batch = small_batch
        self._slots_version = -1
        self._slots_cache = np.zeros(0, np.int64)

    def pick(self, batch: ScheduledBatch, budget: int) -> bool:
        """Decode and continue prefills of running requests, under the token budget. Returns
        whether KV ran out and requests were preempted."""
        if self._pick_decodes(batch, budget):
            return False
        preempted = False
        for req in list(self.table.running):
            if budget <= batch.num_tokens:
                break
            if req.req_slot is None:  # preempted earlier in this pick
                continue
            if req.wants_decode():
                need = 1 + req.next_drafts
            elif req.in_prefill:
                need = min(req.num_known - req.num_computed, budget - batch.num_tokens)
            else:
                continue
            if not self.slots.kv.make_room(need):
                preempted = True
                if not self._preempt_until_free(need, req):
                    break
            if req.in_prefill:
                add_row(self.slots.kv, batch, req, need)
            else:
                add_decode_row(self.slots, batch, req)
        return preempted

    def _pick_decodes(self, batch: ScheduledBatch, budget: int) -> bool:
        """The common step, column by column: each running request decodes, or continues a
        prefill (a prompt longer than a step's budget, or one of a burst of arrivals, is taken in
        chunks: those left after the step's decodes, in running order, share what the decodes
        leave of the budget), the decodes fit the budget and the whole step fits the KV slots
        free or evictable (no preemption). False when the step is not that one: then the rows are
        picked one by one."""
        running = self.table.running
        if not running:
            return True
        rows = self.slots.rows
        if len(running) <= self.small_batch and not rows.draft_tokens:
            return self._pick_small(batch, budget)
        slots = self._running_slots()
        computed = rows.computed_np[slots]
        known = rows.known_np[slots]
        pending = known + rows.inflight_np[slots]
        # wants_decode: its last sampled token is not in KV yet, and more tokens are allowed
        want = (computed == pending - 1) & (pending < rows.limit_np[slots])
        prefilling = computed < known
        chunks: list[int] = []  # in running order, those continuing a prefill (a few at most)
        rests: list[int] = []  # their prompts' tokens still to compute
        if np.count_nonzero(prefilling):
            want &= ~prefilling
            chunks = prefilling.nonzero()[0].tolist()
            rests = (known - computed)[prefilling].tolist()
        chosen = slots[want]
        n = tokens = len(chosen)
        drafts = rows.drafts_np[chosen] if rows.draft_tokens else None
        if drafts is not None:
            drafting = (rows.skip_np[chosen] == 0) & (rows.found_np[chosen] == 1)
            tokens += int(np.where(drafting, drafts, 0).sum())
        if tokens > budget:
            return False
        needs = _chunks(rests, budget - tokens)
        tokens += sum(needs)
        # Room for the whole step at once: evicting cached prefixes if the free slots fall short
        # (a pool full of them is a long-running server's usual state), nothing in vain.
        if not self.slots.kv.make_room(tokens):
            return False
        if drafts is not None and drafts.any():
            for i in np.flatnonzero(want).tolist():
                add_decode_row(self.slots, batch, running[i])
        elif n:
            kv = self.slots.kv.allocate_rows(rows, chosen)
            starts = computed[want].tolist()
            rows.computed_np[chosen] += 1
            rows.inflight_np[chosen] += 1
            batch.add_decodes(chosen, rows.tag_np[chosen], starts, kv)
        for i, need in zip(chunks, needs, strict=False):
            add_row(self.slots.kv, batch, running[i], need)
        return True

    def _pick_small(self, batch: ScheduledBatch, budget: int) -> bool:
        """`_pick_decodes` a row at a time, for a few running requests (no speculative decoding),
        where the array operations would cost more than the rows."""
        rows = self.slots.rows
        computed, inflight, known, limit = rows.computed, rows.inflight, rows.known, rows.limit
        chosen: list[int] = []
        starts: list[int] = []
        chunks: list[Request] = []  # those continuing a prefill
        rests: list[int] = []
        for req in self.table.running:
            slot = req.req_slot
            assert slot is not None
            done = computed[slot]
            if done < known[slot]:
                chunks.append(req)
                rests.append(known[slot] - done)
                continue
            pending = known[slot] + inflight[slot]
            if done == pending - 1 and pending < limit[slot]:
                chosen.append(slot)
                starts.append(done)
        if len(chosen) > budget:
            return False
        needs = _chunks(rests, budget - len(chosen))
        if not self.slots.kv.make_room(len(chosen) + sum(needs)):
            return False
        if chosen:
            kv = self.slots.kv.allocate_rows(rows, chosen)
            for slot in chosen:
                computed[slot] += 1
                inflight[slot] += 1
            batch.add_decodes(chosen, [rows.tag[slot] for slot in chosen], starts, kv)
        for req, need in zip(chunks, needs, strict=False):
            add_row(self.slots.kv, batch, req, need)
        return True

    def _running_slots(self) -> Column:
        """The running requests' request slots, in running order (rebuilt when the list changes)."""
        version = self.table.version
        if self._slots_version != version:
            self._slots_cache = np.array(self.table.running_slots, np.int64)
            self._slots_version = version
        return self._slots_cache

    def _preempt_until_free(self, need: int, req: Request) -> bool:
        """Preempt the latest arrivals until `need` KV slots are free; False if
        `req` itself had to go."""
        while not self.slots.kv.make_room(need):
            victim = self.table.running[-1]
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        self.stats.preemptions += 1
        self.telemetry.preemptions.inc()
        self.requeue_for_recompute(req)

    def requeue_for_recompute(self, req: Request, computed: bool = True) -> None:
        """Back to the head of the queue, to be recomputed from prompt + processed output.

        NOTE: its in-flight token is dropped (the attempt changes) and sampled
        again on recompute; greedy and seeded sampling give the same token.
        """
        self.slots.release(req, computed)
        req.attempt += 1
        req.num_computed = 0
        req.num_inflight = 0
        req.prompt_kept = False
        if not req.prompt_scores_sent:  # its prompt is scored again as it is recomputed
            req.prompt_scores = []
        self.table.requeue(req)

    def requeue_all(self) -> None:
        """The worker session is gone: every running request waits to be recomputed.

        NOTE: results of the lost session's batches never arrive (its stream is
        gone) and their requests' attempts change, so none of them is applied.
        """
        for req in reversed(list(self.table.running)):
            self.requeue_for_recompute(req, computed=False)


def _chunks(rests: list[int], budget: int) -> list[int]:
    """The next chunk of each prefill with `rests` tokens still to compute, in order, while
    `budget` lasts (fewer entries than `rests` when it runs out)."""
    needs = []
    for rest in rests:
        if budget <= 0:
            break
        need = min(rest, budget)
        needs.append(need)
        budget -= need
    return needs


DRAFT_BACKOFF_MAX = 32  # decode rows without drafts, at most, after verify rows that gained little


def add_decode_row(slots: SessionSlots, batch: ScheduledBatch, req: Request) -> None:
    """`req`'s decode row in `batch` (after `make_room(1 + req.next_drafts)` said yes): one
    token, or a verify row of its pending token and K drafts that the worker proposes.

    NOTE: a verify row emits 1 to K + 1 tokens, which the core learns only when it processes
    the row. Until then it counts one (`num_computed` and `num_inflight` count a lower bound, so
    `wants_decode` holds as for plain rows), and tells the worker a bound on the row's first
    position: the computed positions plus K for each row in flight (the worker holds the true
    one, for a decode row of a drafting request too).

    A request's decode row carries drafts only while the worker's lookup found some for it in
    the last step processed (`SlotRows.found`, from `StepResult.drafts_found`: every row of a
    drafting request is looked up, whether it carries drafts or not). And a request whose verify
    row accepted fewer than half its drafts takes its next decode rows without drafts, 1, 2, 4
    .. DRAFT_BACKOFF_MAX of them (`note_accepted`). On free text, where few drafts are found or
    accepted, a request decodes one token a step and spends little on drafts."""
    k = req.drafts
    bound = min(req.num_computed + k * req.num_inflight, slots.max_context_len - 1)
    if req.next_drafts:
        batch.add_verify(req, bound, slots.kv.allocate_verify(req, k))
    else:
        rows, slot = slots.rows, req.req_slot
        if k and rows.skip[slot]:  # type: ignore[index]
            rows.skip[slot] -= 1  # type: ignore[index]
        batch.add_decode(req, slots.kv.allocate(req, 1)[0], bound)
    req.num_computed += 1
    req.num_inflight += 1


def note_accepted(rows: SlotRows, slot: int, accepted: int) -> None:
    """A verify row of request slot `slot` accepted `accepted` of its K drafts. Fewer than half
    double the run of decode rows it takes without drafts next (up to DRAFT_BACKOFF_MAX); half
    or more end it.

    NOTE: a verify row computes K + 1 positions for 1 + accepted tokens. Where a forward's cost
    grows with its tokens (a CPU; a large batch on a GPU) a draft or two accepted does not pay
    for the rest, and on free text prompt lookup rarely finds more."""
    if 2 * accepted >= rows.drafts[slot]:
        rows.skip[slot] = rows.backoff[slot] = 0
        return
    run = min(max(1, 2 * rows.backoff[slot]), DRAFT_BACKOFF_MAX)
    rows.skip[slot] = rows.backoff[slot] = run


def add_row(kv: KvManager, batch: ScheduledBatch, req: Request, num_tokens: int) -> None:
    """`req`'s next `num_tokens` in `batch`, on new KV slots (after `kv.make_room` said yes): a
    prefill chunk (the chunk that ends what it knows samples), else a decode row."""
    kv_slots = kv.allocate(req, num_tokens)
    samples = True
    if req.in_prefill:
        start = req.num_computed
        samples = start + num_tokens == req.num_known
        batch.add_prefill(req, req.known_ids(start, start + num_tokens), kv_slots, samples)
    else:
        batch.add_decode(req, kv_slots[0])
    req.num_computed += num_tokens
    req.num_inflight += samples
