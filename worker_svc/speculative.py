"""Speculative decoding on the worker: n-gram drafts proposed and verified one step ahead,
with every value the scheduler has not seen kept on the device.

A verify row (a row read from the FutureMap carrying num_speculative_tokens + 1 = K + 1
tokens) runs its request's pending token t and K drafts through one forward:

    inputs      t        d1        d2   ...  dK
    positions   b        b+1       b+2  ...  b+K      (b: the slot's position of t)
    samples     s0       s1        s2   ...  sK       (s_j: the token after input j)

Each position is sampled exactly as a one-token decode step would sample it there (the same
logits processing, the same seeded draw keyed by the position, worker_svc/sampler.py). Draft
d_j is accepted while it equals s_{j-1}; the row emits s_0 .. s_a, where a drafts were
accepted: 1 to K + 1 tokens, and always exactly the tokens one-at-a-time decoding gives, for
greedy and seeded rows alike. For a row sampled at a temperature this is rejection sampling of
a draft that is certain (prompt lookup proposes one token, probability 1): d is accepted with
probability p(d), and a rejected position's token is drawn from p without d, renormalised
(Leviathan et al. 2023), each emitted token having the model's distribution.

What the scheduler cannot know when it launches step k + 1 (how many of step k's drafts were
accepted) stays here, per request slot:
- `next_pos`: the position of the slot's pending token (the one in the FutureMap), written by
  every sampling row; a verify row reads its positions from it;
- `kv_token`: the token whose K/V each KV pool slot holds, written by every forward; a row's
  drafts come from its tokens, `kv_token[req_to_token[slot, :b]]` and t, on the device (no
  host round trip, worker_svc/ngram.py).
The scheduler reserves K + 1 KV slots for a verify row; the worker writes the first 1 + count
(t and the proposed drafts) at their positions. On a GPU the row's positions past them compute
with filler inputs and go to a spare column of `req_to_token` (`RequestSlots.spare_column`)
that no row attends; on the CPU they are not computed (`WorkerEngine._resolve_rows`). Positions
saturate at the context's last: a row still launched after its request reached the context
(the scheduler learns it a step late) computes in place and its tokens are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stepahead.speculative import SpeculativeConfig
from worker_svc.ngram import NO_DRAFT, NgramDrafts, propose

__all__ = ["Accepted", "Drafted", "Lookup", "Speculation", "accept"]

# Bits of a sampling entry's state in what the copy takes to the host (`Accepted.entry_state`).
EMITTED = 1  # the entry's sample is one of the row's emitted tokens
PROPOSED = 2  # the entry's input is a proposed draft (a verify row's entry j >= 1)
FOUND = 4  # on a row's first entry: the lookup found drafts for it at this step, carried or not


@dataclass(frozen=True)
class Lookup:
    """A launch's verify rows' prompt lookup (all [Bv, ...], on the device)."""

    base: torch.Tensor  # [Bv] position of each row's pending token
    pending: torch.Tensor  # [Bv] the pending token
    proposal: NgramDrafts  # the drafts found, whether the rows carry them or not

    def select(self, index: torch.Tensor) -> Lookup:
        """The lookup of rows `index` of these."""
        proposal = NgramDrafts(
            self.proposal.tokens.index_select(0, index), self.proposal.counts.index_select(0, index)
        )
        return Lookup(self.base.index_select(0, index), self.pending.index_select(0, index), proposal)


@dataclass(frozen=True)
class Drafted:
    """A launch's verify rows, made ready for the forward (all [Bv, ...], on the device)."""

    base: torch.Tensor  # [Bv] position of each row's pending token
    inputs: torch.Tensor  # [Bv, K + 1] the pending token, then the drafts (unproposed: t again)
    drafts: torch.Tensor  # [Bv, K] proposed drafts, NO_DRAFT past a row's count
    counts: torch.Tensor  # [Bv] drafts proposed
    found: torch.Tensor  # [Bv] drafts the lookup found, whether the row carries them or not
    positions: torch.Tensor  # [Bv, K + 1] each input's position (saturated at the context's last)
    table_positions: torch.Tensor  # [Bv, K + 1] where its KV slot goes in req_to_token (spare past count)

    def before_entries(self, entries: int, sample_index: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        """[entries, K]: for a launch's sampling entry that is a verify row's entry j, the drafts
        it follows (d1 .. dj, then NO_DRAFT); NO_DRAFT throughout for the other entries."""
        k = self.drafts.shape[1]
        offsets = torch.arange(k + 1, device=self.drafts.device)
        follows = offsets[None, :k] < offsets[:, None]  # [K + 1, K]: entry j follows drafts i < j
        grid = torch.where(follows[None], self.drafts[:, None, :], NO_DRAFT)  # [Bv, K + 1, K]
        before = torch.full((entries, k), NO_DRAFT, dtype=self.drafts.dtype, device=self.drafts.device)
        before.index_copy_(0, sample_index, grid.reshape(-1, k).index_select(0, flat))
        return before

    @staticmethod
    def flat(grid: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The rows' real tokens of a [Bv, K + 1] `grid`, row-major (`index`: their places in it;
        a decode row has one)."""
        return grid.reshape(-1).index_select(0, index)


@dataclass(frozen=True)
class Accepted:
    """A launch's verify rows after sampling."""

    accepted: torch.Tensor  # [Bv] drafts accepted
    last: torch.Tensor  # [Bv] each row's last emitted token (its next pending token)
    entry_state: torch.Tensor  # [Bv, K + 1] EMITTED | PROPOSED | FOUND bits per sampling entry


class Speculation:
    """The per-slot and per-KV-slot state speculative decoding keeps on the device."""

    def __init__(
        self,
        request_slots: int,
        kv_slots: int,
        context: int,
        device: torch.device,
        check_inputs: bool = False,
    ) -> None:
        """`check_inputs`: every verify row's inputs are checked to be token ids (no draft
        placeholder reaches the embedding); a read back, so --check-invariants only."""
        self.config: SpeculativeConfig | None = None  # the live session's (None: no speculation)
        self.context = context
        self._check_inputs = check_inputs
        self.next_pos = torch.zeros(request_slots, dtype=torch.int64, device=device)
        self.kv_token = torch.zeros(max(kv_slots, 1), dtype=torch.int64, device=device)

    @property
    def draft_tokens(self) -> int:
        """K: drafts a verify row carries (0: the session does not speculate)."""
        return 0 if self.config is None else self.config.num_speculative_tokens

    def record_inputs(self, kv_slots: torch.Tensor, input_ids: torch.Tensor) -> None:
        """A forward's inputs: the token each of its KV slots holds."""
        self.kv_token.index_copy_(0, kv_slots, input_ids)

    def record_sampled(self, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """Rows that sampled one token: it is pending at `positions` [R]."""
        self.next_pos.index_copy_(0, slots, positions)

    def look_up(
        self, slots: torch.Tensor, pending: torch.Tensor, req_to_token: torch.Tensor, width: int
    ) -> Lookup:
        """The lookup for the rows of request `slots` [Bv] whose pending tokens are `pending`
        [Bv]; `width`: a bound on their lengths (the scheduler's), at most the context."""
        config = self.config
        assert config is not None, "a verify row in a session without speculation"
        base = self.next_pos.index_select(0, slots)
        table = req_to_token.index_select(0, slots)[:, :width]
        history = self.kv_token.index_select(0, table.reshape(-1)).view(table.shape)
        history.scatter_(1, base[:, None].clamp(max=width - 1), pending[:, None])
        lengths = (base + 1).clamp(max=width)
        low, high, k = config.prompt_lookup_min, config.prompt_lookup_max, config.num_speculative_tokens
        return Lookup(base, pending, propose(history, lengths, low, high, k, self.context))

    def draft(self, lookup: Lookup, drafting: torch.Tensor | None = None) -> Drafted:
        """The looked-up rows' inputs and positions; `drafting` [Bv]: which rows carry their
        drafts (None: none does). Every row is looked up: what it found tells the scheduler
        whether its next rows should carry drafts."""
        config = self.config
        assert config is not None, "a verify row in a session without speculation"
        k, context = config.num_speculative_tokens, self.context
        base, pending, proposal = lookup.base, lookup.pending, lookup.proposal
        offsets = torch.arange(k + 1, device=base.device)
        positions = base[:, None] + offsets[None, :]
        counts = proposal.counts * drafting if drafting is not None else torch.zeros_like(base)
        drafts = torch.where(offsets[None, 1:] <= counts[:, None], proposal.tokens, NO_DRAFT)
        proposed = offsets[None, :] <= counts[:, None]  # t, then the proposed drafts
        filled = torch.where(drafts == NO_DRAFT, pending[:, None], drafts)
        inputs = torch.cat((pending[:, None], filled), 1)
        if self._check_inputs:
            _assert_token_ids(inputs)
        return Drafted(
            base=base,
            inputs=inputs,
            drafts=drafts,
            counts=counts,
            found=proposal.counts,
            positions=positions.clamp(max=context - 1),
            table_positions=torch.where(proposed, positions, context),
        )

    def record_accepted(self, slots: torch.Tensor, drafted: Drafted, accepted: Accepted) -> None:
        """Each verify row's pending token is now its last emitted one."""
        self.next_pos.index_copy_(
            0, slots, (drafted.base + accepted.accepted + 1).clamp(max=self.context - 1)
        )


class DraftPlaceholderError(RuntimeError):
    """A verify row's input is not a token id: a draft placeholder would reach the embedding."""


def _assert_token_ids(inputs: torch.Tensor) -> None:
    # NOTE: reads a count back, so the forward thread waits for the device here: under
    # --check-invariants (tests and debug runs) only, as the FutureMap's sentinel check.
    bad = int((inputs < 0).sum().item())
    if bad:
        raise DraftPlaceholderError(f"{bad} verify row inputs are not token ids (a draft placeholder)")


def accept(drafted: Drafted, sampled: torch.Tensor) -> Accepted:
    """`sampled` [Bv, K + 1]: entry j's token, drawn at position base + j + 1. Drafts pass
    while each equals the token sampled before it."""
    k = drafted.drafts.shape[1]
    offsets = torch.arange(k + 1, device=sampled.device)
    passes = (drafted.drafts == sampled[:, :k]) & (offsets[None, :k] < drafted.counts[:, None])
    accepted = passes.to(torch.int64).cumprod(1).sum(1)
    last = sampled.gather(1, accepted[:, None])[:, 0]
    emitted = (offsets[None, :] <= accepted[:, None]).to(torch.int64)
    proposed = ((offsets[None, :] >= 1) & (offsets[None, :] <= drafted.counts[:, None])).to(torch.int64)
    found = ((offsets[None, :] == 0) & (drafted.found[:, None] > 0)).to(torch.int64)
    return Accepted(accepted, last, emitted * EMITTED + proposed * PROPOSED + found * FOUND)
