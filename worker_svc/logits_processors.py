"""Per-request logits processing on the device: penalties, `min_tokens`, `logit_bias`, and the
log-probabilities returned with sampled tokens.

Each request slot's history lives here, on the device, updated from the sampled ids in the step
that sampled them: batch k+1 sees batch k's token before the scheduler does, as the FutureMap's
decode inputs do. Every operation is a row-wise device op with device indices, so a row's result
never depends on the other rows of its batch and nothing is read back to the host.

Semantics:
- `repetition_penalty` (HF, vLLM; 1 is off): a logit of a token seen in the prompt or the output
  is divided by the penalty when positive, multiplied by it when negative.
- `presence_penalty`, `frequency_penalty` (OpenAI; 0 is off): over output tokens only,
  logit -= frequency * count + presence * (count > 0).
- `min_tokens`: EOS and the request's stop tokens are masked (-inf) until that many tokens are
  generated.
- `logit_bias` (OpenAI): added to the logits of the listed ids.
- log-probabilities are those of the model's distribution (log-softmax of its logits, before
  penalties, bias, temperature and top-k/top-p), as vLLM returns by default.

Order, as vLLM applies them: min_tokens mask, logit_bias, then the penalties.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprobs:
    """Per sampling row: the chosen token's log-probability and the `top_n` most likely."""

    chosen: torch.Tensor  # [R] float32
    top_ids: torch.Tensor  # [R, top_n] int64
    top_logprobs: torch.Tensor  # [R, top_n] float32


class TokenHistory:
    """Per request slot, on the device: which ids the prompt holds, how often each id was
    generated, and how many tokens were generated. Dense [slots, vocab] tables: 5 bytes per
    (slot, id), 63 MB for 256 slots of a 49152-token vocabulary."""

    def __init__(self, num_slots: int, vocab: int, device: torch.device) -> None:
        self.in_prompt = torch.zeros(num_slots, vocab, dtype=torch.bool, device=device)
        self.output_counts = torch.zeros(num_slots, vocab, dtype=torch.int32, device=device)
        self.generated = torch.zeros(num_slots, dtype=torch.int64, device=device)

    def reset(self, slots: torch.Tensor) -> None:
        """A slot's new request starts with no history (also on a recompute, which replays it)."""
        self.in_prompt.index_fill_(0, slots, False)
        self.output_counts.index_fill_(0, slots, 0)
        self.generated.index_fill_(0, slots, 0)

    def add_prompt(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Prompt tokens [T] of the slots [T] that hold them."""
        self.in_prompt.index_put_((slots, tokens), torch.ones_like(tokens, dtype=torch.bool))

    def add_outputs(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Generated tokens [T] of the slots [T]; a slot may appear several times (a recompute
        replays the outputs its client already has)."""
        ones = torch.ones_like(tokens, dtype=torch.int32)
        self.output_counts.index_put_((slots, tokens), ones, accumulate=True)
        self.generated.index_add_(0, slots, ones.to(torch.int64))


@dataclass(frozen=True)
class RowProcessing:
    """The processing parameters of a batch's sampling rows, on the device, [R] each."""

    slots: torch.Tensor  # int64: each row's request slot
    repetition_penalty: torch.Tensor  # float32, 1 off
    presence_penalty: torch.Tensor  # float32, 0 off
    frequency_penalty: torch.Tensor  # float32, 0 off
    min_tokens: torch.Tensor  # int64, 0 off
    stop_mask: torch.Tensor  # bool [R, V]: EOS and stop token ids that min_tokens holds back
    bias_rows: torch.Tensor  # int64 [B]: (row, id, value) triples of every row's logit_bias
    bias_ids: torch.Tensor  # int64 [B]
    bias_values: torch.Tensor  # float32 [B]


def process_logits(logits: torch.Tensor, rows: RowProcessing, history: TokenHistory) -> torch.Tensor:
    """The logits [R, V] float32 the sampler draws from; `logits` itself is left unchanged."""
    out = logits.clone()
    _mask_stops_below_min_tokens(out, rows, history)
    out.index_put_((rows.bias_rows, rows.bias_ids), rows.bias_values, accumulate=True)
    _apply_repetition_penalty(out, rows, history)
    _apply_output_penalties(out, rows, history)
    return out


def _mask_stops_below_min_tokens(logits: torch.Tensor, rows: RowProcessing, history: TokenHistory) -> None:
    short = history.generated.index_select(0, rows.slots) < rows.min_tokens
    logits.masked_fill_(rows.stop_mask & short[:, None], float("-inf"))


def _apply_repetition_penalty(logits: torch.Tensor, rows: RowProcessing, history: TokenHistory) -> None:
    seen = history.in_prompt.index_select(0, rows.slots) | (
        history.output_counts.index_select(0, rows.slots) > 0
    )
    penalty = rows.repetition_penalty[:, None]
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits.copy_(torch.where(seen, penalized, logits))


def _apply_output_penalties(logits: torch.Tensor, rows: RowProcessing, history: TokenHistory) -> None:
    counts = history.output_counts.index_select(0, rows.slots).to(logits.dtype)
    logits.sub_(counts * rows.frequency_penalty[:, None])
    logits.sub_((counts > 0).to(logits.dtype) * rows.presence_penalty[:, None])


def token_logprobs(logits: torch.Tensor, chosen: torch.Tensor, top_n: int) -> TokenLogprobs:
    """From the model's logits [R, V]: log-probabilities of `chosen` [R] and of the top `top_n`
    ids of each row, most likely first."""
    logprobs = logits.float().log_softmax(dim=-1)
    picked = logprobs.gather(1, chosen[:, None])[:, 0]
    top_logprobs, top_ids = logprobs.topk(top_n, dim=-1)
    return TokenLogprobs(picked, top_ids, top_logprobs)
