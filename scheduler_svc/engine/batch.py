"""A picked batch: the Launch for the worker plus what processing needs back."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from scheduler_svc.engine.request import Request
from scheduler_svc.engine.rows import Column
from stepahead.protocol import IN_ROW, NOT_SCORED, GrammarConstraint, Launch, LogitsProcessing, NewRequest


@dataclass
class ScheduledBatch:
    """The rows whose sampled token comes back, in row order: their request slots and those
    slots' tags at launch (`rows.py`). A row whose request has since ended, been preempted or
    been aborted no longer matches its slot's tag; one that matches is the request in its slot's
    row (`SlotRows.requests`). The batch holds no request objects of its own: a step of a few
    hundred decode rows would touch each of them twice more (`rows.py`, the tails)."""

    launch: Launch
    sampled_slots: list[int] = field(default_factory=list)
    sampled_tags: list[int] = field(default_factory=list)
    verifying: set[int] = field(default_factory=set)  # sampled rows that are verify rows
    # Rows scoring prompt positions (`Launch.row_score`), in row order: (request slot, its tag,
    # positions scored), whose log-probabilities come back in `StepResult.prompt_logprobs`.
    scored: list[tuple[int, int, int]] = field(default_factory=list)
    epoch: int = 0  # the worker session it is launched in
    launched_at: float = 0.0  # time.monotonic() when it was sent
    _columns: tuple[Column, Column] | None = field(default=None, repr=False)

    @property
    def step_id(self) -> int:
        return self.launch.step_id

    @property
    def forward_mode(self) -> str:
        return self.launch.forward_mode

    @property
    def num_tokens(self) -> int:
        return self.launch.num_tokens

    def add_decode(self, req: Request, kv_slot: int, start: int | None = None) -> None:
        """One token: the request's last sampled one, read from the FutureMap; `start`: its
        position (None: the computed positions), or under speculative decoding a bound on it."""
        assert req.req_slot is not None
        self._add_row(req, req.num_computed if start is None else start, 1, from_future=True, sample=True)
        self.launch.kv_slots.append(kv_slot)

    def add_verify(self, req: Request, first_bound: int, kv_slots: list[int]) -> None:
        """A verify row (speculative decoding): the request's pending token from the FutureMap
        and len(kv_slots) - 1 drafts the worker proposes, at positions the worker holds, the
        first at most `first_bound`."""
        self.verifying.add(len(self.sampled_slots))
        self._add_row(req, first_bound, len(kv_slots), from_future=True, sample=True)
        self.launch.kv_slots.extend(kv_slots)

    def add_prefill(self, req: Request, ids: list[int], kv_slots: list[int], sample: bool) -> None:
        """A chunk of known tokens; the chunk that ends them samples the next token."""
        assert req.req_slot is not None
        start = req.num_computed
        self._add_row(req, start, len(ids), from_future=False, sample=sample)
        self.launch.prompt_ids.extend(ids)
        self.launch.kv_slots.extend(kv_slots)
        if req.params.prompt_logprobs is not None and not req.prompt_scores_sent:
            self._score(req, start, len(ids))

    def _score(self, req: Request, start: int, n: int) -> None:
        """The prefill row just added scores the prompt positions it holds: each against the
        prompt token that follows it, up to the prompt's last (which samples the first output)."""
        launch, prompt = self.launch, req.prompt_ids
        end = start + n
        if end > len(prompt) or start >= len(prompt) - 1:  # outputs replayed, or nothing to score
            return
        score = prompt[end] if end < len(prompt) else IN_ROW
        if launch.row_score:  # this row's entry is there (`_add_row`)
            launch.row_score[-1] = score
        else:
            launch.row_score = [NOT_SCORED] * (launch.num_rows - 1) + [score]
        launch.score_top_n = max(launch.score_top_n, req.params.prompt_logprobs or 0)
        count = n if end < len(prompt) else n - 1
        self.scored.append((req.req_slot, req.rows.tag[req.req_slot], count))  # type: ignore[arg-type,union-attr,index]

    def register(self, req: Request, eos_token_ids: frozenset[int]) -> None:
        assert req.req_slot is not None
        p = req.params
        processing = logits_processing(req, eos_token_ids) if p.processes_logits else None
        prefix = tuple(req.kv_slots[: req.num_computed])  # a cached prefix, reused
        # NOTE: a recompute replays the outputs its client has into the worker's fresh matcher.
        grammar = None if p.constraint is None else GrammarConstraint(p.constraint, tuple(req.output_ids))
        self.launch.new_requests.append(
            NewRequest(
                req.req_slot, p.temperature, p.top_p, p.top_k, p.seed, processing, prefix, grammar, p.min_p
            )
        )

    def _add_row(self, req: Request, start: int, n: int, from_future: bool, sample: bool) -> None:
        launch = self.launch
        if launch.row_score:  # a row after a scored one: not scored unless it says so
            launch.row_score.append(NOT_SCORED)
        launch.row_req_slots.append(req.req_slot)  # type: ignore[arg-type]
        launch.row_start_pos.append(start)
        launch.row_num_tokens.append(n)
        launch.row_from_future.append(from_future)
        launch.row_sample.append(sample)
        if sample:
            self.sampled_slots.append(req.req_slot)  # type: ignore[arg-type]
            self.sampled_tags.append(req.rows.tag[req.req_slot])  # type: ignore[union-attr,index]

    @property
    def num_sampled(self) -> int:
        return len(self.sampled_slots)

    def add_decodes(
        self, slots: list[int] | Column, tags: list[int] | Column, starts: list[int], kv: list[int]
    ) -> None:
        """One decode row for the request in each of `slots` (request slots, with their tags,
        first positions `starts` and one new KV slot each), in that order. As arrays, they are
        kept for `sampled_columns`."""
        if isinstance(slots, np.ndarray) and isinstance(tags, np.ndarray):
            if not self.sampled_slots:
                self._columns = (slots, tags)
            slots, tags = _ints(slots), _ints(tags)
        launch, n = self.launch, len(slots)
        launch.row_req_slots.extend(slots)
        launch.row_start_pos.extend(starts)
        launch.row_num_tokens.extend([1] * n)
        launch.row_from_future.extend([True] * n)
        launch.row_sample.extend([True] * n)
        launch.kv_slots.extend(kv)
        if launch.row_score:
            launch.row_score.extend([NOT_SCORED] * n)
        self.sampled_slots.extend(slots)
        self.sampled_tags.extend(tags)

    def sampled_columns(self) -> tuple[Column, Column]:
        """`sampled_slots` and `sampled_tags` as arrays (those `add_decodes` was given, when its
        rows are all the sampling rows)."""
        columns = self._columns
        if columns is not None and len(columns[0]) == len(self.sampled_slots):
            return columns
        return np.array(self.sampled_slots, np.int64), np.array(self.sampled_tags, np.int64)


def _ints(column: Column) -> list[int]:
    ints: list[int] = column.tolist()
    return ints


def logits_processing(req: Request, eos_token_ids: frozenset[int]) -> LogitsProcessing:
    """What the worker does to the request's logits. The prompt length tells the worker which
    replayed tokens of a recompute are output (they count in the penalties)."""
    p = req.params
    stops = p.stop_token_ids if p.ignore_eos else p.stop_token_ids | eos_token_ids
    return LogitsProcessing(
        prompt_len=len(req.prompt_ids),
        repetition_penalty=p.repetition_penalty,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        min_tokens=p.min_tokens,
        stop_ids=tuple(sorted(stops)) if p.min_tokens else (),
        logit_bias=p.logit_bias,
        logprobs=p.logprobs,
        top_logprobs=p.top_logprobs if p.logprobs else 0,
    )
