"""Prompt-lookup (n-gram) drafts, proposed on the device from each row's own tokens.

For speculative decoding without a draft model: a row whose last n tokens (its prompt and its
outputs so far) occurred earlier in it proposes the tokens that followed that occurrence. The
longest n in [min_n, max_n] that matches wins, and of its matches the earliest; up to `k`
tokens follow it, fewer where the row's tokens or its context run out first. These are the
meanings of `prompt_lookup_min`, `prompt_lookup_max` and `num_speculative_tokens` in the
`ngram` method of the common speculative configuration.

Everything is tensor work over the rows together, on the tokens' device: no value is read back
to the host (the forward thread's rule, worker_svc/engine.py), so drafts for step k+1 can be
made from tokens that step k sampled and the scheduler has not seen.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NO_DRAFT = -1  # a draft position past a row's proposal


@dataclass(frozen=True)
class NgramDrafts:
    tokens: torch.Tensor  # [R, k] int64: row r's proposal first, then NO_DRAFT
    counts: torch.Tensor  # [R] int64: how many of row r's are proposed (0: none)


def propose(
    history: torch.Tensor,
    lengths: torch.Tensor,
    min_n: int,
    max_n: int,
    k: int,
    max_context_len: int,
) -> NgramDrafts:
    """Drafts for rows whose tokens are `history[r, : lengths[r]]` ([R, L] int64, the rest
    padding); a row proposes nothing that would take it past `max_context_len` tokens."""
    if not 1 <= min_n <= max_n or k < 1:
        raise ValueError(
            f"n-gram drafts need 1 <= min_n <= max_n and k >= 1 (min_n {min_n}, max_n {max_n}, k {k})"
        )
    rows, width = history.shape
    device = history.device
    best_n = torch.zeros(rows, dtype=torch.int64, device=device)
    start = torch.zeros(rows, dtype=torch.int64, device=device)
    for n in range(min_n, min(max_n, width - 1) + 1):  # longer wins: a later n overrides
        suffix_at = (lengths[:, None] - n + torch.arange(n, device=device)).clamp(min=0)
        suffix = history.gather(1, suffix_at)  # [R, n]
        windows = history.unfold(1, n, 1)  # [R, width - n + 1, n]: windows[r, p] = tokens p .. p + n - 1
        positions = torch.arange(width - n + 1, device=device)
        # An earlier occurrence ends before the row's last token (it may overlap the suffix).
        matches = (windows == suffix[:, None, :]).all(-1) & (positions[None, :] < (lengths - n)[:, None])
        earliest = torch.where(matches, positions[None, :], width).amin(-1)
        found = earliest < width
        best_n = torch.where(found, n, best_n)
        start = torch.where(found, earliest + n, start)
    room = (max_context_len - lengths).clamp(min=0)
    counts = torch.minimum(torch.minimum(lengths - start, room).clamp(min=0, max=k), k * (best_n > 0))
    offsets = torch.arange(k, device=device)
    taken = history.gather(1, (start[:, None] + offsets[None, :]).clamp(max=width - 1))
    tokens = torch.where(offsets[None, :] < counts[:, None], taken, NO_DRAFT)
    return NgramDrafts(tokens, counts)
