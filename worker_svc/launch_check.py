"""Checks of one Launch against the worker's capacities, before any work is done.

NOTE: every check here takes time and memory linear in the lengths of the
launch's lists, never in the token counts the launch claims. The engine runs
them before it expands rows into per-token index lists, touches a device
tensor or changes slot state, so a malformed launch costs what its message
costs and fails as a LaunchError, never as a device-side assert.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from stepahead.protocol import (
    IN_ROW,
    MAX_CONSTRAINT_BYTES,
    MAX_THINKING_HEADER_BYTES,
    NOT_SCORED,
    WIRE_CONSTRAINT_KINDS,
    GrammarConstraint,
    Launch,
    LogitsProcessing,
    NewRequest,
)
from worker_svc.logits_processors import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS

# NOTE: the step budget when the scheduler announces none. A launch writes one
# distinct KV pool slot per token, so it never holds more tokens than the pool
# (an announced budget is capped there too); 65,536 is 128 steps of the
# scheduler's default budget (512), and keeps the per-token index lists of a
# launch on the host to a few MB.
DEFAULT_MAX_BATCH_TOKENS = 65_536
MAX_OUTPUT_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty|, as OpenAI allows
MAX_BIAS_VALUE = 100.0  # |logit_bias| value, as OpenAI allows


class LaunchError(ValueError):
    """A launch that does not fit the worker's capacities or state."""


@dataclass(frozen=True)
class LaunchLimits:
    """What one session's launches are held to."""

    kv_slots: int
    request_slots: int
    max_context_len: int
    vocab_size: int
    max_batch_tokens: int  # tokens per launch
    draft_tokens: int = 0  # K under speculative decoding: a verify row carries K + 1 (0: none)


def step_budget(kv_slots: int, announced: int | None) -> int:
    """The scheduler's announced budget, or the derived one; never above the KV pool."""
    if announced is None:
        return min(kv_slots, DEFAULT_MAX_BATCH_TOKENS)
    if announced < 1:
        raise ValueError(f"max_batch_tokens: must be at least 1, got {announced}")
    return min(kv_slots, announced)


def check_launch(launch: Launch, limits: LaunchLimits) -> None:
    """Raise LaunchError naming the first field of `launch` that breaks `limits`."""
    _check_row_arrays(launch)
    _check_row_tokens(launch, limits.max_batch_tokens, limits.draft_tokens)
    _check_token_totals(launch, limits.max_batch_tokens)
    _check_positions(launch, limits.max_context_len)
    _check_range("prompt_ids[{}]", launch.prompt_ids, limits.vocab_size, "the vocabulary")
    _check_range("kv_slots[{}]", launch.kv_slots, limits.kv_slots, "the KV pool")
    _check_range("row_req_slots[{}]", launch.row_req_slots, limits.request_slots, "the request slots")
    _check_slot_deltas(launch, limits.request_slots)
    _check_scores(launch, limits.vocab_size)
    for i, request in enumerate(launch.new_requests):
        _check_sampling(i, request)
        _check_prefix(i, request, limits)
        if request.processing is not None:
            _check_processing(f"new_requests[{i}].processing", request.processing, limits)
        if request.grammar is not None:
            _check_grammar(f"new_requests[{i}].grammar", request.grammar, limits)


def _check_grammar(field: str, g: GrammarConstraint, limits: LaunchLimits) -> None:
    """Its kind and size; the worker compiles it on its grammar thread (the frontend that
    admitted the request compiled it already)."""
    kind = g.constraint.kind
    if kind not in WIRE_CONSTRAINT_KINDS:
        raise LaunchError(f"{field}.kind: one of {', '.join(WIRE_CONSTRAINT_KINDS)}, got {kind!r}")
    size, most = len(g.constraint.text.encode()), MAX_CONSTRAINT_BYTES
    if kind == "thinking":
        most += MAX_THINKING_HEADER_BYTES
    if size > most:
        raise LaunchError(f"{field}.text: at most {most} bytes, got {size}")
    _check_count(f"{field}.replay_ids", len(g.replay_ids), limits.max_context_len, "ids")
    _check_range(f"{field}.replay_ids[{{}}]", g.replay_ids, limits.vocab_size, "the vocabulary")


