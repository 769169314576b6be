"""Per-request logits processing on the device: penalties, `min_tokens`, `logit_bias`, and the
log-probabilities returned with sampled tokens.

Each request slot's token history lives here, on the device, updated on the forward stream in
launch order: a registration of a penalized request resets its slot's output counts; a launch's
prompt-sourced tokens (prefill rows) are added before its rows' history is read; the sampled ids
are added in the step that sampled them, so batch k+1 (its decode input read from the FutureMap)
sees batch k's token before the scheduler does. The history holds each slot's tokens by position
(writing a token twice at its position changes nothing) and how often each id was generated; a
prompt-sourced token at a position whose sampled token is counted already (the serial loop feeds
each sampled token back as a known one) is not counted again: the host tracks, per penalized
slot, up to which position it has counted. Penalties touch only the ids a row has seen (its
tokens so far, gathered by position), never the whole vocabulary. Every operation is a row-wise
device op with device indices, so a row's result never depends on the other rows of its batch,
and nothing is read back to the host.

Semantics:
- `repetition_penalty` (HF's RepetitionPenaltyLogitsProcessor, vLLM; 1 is off): the logit of a
  token seen in the prompt or the output is divided by the penalty when positive, multiplied by
  it otherwise.
- `presence_penalty`, `frequency_penalty` (OpenAI; 0 is off): over output tokens only,
  logit -= frequency * count + presence * (count > 0). A recompute after preemption
  re-registers the request (a reset) and replays the outputs the client already has as a
  prefill: its tokens at positions >= `prompt_len` are counted as outputs again.
- `min_tokens`: the request's `stop_ids` (the scheduler puts EOS there unless ignore_eos, and the
  stop token ids) get -inf while fewer than `min_tokens` tokens are generated. The tokens
  generated before a sample are (its position) - prompt_len, both known on the host, so which
  (row, id) pairs are masked is decided there (`plan_step`); no device counter is kept. A
  verify row's entries (speculative decoding) sample at positions only the device knows: the
  host names their pairs, each with the position it holds until, and the device decides.
- `logit_bias` (OpenAI): added to the logits of the listed ids; an id listed twice gets both.
- log-probabilities are those of the model's distribution: the log-softmax, in float32, of the
  raw logits, before the mask, bias, penalties, temperature and top-k/top-p, as vLLM returns by
  default. Each sampling row of a step gets them when any row of the step asks; `top_n` is the
  largest `top_logprobs` of the rows that ask (0: the sampled token's only).

Order, as vLLM applies them: min_tokens mask, logit_bias, repetition, presence/frequency. Sampling
draws from the processed logits; greedy is their argmax.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from stepahead.protocol import LogitsProcessing, NewRequest, StepLogprobs

MAX_LOGIT_BIAS = 300  # entries per request, as OpenAI allows
MAX_TOP_LOGPROBS = 20  # alternatives per token, as OpenAI allows


@dataclass(frozen=True)
class TokenLogprobs:
    """Per sampling row: the chosen token's log-probability and the `top_n` most likely."""

    chosen: torch.Tensor  # [R] float32
    top_ids: torch.Tensor  # [R, top_n] int64
    top_logprobs: torch.Tensor  # [R, top_n] float32


@dataclass(frozen=True)
class Sampled:
    """A step's sampled ids, on the device, with their log-probabilities when a row asked."""

    token_ids: torch.Tensor  # [R] int64
    logprobs: TokenLogprobs | None = None
    # With a verify row: per sampling entry, EMITTED | PROPOSED (worker_svc/speculative.py).
    entry_state: torch.Tensor | None = None
    # The launch's scored prompt positions (Launch.row_scores): each one's next prompt token's
    # log-probability (`chosen`) and the most likely ids; None: none scored.
    scores: TokenLogprobs | None = None


