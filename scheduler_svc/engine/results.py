"""Applying a step's sampled ids: each row's token joins its request's output (or is dropped,
when the request ended or was preempted while the batch was in flight), its prompt's KV goes to
the prefix cache, token-level stops (EOS, `stop_token_ids`, `max_new_tokens`) are decided, and
tokens, log-probabilities and finishes go to the outbox. Stop strings are the frontends'.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from scheduler_svc.contract import FinishReason, TokenLogprob
from scheduler_svc.engine.batch import ScheduledBatch
from scheduler_svc.engine.outputs import Outbox
from scheduler_svc.engine.request import Request
from scheduler_svc.engine.rows import Column
from scheduler_svc.engine.running import note_accepted
from scheduler_svc.engine.slots import SessionSlots
from scheduler_svc.engine.telemetry import SchedulerTelemetry
from stepahead.protocol import StepLogprobs

if TYPE_CHECKING:
    from scheduler_svc.engine.policy import SchedulerStats


_STOP, _LENGTH = int(FinishReason.STOP), int(FinishReason.LENGTH)


class ResultProcessor:
    def __init__(
        self,
        slots: SessionSlots,
        outbox: Outbox,
        stats: SchedulerStats,
        telemetry: SchedulerTelemetry,
        end: Callable[[Request, FinishReason], None],
        small_batch: int,
    ) -> None:
        """`small_batch`: up to this many sampled rows, plain rows are applied a row at a time
        (`_apply_small`), not a column at a time (`PolicyConfig.small_batch`)."""
        self.slots = slots
        self.outbox = outbox
        self.stats = stats
        self.telemetry = telemetry
        self._end = end  # ends a finished request: its slots are freed, it leaves the table
        self.small_batch = small_batch

    def apply(
        self,
        batch: ScheduledBatch,
        token_ids: Sequence[int],
        logprobs: StepLogprobs | None,
        grammar_finished: tuple[int, ...] = (),
        token_counts: tuple[int, ...] = (),
        drafts_found: tuple[bool, ...] = (),
    ) -> None:
        """Apply the sampled ids of `batch` (and their log-probabilities, when the worker sent
        them); rows in `grammar_finished` end their request (STOP) after their token.
        `token_counts`: the tokens each sampling row emitted, when the batch has verify rows;
        `drafts_found`: with them, whether the worker's lookup found drafts for each row.

        Plain rows (a request still running since the batch was launched, without
        log-probabilities or stop ids of its own) are applied a column at a time, a first token
        of an attempt among them (its prompt's KV goes to the prefix cache, row by row); the
        others one by one (`_process_row`, `_process_verified`)."""
        if token_counts or batch.verifying or drafts_found:
            self._apply_counted(batch, token_ids, logprobs, grammar_finished, token_counts, drafts_found)
            return
        if len(token_ids) != batch.num_sampled:
            raise ValueError(f"{len(token_ids)} sampled ids for {batch.num_sampled} sampling rows")
        if not token_ids:
            return
        rows = self.slots.rows
        small = len(token_ids) <= self.small_batch and not grammar_finished
        if small and self._apply_small(batch.sampled_slots, batch.sampled_tags, list(token_ids)):
            return
        slots, tags = batch.sampled_columns()
        tokens = np.array(token_ids, np.int64)
        plain = (rows.tag_np[slots] == tags) & (rows.plain_np[slots] == 1)
        if grammar_finished:
            plain[list(grammar_finished)] = False
        if np.count_nonzero(plain) == len(plain):
            self._apply_plain(slots, tokens)
            return
        index = plain.nonzero()[0]
        if len(index):
            self._apply_plain(slots[index], tokens[index])
        finished = set(grammar_finished)
        for i in (~plain).nonzero()[0].tolist():
            slot, tag = batch.sampled_slots[i], batch.sampled_tags[i]
            self._process_row(slot, tag, token_ids[i], logprobs, i, i in finished)

    def apply_scores(self, batch: ScheduledBatch, scores: StepLogprobs | None) -> None:
        """The prompt positions `batch` scored join their requests' `prompt_scores` (a row whose
        request has since ended or been preempted is dropped, as its tokens are)."""
        expected = sum(count for _, _, count in batch.scored)
        got = 0 if scores is None else len(scores.chosen)
        if scores is None or got != expected:
            raise ValueError(f"{got} prompt log-probabilities for {expected} scored prompt positions")
        rows, at = self.slots.rows, 0
        for slot, tag, count in batch.scored:
            if rows.tag[slot] == tag:
                req = self._request(slot)
                asked = req.params.prompt_logprobs or 0  # of the launch's widest score_top_n
                req.prompt_scores.extend(
                    TokenLogprob(chosen, tuple(top_ids), tuple(top_logprobs))
                    for chosen, top_ids, top_logprobs in (scores.row(i, asked) for i in range(at, at + count))
                )
            at += count

    def _apply_counted(
        self,
        batch: ScheduledBatch,
        token_ids: Sequence[int],
        logprobs: StepLogprobs | None,
        grammar_finished: tuple[int, ...],
        token_counts: tuple[int, ...],
        drafts_found: tuple[bool, ...] = (),
    ) -> None:
        """A batch with verify rows: row i emitted token_counts[i] of `token_ids`, in row order;
        drafts_found[i]: the worker's lookup found drafts for its request (None: not told)."""
        counts = token_counts or (1,) * batch.num_sampled
        if len(counts) != batch.num_sampled or sum(counts) != len(token_ids):
            raise ValueError(
                f"{len(token_ids)} ids in {len(counts)} counts for {batch.num_sampled} sampling rows"
            )
        finished = set(grammar_finished)
        rows = self.slots.rows
        at = 0
        for i, n in enumerate(counts):
            slot, tag = batch.sampled_slots[i], batch.sampled_tags[i]
            found = drafts_found[i] if drafts_found else True
            if rows.tag[slot] == tag and rows.drafts[slot]:
                rows.found[slot] = found
            if i in batch.verifying:
                tokens = token_ids[at : at + n]
                self._process_verified(slot, tag, tokens, logprobs, at, found, i in finished)
            elif n != 1:
                raise ValueError(f"sampling row {i}: {n} tokens from a row that is not a verify row")
            else:
                self._process_row(slot, tag, token_ids[at], logprobs, at, i in finished)
            at += n

    def _process_verified(
        self,
        slot: int,
        tag: int,
        tokens: Sequence[int],
        logprobs: StepLogprobs | None,
        at: int,
        found: bool,
        grammar_done: bool = False,
    ) -> None:
        """A verify row's tokens, the step's entries from `at` (their log-probabilities too):
        its pending token and the drafts accepted hold their KV now, then each token joins the
        output until one ends the request (the rest are dropped). `found`: it carried drafts
        (none found is no sign they would be rejected); `grammar_done`: its last token finished
        its grammar (the worker sends none after that one)."""
        if self.slots.rows.tag[slot] != tag:
            # Ended, preempted or aborted while this batch was in flight: never streamed (its
            # reserved slots went back with the request's).
            self.stats.dropped_inflight_tokens += len(tokens)
            self.telemetry.dropped_inflight_tokens.inc(len(tokens))
            return
        req = self._request(slot)
        if not tokens:
            raise ValueError(f"a verify row of request slot {slot} emitted no token")
        accepted = len(tokens) - 1
        self.telemetry.verify_rows.inc()
        self.telemetry.verify_tokens.inc(len(tokens))
        self.slots.kv.confirm_drafts(req, accepted, req.num_inflight - 1)
        if found:
            note_accepted(self.slots.rows, slot, accepted)
        req.num_computed += accepted
        req.num_inflight -= 1
        for j, token in enumerate(tokens):
            req.add_output(token)
            finish = self._token_finish(req, token)
            if grammar_done and finish is None and j == len(tokens) - 1:
                finish = FinishReason.STOP  # no token can follow: the grammar has finished
            self.outbox.token(req, token, finish, _row_logprob(logprobs, at + j, req))
            if finish is not None:
                self._end(req, finish)
                return

    def _apply_plain(self, slots: Column, tokens: Column) -> None:
        rows = self.slots.rows
        rows.inflight_np[slots] -= 1
        known = rows.known_np[slots] + 1
        rows.known_np[slots] = known
        rows.append_tokens(slots, tokens)
        token_list = tokens.tolist()
        unkept = rows.kept_np[slots] == 0  # first tokens of an attempt
        firsts = self._keep_prompts(slots, unkept) if np.count_nonzero(unkept) else ()
        # A step's rows mostly go on: the stops' columns are read only when a token could end one.
        eos = self._is_eos(tokens)
        length = known >= rows.limit_np[slots]
        if np.count_nonzero(eos):
            stop = eos & (rows.eos_stops_np[slots] == 1) & (known >= rows.stop_from_np[slots])
            finish = np.where(stop, _STOP, np.where(length, _LENGTH, 0))
        elif np.count_nonzero(length):
            finish = np.where(length, _LENGTH, 0)
        else:
            finish = None
        finish_list = [0] * len(token_list) if finish is None else finish.tolist()
        owners = rows.owner_np[slots]
        handles = rows.handle_np[slots]
        first_owner = int(owners[0])
        if np.count_nonzero(owners == first_owner) == len(owners):
            sink = rows.owners[first_owner]
            base = self.outbox.tokens(sink, handles.tolist(), token_list, finish_list)
            for i, cached, scores in firsts:
                self.outbox.note_first(sink, base + i, cached, scores)
        else:
            ended = np.zeros(len(token_list), np.int64) if finish is None else finish
            for owner in np.unique(owners).tolist():
                mine = owners == owner
                sink = rows.owners[owner]
                base = self.outbox.tokens(
                    sink, handles[mine].tolist(), tokens[mine].tolist(), ended[mine].tolist()
                )
                for i, cached, scores in firsts:
                    if mine[i]:
                        self.outbox.note_first(sink, base + int(np.count_nonzero(mine[:i])), cached, scores)
        if finish is not None:
            for i in finish.nonzero()[0].tolist():
                self._end(self._request(int(slots[i])), FinishReason(int(finish[i])))

    def _keep_prompts(
        self, slots: Column, unkept: npt.NDArray[np.bool_]
    ) -> list[tuple[int, int | None, tuple[TokenLogprob, ...] | None]]:
        """The rows of `slots` marked `unkept`, which took the first token of their attempt (their
        token is in their row, which counts it): the prefix cache takes their prompt's KV, as
        `_process_row` has it take a row's. Returns, by row index, what a request's first output
        token carries: the prompt tokens it found cached (None: not its first output) and its
        prompt's log-probabilities (None: none due)."""
        rows, kv = self.slots.rows, self.slots.kv
        firsts = []
        for i in unkept.nonzero()[0].tolist():
            slot = int(slots[i])
            req = self._request(slot)
            kv.keep(req, min(rows.computed[slot], rows.known[slot]))
            rows.kept[slot] = 1
            first_output = rows.known[slot] == rows.prompt_len[slot] + 1
            scores = self._prompt_scores(req)
            if first_output or scores is not None:
                firsts.append((i, req.cached_prompt_tokens if first_output else None, scores))
        return firsts

    def _apply_small(self, slots: list[int], tags: list[int], tokens: list[int]) -> bool:
        """`_apply_plain` a row at a time, for a batch of a few rows, where a handful of array
        operations cost more than the rows: False (nothing applied) unless every row is plain."""
        rows = self.slots.rows
        tag, plain, kept = rows.tag, rows.plain, rows.kept
        for slot, row_tag in zip(slots, tags, strict=True):
            if tag[slot] != row_tag or not plain[slot] or not kept[slot]:
                return False
        inflight, known, limit = rows.inflight, rows.known, rows.limit
        eos_stops, stop_from, eos_ids = rows.eos_stops, rows.stop_from, self.slots.eos_token_ids
        by_owner: dict[int, tuple[list[int], list[int], list[int]]] = {}
        ended: list[tuple[int, FinishReason]] = []
        for slot, token in zip(slots, tokens, strict=True):
            inflight[slot] -= 1
            length = known[slot] + 1
            known[slot] = length
            rows.append_token(slot, token)
            finish = 0
            if eos_stops[slot] and token in eos_ids and length >= stop_from[slot]:
                finish = _STOP
            elif length >= limit[slot]:
                finish = _LENGTH
            if finish:
                ended.append((slot, FinishReason(finish)))
            owner = rows.owner[slot]
            mine = by_owner.get(owner)
            if mine is None:
                mine = by_owner[owner] = ([], [], [])
            mine[0].append(rows.handle[slot])
            mine[1].append(token)
            mine[2].append(finish)
        for owner in sorted(by_owner):
            handles, owned_tokens, finishes = by_owner[owner]
            self.outbox.tokens(rows.owners[owner], handles, owned_tokens, finishes)
        for slot, reason in ended:
            self._end(self._request(slot), reason)
        return True

    def _is_eos(self, tokens: Column) -> npt.NDArray[np.bool_]:
        """Which of `tokens` are one of the model's EOS ids (a model has one or a few)."""
        hit: npt.NDArray[np.bool_] | None = None
        for eos in self.slots.eos_token_ids:
            hit = tokens == eos if hit is None else hit | (tokens == eos)
        return np.zeros(len(tokens), bool) if hit is None else hit

    def _process_row(
        self, slot: int, tag: int, token: int, logprobs: StepLogprobs | None, at: int, grammar_done: bool
    ) -> None:
        """A row of request slot `slot` (its tag at launch `tag`) sampled `token`, the step's
        entry `at` (its log-probabilities too)."""
        if self.slots.rows.tag[slot] != tag:
            # Ended, preempted or aborted while this batch was in flight: never streamed.
            self.stats.dropped_inflight_tokens += 1
            self.telemetry.dropped_inflight_tokens.inc()
            return
        req = self._request(slot)
        logprob = _row_logprob(logprobs, at, req)
        req.num_inflight -= 1
        req.add_output(token)
        if not req.prompt_kept:  # its prefill is computed: later arrivals may reuse it
            self.slots.kv.keep(req, min(req.num_computed, req.num_known))
            req.prompt_kept = True
        finish = self._token_finish(req, token)
        if grammar_done and finish is None:
            finish = FinishReason.STOP  # no token can follow: the grammar has finished
        first = req.cached_prompt_tokens if len(req.output_ids) == 1 else None
        self.outbox.token(req, token, finish, logprob, first, self._prompt_scores(req))
        if finish is not None:
            self._end(req, finish)

    @staticmethod
    def _prompt_scores(req: Request) -> tuple[TokenLogprob, ...] | None:
        """A request's prompt log-probabilities, with the first token of the attempt that
        computed them all; then never again."""
        if req.params.prompt_logprobs is None or req.prompt_scores_sent:
            return None
        if len(req.prompt_scores) < len(req.prompt_ids) - 1:
            return None
        req.prompt_scores_sent = True
        scores, req.prompt_scores = req.prompt_scores, []
        return tuple(scores)

    def _request(self, slot: int) -> Request:
        """The request in `slot`'s row (a row whose tag matched its batch's)."""
        req = self.slots.rows.requests[slot]
        assert req is not None, f"request slot {slot} holds no request"
        return req

    def _token_finish(self, req: Request, token: int) -> FinishReason | None:
        p = req.params
        is_stop = token in p.stop_token_ids or (not p.ignore_eos and token in self.slots.eos_token_ids)
        # NOTE: the worker masks stop ids below min_tokens; a backend that does not (sim) may
        # still sample one, and then it is an ordinary token.
        if is_stop and p.stop_finishes(len(req.output_ids) - 1):
            return FinishReason.STOP
        if len(req.output_ids) >= p.max_new_tokens:
            return FinishReason.LENGTH
        return None


def _row_logprob(logprobs: StepLogprobs | None, i: int, req: Request) -> TokenLogprob | None:
    """Row i's log-probabilities, cut to what its request asked for (None: it asked none)."""
    if logprobs is None or not req.params.logprobs:
        return None
    chosen, top_ids, top_logprobs = logprobs.row(i, req.params.top_logprobs)
    return TokenLogprob(chosen, tuple(top_ids), tuple(top_logprobs))