def _check_row_arrays(launch: Launch) -> None:
    rows = len(launch.row_req_slots)
    columns: dict[str, Sequence[object]] = {
        "row_start_pos": launch.row_start_pos,
        "row_num_tokens": launch.row_num_tokens,
        "row_from_future": launch.row_from_future,
        "row_sample": launch.row_sample,
    }
    for name, column in columns.items():
        if len(column) != rows:
            raise LaunchError(f"{name}: {len(column)} entries for {rows} rows in row_req_slots")


def _check_scores(launch: Launch, vocab_size: int) -> None:
    """Prompt log-probabilities: a score per row (or none), of a prompt row, a real target."""
    _check_count("score_top_n", launch.score_top_n, MAX_TOP_LOGPROBS, "the most alternatives")
    if not launch.row_score:
        return
    if len(launch.row_score) != launch.num_rows:
        raise LaunchError(
            f"row_score: {len(launch.row_score)} entries for {launch.num_rows} rows in row_req_slots"
        )
    for i, (score, from_future) in enumerate(zip(launch.row_score, launch.row_from_future, strict=True)):
        if score == NOT_SCORED:
            continue
        if not IN_ROW <= score < vocab_size:
            allowed = f"{NOT_SCORED}, {IN_ROW} or in the vocabulary [0, {vocab_size})"
            raise LaunchError(f"row_score[{i}]: {score} is not {allowed}")
        if from_future:
            raise LaunchError(f"row_score[{i}]: a row_from_future row has no prompt positions to score")


def _check_row_tokens(launch: Launch, budget: int, draft_tokens: int) -> None:
    for i, (n, from_future) in enumerate(zip(launch.row_num_tokens, launch.row_from_future, strict=True)):
        if n < 1:
            raise LaunchError(f"row_num_tokens[{i}]: {n} tokens; a row carries at least 1")
        if n > budget:
            raise LaunchError(f"row_num_tokens[{i}]: {n} tokens exceed the step budget of {budget}")
        if from_future and n != 1 and n != draft_tokens + 1:
            carries = "1" if not draft_tokens else f"1, or {draft_tokens + 1} as a verify row"
            raise LaunchError(
                f"row_num_tokens[{i}]: {n} tokens in a row_from_future row, which carries {carries}"
            )
        if from_future and n > 1 and not launch.row_sample[i]:
            raise LaunchError(f"row_sample[{i}]: a verify row samples")


def _check_token_totals(launch: Launch, budget: int) -> None:
    total = sum(launch.row_num_tokens)
    if total > budget:
        raise LaunchError(f"row_num_tokens: {total} tokens in all exceed the step budget of {budget}")
    if len(launch.kv_slots) != total:
        raise LaunchError(f"kv_slots: {len(launch.kv_slots)} slots for {total} tokens")
    rows = zip(launch.row_num_tokens, launch.row_from_future, strict=True)
    prompt_tokens = sum(n for n, from_future in rows if not from_future)
    if len(launch.prompt_ids) != prompt_tokens:
        raise LaunchError(
            f"prompt_ids: {len(launch.prompt_ids)} ids for {prompt_tokens} tokens of non-future rows"
        )


def _check_positions(launch: Launch, max_context_len: int) -> None:
    rows = zip(launch.row_start_pos, launch.row_num_tokens, launch.row_from_future, strict=True)
    for i, (start, n, from_future) in enumerate(rows):
        if start < 0:
            raise LaunchError(f"row_start_pos[{i}]: {start} is negative")
        if from_future and n > 1:  # a verify row: a bound on its first position, which the worker holds
            if start >= max_context_len:
                raise LaunchError(
                    f"row_start_pos[{i}]: {start} is past the context length of {max_context_len}"
                )
            continue
        if start + n > max_context_len:
            raise LaunchError(
                f"row_start_pos[{i}]: positions {start}..{start + n - 1} exceed "
                f"the context length of {max_context_len}"
            )


def _check_slot_deltas(launch: Launch, request_slots: int) -> None:
    new_slots = [r.req_slot for r in launch.new_requests]
    _check_range("released_slots[{}]", launch.released_slots, request_slots, "the request slots")
    _check_range("new_requests[{}].req_slot", new_slots, request_slots, "the request slots")
    _check_unique("released_slots[{}]", launch.released_slots)
    _check_unique("new_requests[{}].req_slot", new_slots)