class TokenHistory:
    """Per request slot, on the device: its tokens by position ([slots, context + 1] int32) and
    how often each id was generated ([slots, vocab] int32), allocated with the engine: 4 bytes
    per (slot, position) and per (slot, id), 56 MiB for smollm2 (vocab 49152, context 8192) at
    the default 256 request slots, 2.3 MB for tiny."""

    def __init__(self, num_slots: int, vocab: int, context: int, device: torch.device) -> None:
        # NOTE: one column more than the context, so that a sampled token's position (one past
        # its row's last) is always in range.
        self.tokens = torch.zeros(num_slots, context + 1, dtype=torch.int32, device=device)
        self.output_counts = torch.zeros(num_slots, vocab, dtype=torch.int32, device=device)

    def reset(self, slots: torch.Tensor) -> None:
        """A slot's new request starts with no counts (also on a recompute, which replays its
        outputs). Its tokens need none: every position below a row's is written before it is read."""
        self.output_counts.index_fill_(0, slots, 0)

    def add_tokens(self, slots: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor) -> None:
        """Tokens [T] of the slots [T] at the positions [T] (prompt or output)."""
        self.tokens.index_put_((slots, positions), tokens.to(torch.int32))

    def add_outputs(
        self, slots: torch.Tensor, tokens: torch.Tensor, counted: torch.Tensor | None = None
    ) -> None:
        """Generated tokens [T] of the slots [T]; a slot may appear several times (a recompute
        replays the outputs its client already has). `counted` [T] int32: 1 for the tokens that
        count (a verify row's emitted entries), 0 for the others (None: all count)."""
        ones = torch.ones_like(tokens, dtype=torch.int32) if counted is None else counted
        self.output_counts.index_put_((slots, tokens), ones, accumulate=True)

    def seen(self, slots: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
        """[R, width] int64: each slot's tokens at positions below its length [R]; the rest of a
        row repeats its first token, so that every entry names an id the row has seen."""
        ids = self.tokens[:, :width].index_select(0, slots).long()
        beyond = torch.arange(width, device=ids.device)[None, :] >= lengths[:, None]
        return torch.where(beyond, ids[:, :1], ids)


@dataclass(frozen=True)
class RowPenalties:
    """Penalty constants [R] of a batch's sampling rows, the ids each has seen [R, W] and how
    often each of those was generated [R, W]; neutral constants (1, 0, 0) leave a row's logits
    exactly as they are."""

    repetition: torch.Tensor  # float32, 1 off
    presence: torch.Tensor  # float32, 0 off
    frequency: torch.Tensor  # float32, 0 off
    seen_ids: torch.Tensor  # int64 [R, W]: prompt and output ids, any repeated
    output_counts: torch.Tensor  # int32 [R, W]: the output count of each of seen_ids


@dataclass(frozen=True)
class RowProcessing:
    """What to do to a batch's sampling rows' logits [R, V]; None parts are skipped."""

    stop_mask: tuple[torch.Tensor, torch.Tensor] | None  # (rows [M], ids [M]) set to -inf
    bias: tuple[torch.Tensor, torch.Tensor] | None  # ids [R, W] int64, values [R, W] float32
    penalties: RowPenalties | None
    stop_active: torch.Tensor | None = None  # [M] bool: which stop_mask pairs apply (None: all)


def process_logits(logits: torch.Tensor, rows: RowProcessing) -> torch.Tensor:
    """The logits [R, V] float32 the sampler draws from; `logits` itself is left unchanged."""
    out = logits.clone()
    if rows.stop_mask is not None:
        if rows.stop_active is None:
            out.index_put_(rows.stop_mask, out.new_full((), float("-inf")))
        else:
            held = torch.where(rows.stop_active, float("-inf"), out[rows.stop_mask])
            out.index_put_(rows.stop_mask, held)
    if rows.bias is not None:
        out.scatter_add_(1, *rows.bias)
    if rows.penalties is not None:
        _apply_penalties(out, rows.penalties)
    return out


def _apply_penalties(logits: torch.Tensor, p: RowPenalties) -> None:
    """Repetition over the seen ids, then presence/frequency over the generated ones (an id
    never generated has count 0: unchanged). Ids a row has not seen keep their logits.

    NOTE: every entry of one id in a row computes the same value from the same logit, so the
    scatter writes the same value whichever entry lands last.
    """
    logit = logits.gather(1, p.seen_ids)
    penalty = p.repetition[:, None]
    penalized = torch.where(logit > 0, logit / penalty, logit * penalty)
    counts = p.output_counts.to(logits.dtype)
    penalized = penalized - counts * p.frequency[:, None]
    penalized = penalized - (counts > 0).to(logits.dtype) * p.presence[:, None]
    logits.scatter_(1, p.seen_ids, penalized)


def token_logprobs(logits: torch.Tensor, chosen: torch.Tensor, top_n: int) -> TokenLogprobs:
    """From the model's logits [R, V]: log-probabilities of `chosen` [R] and of the top `top_n`
    ids of each row, most likely first."""
    logprobs = logits.float().log_softmax(dim=-1)
    picked = logprobs.gather(1, chosen[:, None])[:, 0]
    top_logprobs, top_ids = logprobs.topk(top_n, dim=-1)
    return TokenLogprobs(picked, top_ids, top_logprobs)


# ---- the copy to the host: one tensor -----------------------------------------------------------


def pack_for_host(sampled: Sampled) -> torch.Tensor:
    """What one copy takes to the host: the ids [R] int64, or, with log-probabilities,
    [R, 2 + 2 * top_n] float64 rows (id, chosen, top ids, top log-probabilities); with entry
    states, these as the first column(s) of [R, 2] int64 or [R, 3 + 2 * top_n] float64 rows,
    the state last."""
    # NOTE: float64 holds every id below 2**53 exactly, and every float32 log-probability.
    if sampled.scores is not None:  # then flat: the ids' part, then [S, 1 + 2 * top_n] scores
        scored = dataclasses.replace(sampled, scores=None)
        s = sampled.scores
        scores = torch.cat((s.chosen[:, None], s.top_ids, s.top_logprobs), dim=1).double()
        return torch.cat((pack_for_host(scored).double().flatten(), scores.flatten()))
    lp, state = sampled.logprobs, sampled.entry_state
    if lp is None:
        if state is None:
            return sampled.token_ids
        return torch.stack((sampled.token_ids, state), 1)
    columns = [sampled.token_ids[:, None], lp.chosen[:, None], lp.top_ids, lp.top_logprobs]
    if state is not None:
        columns.append(state[:, None])
    return torch.cat([c.double() for c in columns], dim=1)


@dataclass(frozen=True)
class HostSampled:
    """A step's sampled entries on the host."""

    tokens: list[int]
    logprobs: StepLogprobs | None
    states: list[int] | None  # per entry, EMITTED | PROPOSED (None: no verify row)
    scores: StepLogprobs | None = None  # the scored prompt positions' (Sampled.scores)


def unpack_from_host(
    host: torch.Tensor, with_states: bool = False, scored: tuple[int, int, int] | None = None
) -> HostSampled:
    """`pack_for_host`'s tensor, copied to the host, as the step's ids and log-probabilities
    (`with_states`: its entries' states are the last column); `scored`: (sampling entries,
    scored positions, alternatives each) where the launch scored prompt positions."""
    if scored is not None:
        entries, positions, top_n = scored
        split = host.numel() - positions * (1 + 2 * top_n)
        head, tail = host[:split], host[split:].view(positions, 1 + 2 * top_n)
        width = split // entries if entries else 1
        if width == 1 or (width == 2 and with_states):  # ids (and states): integers, as packed
            head = head.long()
        sampled = unpack_from_host(head if width == 1 else head.view(entries, width), with_states)
        scores = StepLogprobs(
            tail[:, 0].tolist(),
            top_n,
            tail[:, 1 : 1 + top_n].long().flatten().tolist(),
            tail[:, 1 + top_n :].flatten().tolist(),
        )
        return dataclasses.replace(sampled, scores=scores)
    states: list[int] | None = None
    if with_states:
        states = host[:, -1].long().tolist()
        host = host[:, :-1] if host.shape[1] > 2 else host[:, 0]
    if host.dim() == 1:
        ids: list[int] = host.tolist()
        return HostSampled(ids, None, states)
    top_n = (host.shape[1] - 2) // 2
    tokens: list[int] = host[:, 0].long().tolist()
    top = host[:, 2:]
    logprobs = StepLogprobs(
        host[:, 1].tolist(),
        top_n,
        top[:, :top_n].long().flatten().tolist(),
        top[:, top_n:].flatten().tolist(),
    )
    return HostSampled(tokens, logprobs, states)


# ---- what the host decides per step ------------------------------------------------------------


@dataclass(frozen=True)
class StepPlan:
    """A step's logits processing, decided on the host from its sampling rows' requests."""

    mask_rows: list[int]  # (row, id) pairs that min_tokens holds back
    mask_ids: list[int]
    mask_limits: list[int]  # each pair's: held back while its row samples below this position
    limits_checked: bool  # some pair's row samples at a position only the device knows
    penalized: bool  # some row reads its history
    history_width: int  # the tokens the longest penalized row has seen (its sampling position)
    bias_width: int  # the most logit_bias entries of a row
    top_logprobs: int | None  # None: no row asked for log-probabilities

    @property
    def processes(self) -> bool:
        """Whether the logits change at all."""
        return bool(self.mask_ids) or self.penalized or self.bias_width > 0


def plan_step(
    rows: Sequence[LogitsProcessing | None], positions: Sequence[int], bounds: Sequence[bool] = ()
) -> StepPlan:
    """From each sampling row's processing (None: plain) and the position it samples, or, where
    `bounds[r]` (a verify row's entry), a bound on it: the device checks those rows' pairs."""
    mask_rows: list[int] = []
    mask_ids: list[int] = []
    mask_limits: list[int] = []
    checked = False
    for r, (p, position) in enumerate(zip(rows, positions, strict=True)):
        if p is None or not p.min_tokens:
            continue
        bound = bool(bounds) and bounds[r]
        limit = p.prompt_len + p.min_tokens
        if position < limit or bound:
            mask_rows.extend([r] * len(p.stop_ids))
            mask_ids.extend(p.stop_ids)
            mask_limits.extend([limit] * len(p.stop_ids))
            checked = checked or (bound and position >= limit)
    present = [p for p in rows if p is not None]
    asked = [p.top_logprobs for p in present if p.logprobs]
    penalized = [pos for p, pos in zip(rows, positions, strict=True) if p is not None and p.penalized]
    return StepPlan(
        mask_rows,
        mask_ids,
        mask_limits,
        checked,
        penalized=bool(penalized),
        history_width=max(penalized, default=0),
        bias_width=max((len(p.logit_bias) for p in present), default=0),
        top_logprobs=max(asked) if asked else None,
    )


# ---- per request slot --------------------------------------------------------------------------


def registration_columns(requests: Sequence[NewRequest]) -> tuple[list[list[int]], list[list[float]]]:
    """The host columns `ProcessingTable.register` reads, to go with the slot table's two
    transfers: ints (penalized slots; each bias entry's slot, column and id) and floats (each
    request's repetition, presence and frequency penalties; each bias entry's value)."""
    plain = LogitsProcessing(prompt_len=0)
    processing = [(r.req_slot, r.processing or plain) for r in requests]
    entries = [(slot, col, e) for slot, p in processing for col, e in enumerate(p.logit_bias)]
    ints = [[slot for slot, p in processing if p.penalized]]
    ints += [[e[0] for e in entries], [e[1] for e in entries], [e[2][0] for e in entries]]
    floats = [[p.repetition_penalty for _, p in processing], [p.presence_penalty for _, p in processing]]
    floats += [[p.frequency_penalty for _, p in processing], [e[2][1] for e in entries]]
    return ints, floats


class ProcessingTable:
    """Per request slot, on the device: penalty constants, `logit_bias` entries (padded
    [slots, MAX_LOGIT_BIAS] tables: 3.5 KiB per slot) and the token history; on the host, each
    live slot's LogitsProcessing.

    NOTE: every registration writes its slot's constants and zeroes its bias values, processing
    or not, so a row never reads what an earlier request of its slot left there: neutral
    constants change nothing, nor does a 0.0 bias whatever id it is at. Only the history is kept
    across plain requests: it is reset when a penalized request registers, and only penalized
    rows read it.
    """

    def __init__(self, num_slots: int, vocab: int, context: int, device: torch.device) -> None:
        self.repetition = torch.ones(num_slots, dtype=torch.float32, device=device)
        self.presence = torch.zeros(num_slots, dtype=torch.float32, device=device)
        self.frequency = torch.zeros(num_slots, dtype=torch.float32, device=device)
        self.bias_ids = torch.zeros(num_slots, MAX_LOGIT_BIAS, dtype=torch.int64, device=device)
        self.bias_values = torch.zeros(num_slots, MAX_LOGIT_BIAS, dtype=torch.float32, device=device)
        self.history = TokenHistory(num_slots, vocab, context, device)
        self.host: dict[int, LogitsProcessing] = {}
        self.penalized: dict[int, LogitsProcessing] = {}
        # NOTE: per penalized slot, the output positions below it are counted in the history.
        self._counted_end: dict[int, int] = {}

    def register(
        self,
        requests: Sequence[NewRequest],
        slots: torch.Tensor,
        ints: Sequence[torch.Tensor],
        floats: Sequence[torch.Tensor],
    ) -> None:
        """`slots` [N] of `requests`, and `registration_columns(requests)` on the device."""
        reset, bias_slots, bias_cols, bias_ids = ints
        repetition, presence, frequency, bias_values = floats
        self.repetition.index_copy_(0, slots, repetition)
        self.presence.index_copy_(0, slots, presence)
        self.frequency.index_copy_(0, slots, frequency)
        self.bias_values.index_fill_(0, slots, 0.0)
        if bias_ids.numel():
            self.bias_ids.index_put_((bias_slots, bias_cols), bias_ids)
            self.bias_values.index_put_((bias_slots, bias_cols), bias_values)
        if reset.numel():
            self.history.reset(reset)
        for r in requests:
            self._note(r.req_slot, r.processing)

    def _note(self, slot: int, processing: LogitsProcessing | None) -> None:
        self.release([slot])
        if processing is not None:
            self.host[slot] = processing
            if processing.penalized:
                self.penalized[slot] = processing
                self._counted_end[slot] = processing.prompt_len

    def release(self, slots: Sequence[int]) -> None:
        for slot in slots:
            self.host.pop(slot, None)
            self.penalized.pop(slot, None)
            self._counted_end.pop(slot, None)

    def clear(self) -> None:
        self.host.clear()
        self.penalized.clear()
        self._counted_end.clear()

    def history_tokens(self, rows: Iterable[tuple[int, int, int, int]]) -> tuple[list[int], list[int]]:
        """Which of a launch's prefill rows' tokens the history takes, as token indexes: all of
        them (by position), and the outputs among them not counted yet. A row is (slot, start
        position, tokens, index of its first token); rows of slots not penalized are skipped."""
        tokens: list[int] = []
        outputs: list[int] = []
        for slot, start, n, t in rows:
            if slot not in self.penalized:
                continue
            tokens.extend(range(t, t + n))
            first_new = max(start, self._counted_end[slot])
            outputs.extend(range(t + first_new - start, t + n))
            self._counted_end[slot] = max(first_new, start + n)
        return tokens, outputs

    def count_sampled(self, slots: Sequence[int], positions: Sequence[int]) -> None:
        """The tokens sampled for `slots` at `positions` are counted in the step that samples them."""
        for slot, position in zip(slots, positions, strict=True):
            if slot in self._counted_end:
                self._counted_end[slot] = max(self._counted_end[slot], position + 1)

    def plan(
        self, row_slots: Sequence[int], positions: Sequence[int], bounds: Sequence[bool] = ()
    ) -> StepPlan | None:
        """The step's plan for sampling rows of `row_slots` (`plan_step`); None when none has
        processing."""
        if not self.host:
            return None
        rows = [self.host.get(slot) for slot in row_slots]
        if all(p is None for p in rows):
            return None
        return plan_step(rows, positions, bounds)

    def rows(
        self,
        slots: torch.Tensor,
        positions: torch.Tensor,
        plan: StepPlan,
        stop_mask: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        drafts_before: torch.Tensor | None = None,
    ) -> RowProcessing:
        """The sampling rows' processing: their `slots` [R] and sampling `positions` [R], the
        plan's mask pairs and their limits, on the device; `drafts_before` [R, K]: a verify
        row's entry j, its drafts 1..j (NO_DRAFT past them), which its penalties count as
        outputs (their tokens are in the history by position already)."""
        rows, ids, limits = stop_mask
        active = positions.index_select(0, rows) < limits if plan.limits_checked else None
        return RowProcessing(
            (rows, ids) if plan.mask_ids else None,
            self._bias(slots, plan.bias_width) if plan.bias_width else None,
            self._penalties(slots, positions, plan.history_width, drafts_before) if plan.penalized else None,
            active,
        )

    def _bias(self, slots: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self.bias_ids[:, :width].index_select(0, slots)
        return ids, self.bias_values[:, :width].index_select(0, slots)

    def _penalties(
        self, slots: torch.Tensor, positions: torch.Tensor, width: int, drafts_before: torch.Tensor | None
    ) -> RowPenalties:
        """A row's tokens are those below the position it samples."""
        seen = self.history.seen(slots, positions, width)
        counts = self.history.output_counts[slots[:, None], seen]
        if drafts_before is not None:
            counts = counts + (seen[:, :, None] == drafts_before[:, None, :]).sum(-1, dtype=torch.int32)
        return RowPenalties(
            self.repetition.index_select(0, slots),
            self.presence.index_select(0, slots),
            self.frequency.index_select(0, slots),
            seen,
            counts,
        )
