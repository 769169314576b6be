"""Verifying drafted tokens against the model's own distributions, on the device.

A drafting row runs its last token and its k drafts through one forward: k + 1 positions, each
with the model's distribution for the token after it (after every logits processor, so
penalties, bias and masks apply as they would one step at a time). Drafts are accepted from the
first while they pass; the first that fails is replaced by a token drawn from what is left of
its distribution, and a row whose drafts all pass gets one more token from the last position.
So a row emits between 1 and k + 1 tokens a step.

- Greedy rows accept a draft that is the position's argmax, and correct with the argmax: the
  output is token for token what one-at-a-time greedy decoding gives.
- Sampled rows use rejection sampling (Leviathan et al. 2023; Chen et al. 2023) for a draft
  that is certain (prompt lookup proposes one token, probability 1): a draft d is accepted with
  probability p(d); if rejected, the token is drawn from p with d removed, renormalised. Each
  emitted token then has exactly the model's distribution.

The random numbers come in as arguments (one uniform per draft for its test, one per position
for the draw), so a seeded request stays reproducible however its rows are batched. Nothing is
read back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NO_TOKEN = -1  # past a row's emitted tokens


@dataclass(frozen=True)
class Verified:
    tokens: torch.Tensor  # [R, k + 1] int64: the accepted drafts, then the drawn token, then NO_TOKEN
    counts: torch.Tensor  # [R] int64: tokens emitted, 1 .. draft count + 1
    accepted: torch.Tensor  # [R] int64: drafts accepted, 0 .. draft count


def verify(
    probs: torch.Tensor,
    drafts: torch.Tensor,
    draft_counts: torch.Tensor,
    greedy: torch.Tensor,
    accept_uniforms: torch.Tensor,
    draw_uniforms: torch.Tensor,
) -> Verified:
    """`probs` [R, k + 1, V]: position j's distribution for the token after the row's j-th
    input (its last token, then its drafts); `drafts` [R, k] (past `draft_counts` [R] anything);
    `greedy` [R] bool; `accept_uniforms` [R, k] and `draw_uniforms` [R, k + 1] in [0, 1)."""
    rows, positions, vocab = probs.shape
    k = positions - 1
    if k < 1:
        raise ValueError(f"verify: {positions} position(s) a row, so no draft to verify")
    device = probs.device
    offsets = torch.arange(k, device=device)
    proposed = offsets[None, :] < draft_counts[:, None]  # [R, k]
    safe_drafts = torch.where(proposed, drafts, 0)
    draft_probs = probs[:, :k].gather(2, safe_drafts[:, :, None])[:, :, 0]  # [R, k]
    argmax = probs.argmax(-1)  # [R, k + 1]
    passes = torch.where(greedy[:, None], safe_drafts == argmax[:, :k], accept_uniforms < draft_probs)
    passes &= proposed
    accepted = passes.to(torch.int64).cumprod(-1).sum(-1)  # [R]: the leading run of passes
    # The drawn token, at the first position not accepted: from p there, less the draft it
    # rejected (none when every draft passed).
    at = accepted[:, None, None].expand(rows, 1, vocab)
    last = probs.gather(1, at)[:, 0]  # [R, V]
    rejected = accepted < draft_counts
    rejected_draft = safe_drafts.gather(1, accepted.clamp(max=k - 1)[:, None])
    residual = torch.where(rejected[:, None], last.scatter(1, rejected_draft, 0.0), last)
    cumulative = residual.cumsum(-1)
    target = draw_uniforms.gather(1, accepted[:, None]) * cumulative[:, -1:]
    drawn = torch.searchsorted(cumulative, target, right=True).clamp(max=vocab - 1)[:, 0]
    # A greedy row takes the argmax: past a rejected draft it differs from that draft anyway.
    drawn = torch.where(greedy, argmax.gather(1, accepted[:, None])[:, 0], drawn)
    slots = torch.arange(positions, device=device)[None, :]
    padded_drafts = torch.cat((safe_drafts, torch.zeros(rows, 1, dtype=drafts.dtype, device=device)), 1)
    tokens = torch.where(slots < accepted[:, None], padded_drafts, NO_TOKEN)
    tokens = torch.where(slots == accepted[:, None], drawn[:, None], tokens)
    return Verified(tokens, accepted + 1, accepted)