def _check_sampling(i: int, r: NewRequest) -> None:
    if not (math.isfinite(r.temperature) and r.temperature >= 0):
        raise LaunchError(f"new_requests[{i}].temperature: must be a finite number >= 0, got {r.temperature}")
    if not (math.isfinite(r.top_p) and 0 < r.top_p <= 1):
        raise LaunchError(f"new_requests[{i}].top_p: must be in (0, 1], got {r.top_p}")
    if r.top_k < 0:
        raise LaunchError(f"new_requests[{i}].top_k: must be >= 0, got {r.top_k}")
    if not (math.isfinite(r.min_p) and 0 <= r.min_p <= 1):
        raise LaunchError(f"new_requests[{i}].min_p: must be in [0, 1], got {r.min_p}")


def _check_prefix(i: int, r: NewRequest, limits: LaunchLimits) -> None:
    """A cached prefix fits the context (a token is left to compute) and names pool slots."""
    field = f"new_requests[{i}].prefix_kv_slots"
    _check_count(field, len(r.prefix_kv_slots), limits.max_context_len - 1, "the context length less one")
    _check_range(field + "[{}]", r.prefix_kv_slots, limits.kv_slots, "the KV pool")


def _check_processing(field: str, p: LogitsProcessing, limits: LaunchLimits) -> None:
    """`field` names the request's processing; every entry is checked before the request's
    slot tables are written, so an id is never a device-side out-of-bounds index."""
    context = limits.max_context_len
    _check_count(f"{field}.prompt_len", p.prompt_len, context, "the context length")
    _check_count(f"{field}.min_tokens", p.min_tokens, context, "the context length")
    _check_count(f"{field}.top_logprobs", p.top_logprobs, MAX_TOP_LOGPROBS, "the most alternatives")
    _check_penalties(field, p)
    _check_range(f"{field}.stop_ids[{{}}]", p.stop_ids, limits.vocab_size, "the vocabulary")
    _check_logit_bias(field, p.logit_bias, limits.vocab_size)


def _check_penalties(field: str, p: LogitsProcessing) -> None:
    repetition = p.repetition_penalty
    if not (math.isfinite(repetition) and repetition > 0):
        raise LaunchError(f"{field}.repetition_penalty: must be a finite number > 0, got {repetition}")
    _check_bounded(f"{field}.presence_penalty", p.presence_penalty, MAX_OUTPUT_PENALTY)
    _check_bounded(f"{field}.frequency_penalty", p.frequency_penalty, MAX_OUTPUT_PENALTY)


def _check_logit_bias(field: str, entries: Sequence[tuple[int, float]], vocab_size: int) -> None:
    if len(entries) > MAX_LOGIT_BIAS:
        raise LaunchError(f"{field}.bias_ids: {len(entries)} entries exceed the most of {MAX_LOGIT_BIAS}")
    _check_range(f"{field}.bias_ids[{{}}]", [token for token, _ in entries], vocab_size, "the vocabulary")
    for j, (_, value) in enumerate(entries):
        _check_bounded(f"{field}.bias_values[{j}]", value, MAX_BIAS_VALUE)


def _check_count(field: str, value: int, most: int, what: str) -> None:
    if not 0 <= value <= most:
        raise LaunchError(f"{field}: {value} is outside [0, {most}] ({what})")


def _check_bounded(field: str, value: float, bound: float) -> None:
    if not (math.isfinite(value) and -bound <= value <= bound):
        raise LaunchError(f"{field}: must be a finite number in [{-bound:g}, {bound:g}], got {value}")


def _check_range(field: str, values: Sequence[int], end: int, what: str) -> None:
    """Every value in [0, end); `field` names an entry by its index ({})."""
    if not values or (min(values) >= 0 and max(values) < end):
        return
    i = next(i for i, v in enumerate(values) if not 0 <= v < end)
    raise LaunchError(f"{field.format(i)}: {values[i]} is outside {what} [0, {end})")


def _check_unique(field: str, values: Sequence[int]) -> None:
    if len(set(values)) == len(values):
        return
    seen: set[int] = set()
    for i, v in enumerate(values):
        if v in seen:
            raise LaunchError(f"{field.format(i)}: slot {v} appears twice")
        seen.add(v)
