"""Applying a step's sampled ids: each row's token joins its request's output (or is dropped,
when the request ended or was preempted while the batch was in flight), its prompt's KV goes to
the prefix cache, token-level stops (EOS, `stop_token_ids`, `max_new_tokens`) are decided, and
tokens, log-probabilities and finishes go to the outbox. Stop strings are the frontends'.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from scheduler_svc.contract import FinishReason, TokenLogprob
from scheduler_svc.engine.batch import SampledRow, ScheduledBatch
from scheduler_svc.engine.outputs import Outbox
from scheduler_svc.engine.request import Request
from scheduler_svc.engine.slots import SessionSlots
from scheduler_svc.engine.telemetry import SchedulerTelemetry
from stepahead.protocol import StepLogprobs

if TYPE_CHECKING:
    from scheduler_svc.engine.policy import SchedulerStats


class ResultProcessor:
    def __init__(
        self,
        slots: SessionSlots,
        outbox: Outbox,
        stats: SchedulerStats,
        telemetry: SchedulerTelemetry,
        end: Callable[[Request, FinishReason], None],
    ) -> None:
        self.slots = slots
        self.outbox = outbox
        self.stats = stats
        self.telemetry = telemetry
        self._end = end  # ends a finished request: its slots are freed, it leaves the table

    def apply(
        self,
        batch: ScheduledBatch,
        token_ids: list[int],
        logprobs: StepLogprobs | None,
        grammar_finished: tuple[int, ...] = (),
    ) -> None:
        """Apply the sampled ids of `batch` (and their log-probabilities, when the worker sent
        them), row by row; rows in `grammar_finished` end their request (STOP) after their token."""
        finished = set(grammar_finished)
        for i, (row, token) in enumerate(zip(batch.sampled, token_ids, strict=True)):
            self._process_row(row, token, _row_logprob(logprobs, i, row.request), i in finished)

    def _process_row(
        self, row: SampledRow, token: int, logprob: TokenLogprob | None, grammar_done: bool
    ) -> None:
        req = row.request
        if req.finished or row.attempt != req.attempt:
            # Finished (or preempted) while this batch was in flight: never streamed.
            self.stats.dropped_inflight_tokens += 1
            self.telemetry.dropped_inflight_tokens.inc()
            return
        req.num_inflight -= 1
        req.output_ids.append(token)
        if not req.prompt_kept:  # its prefill is computed: later arrivals may reuse it
            self.slots.kv.keep(req, min(req.num_computed, req.num_known))
            req.prompt_kept = True
        finish = self._token_finish(req, token)
        if grammar_done and finish is None:
            finish = FinishReason.STOP  # no token can follow: the grammar has finished
        first = req.cached_prompt_tokens if len(req.output_ids) == 1 else None
        self.outbox.token(req, token, finish, logprob, first)
        if finish is not None:
            self._end(req, finish)

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
