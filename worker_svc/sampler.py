"""Batch-invariant sampling: a row's token depends only on its logits, its parameters, its seed
and the position being sampled, never on the other rows of the batch or on the device.

Draws use the Gumbel-max trick (argmax of logits / temperature + Gumbel noise is an exact sample
of the softmax) with noise from a counter-based hash of (seed, position, vocab index).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MASK32 = 0xFFFFFFFF
FMIX_MUL_1 = 0x85EBCA6B
FMIX_MUL_2 = 0xC2B2AE35
SEED_SALT = 0x9E3779B9
ROW_SALT = 0x7F4A7C15


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    *,
    all_greedy: bool | None = None,
    any_filter: bool | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Next token [R] int64 for logits [R, V] float32.

    temperature <= 0 is greedy; top_k of 0 or >= V, top_p >= 1 and min_p 0 (or None) disable
    those cuts. min_p first (as vLLM): a token stays if its probability after temperature is at
    least min_p x the likeliest one's; top-k and top-p then choose among those.
    `all_greedy` / `any_filter` let a caller that knows the parameters on the host skip
    reading them back from the device; when None they are derived from the tensors.
    """
    greedy = logits.argmax(dim=-1)
    if all_greedy is None:
        all_greedy = bool((temperature <= 0).all())
    if all_greedy:
        return greedy
    vocab = logits.shape[-1]
    if min_p is None:
        min_p = torch.zeros_like(top_p)
    if any_filter is None:
        any_filter = bool(_cuts_vocab(top_p, top_k, min_p, vocab).any())
    scaled = logits / torch.where(temperature > 0, temperature, 1.0)[:, None]
    row_keys = _row_keys(seeds, positions)
    if any_filter:
        drawn = _draw_filtered(scaled, top_p, top_k, min_p, row_keys)
    else:
        drawn = _draw(scaled, torch.arange(vocab, device=logits.device)[None, :], row_keys)
    return torch.where(temperature > 0, drawn, greedy)


def _cuts_vocab(top_p: torch.Tensor, top_k: torch.Tensor, min_p: torch.Tensor, vocab: int) -> torch.Tensor:
    return (top_p < 1.0) | ((top_k > 0) & (top_k < vocab)) | (min_p > 0.0)


def _draw(
    scores: torch.Tensor, token_ids: torch.Tensor, row_keys: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """Gumbel-max over candidate scores [R, N] whose vocabulary ids are token_ids [R or 1, N]."""
    noisy = gumbel_noise(row_keys, token_ids).add_(scores)
    best = noisy.argmax(dim=-1, keepdim=True)
    return token_ids.expand_as(scores).gather(1, best)[:, 0]


def _draw_filtered(
    scaled: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    min_p: torch.Tensor,
    row_keys: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    sorted_scores, sorted_ids = scaled.sort(dim=-1, descending=True, stable=True)
    keep = _keep_mask(sorted_scores, top_p, top_k, min_p)
    width = _candidate_width(keep)
    candidates = sorted_scores[:, :width].masked_fill(~keep[:, :width], float("-inf"))
    return _draw(candidates, sorted_ids[:, :width], row_keys)


def _candidate_width(keep: torch.Tensor) -> int:
    """Kept candidates form a prefix of the sorted order, so on CPU, where reading the count
    back is free, only the longest kept prefix is hashed. Elsewhere all are, to avoid a sync."""
    if keep.device.type != "cpu":
        return int(keep.shape[-1])
    return int(keep.sum(dim=-1).max())


def _keep_mask(
    sorted_scores: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Which of the descending-sorted candidates survive min-p and top-k, then top-p over those."""
    vocab = sorted_scores.shape[-1]
    ranks = torch.arange(vocab, device=sorted_scores.device)[None, :]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    keep = ranks < k[:, None]
    # p_i >= min_p * p_max  <=>  score_i >= score_max + log(min_p): no softmax needed (log 0 = -inf).
    keep &= sorted_scores >= sorted_scores[:, :1] + min_p.log()[:, None]
    probs = sorted_scores.masked_fill(~keep, float("-inf")).softmax(dim=-1)
    # Exclusive prefix sum: monotone, so the kept candidates always form a prefix.
    mass_before = F.pad(probs.cumsum(dim=-1)[:, :-1], (1, 0))
    in_nucleus = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0) | (ranks == 0)
    return keep & in_nucleus


# ---------------------------------------------------------------------------------------------
# Counter-based random source. All values are kept in [0, 2**32) inside int64, and every product
# stays below 2**49, so nothing overflows and CPU and CUDA agree bit for bit. The mixers work in
# place on tensors they own: over a [R, V] grid the temporaries dominate the cost otherwise.


def _mul32_(x: torch.Tensor, constant: int) -> torch.Tensor:
    """x <- (x * constant) mod 2**32, split into 16-bit halves of the constant."""
    high = (x * (constant >> 16)).bitwise_and_(0xFFFF).bitwise_left_shift_(16)
    return x.mul_(constant & 0xFFFF).add_(high).bitwise_and_(MASK32)


def _fmix32_(x: torch.Tensor) -> torch.Tensor:
    """x <- a bijective 32-bit avalanche mix of x."""
    x.bitwise_xor_(x >> 16)
    _mul32_(x, FMIX_MUL_1)
    x.bitwise_xor_(x >> 13)
    _mul32_(x, FMIX_MUL_2)
    return x.bitwise_xor_(x >> 16)


def _row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two independent 32-bit keys per row from (seed, position), each [R, 1]."""
    seed_low, seed_high = seeds & MASK32, (seeds >> 32) & MASK32
    key = _fmix32_((seed_low + SEED_SALT).bitwise_and_(MASK32))
    key = _fmix32_(key.bitwise_xor_(seed_high))
    key = _fmix32_(key.bitwise_xor_(positions & MASK32))
    return key[:, None], _fmix32_(key ^ ROW_SALT)[:, None]


def uniform_bits(row_keys: tuple[torch.Tensor, torch.Tensor], token_ids: torch.Tensor) -> torch.Tensor:
    """32 random bits per (row, token id), a pure function of the row keys and the id."""
    first, second = row_keys
    bits = _fmix32_((token_ids + first).bitwise_and_(MASK32))
    return _fmix32_(bits.bitwise_xor_(second))


def gumbel_noise(row_keys: tuple[torch.Tensor, torch.Tensor], token_ids: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise -log(-log(u)) in float64; u lies strictly inside (0, 1)."""
    u = uniform_bits(row_keys, token_ids).double().add_(0.5).div_(float(1 << 32))
    return u.log_().neg_().log_().neg_()
