"""Drafting and verifying on the worker (worker_svc/speculative.py): drafts come from each row's
own tokens on the device, a verify row's positions from the slot's device-held position, and a
draft passes while it equals the token sampled before it. For greedy rows that is one-at-a-time
greedy decoding; for sampled rows it is rejection sampling of a certain draft: accepted with
probability p(d), and a rejected position's token drawn from p without d, shown statistically
with the worker's own sampler (fixed seeds: the test is deterministic). Nothing is read back."""

from __future__ import annotations

import torch

from stepahead.speculative import SpeculativeConfig
from tests.transfer_guard import TransferGuard
from worker_svc.ngram import NO_DRAFT
from worker_svc.sampler import sample
from worker_svc.speculative import EMITTED, FOUND, PROPOSED, Drafted, Speculation, accept

# Chi-square at the 0.999 quantile for 2 degrees of freedom (a vocabulary of 4, less the draft).
CHI2_2_999 = 13.82


def drafted(drafts: list[list[int]], counts: list[int]) -> Drafted:
    """Only what `accept` reads is real."""
    rows, k = len(drafts), len(drafts[0])
    zeros = torch.zeros(rows, k + 1, dtype=torch.int64)
    return Drafted(
        base=torch.zeros(rows, dtype=torch.int64),
        inputs=zeros,
        drafts=torch.tensor(drafts),
        counts=torch.tensor(counts),
        found=torch.tensor(counts),
        positions=zeros,
        table_positions=zeros,
    )


def test_drafts_pass_while_each_equals_the_token_sampled_before_it() -> None:
    d = drafted([[1, 2, 3], [1, 5, 3], [1, 2, NO_DRAFT], [NO_DRAFT] * 3], [3, 3, 2, 0])
    sampled = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [5, 0, 0, 0]])
    a = accept(d, sampled)
    assert a.accepted.tolist() == [3, 1, 2, 0]
    assert a.last.tolist() == [4, 2, 3, 5]  # every draft passed: the last position's token follows
    e, p, f = EMITTED, PROPOSED, FOUND
    assert a.entry_state.tolist() == [
        [e | f, e | p, e | p, e | p],
        [e | f, e | p, p, p],  # the second draft failed: that position's token replaces it
        [e | f, e | p, e | p, 0],  # two drafts proposed, both pass; the third entry's input is filler
        [e, 0, 0, 0],  # no drafts: one token, as without speculation
    ]


def test_a_draft_past_the_proposal_never_passes() -> None:
    """A filler input that happens to equal the sample is not a draft."""
    a = accept(drafted([[7, 7]], [1]), torch.tensor([[7, 7, 9]]))
    assert a.accepted.tolist() == [1] and a.last.tolist() == [7]


def test_sampled_rows_accept_a_draft_with_its_probability_and_draw_the_rest_without_it() -> None:
    """Each trial a seed of its own; the draft is token 1, p(1) = 0.5. Where it is rejected the
    token is distributed as p without 1, renormalised."""
    trials = 20_000
    p = torch.tensor([0.2, 0.5, 0.2, 0.1])
    logits = p.log()[None].expand(trials, 4).contiguous()
    ones = torch.ones(trials)
    first = sample(
        logits,
        ones,
        ones,
        torch.zeros(trials, dtype=torch.int64),
        torch.arange(trials, dtype=torch.int64) * 7919,
        torch.full((trials,), 5),
    )
    sampled = torch.stack((first, torch.zeros(trials, dtype=torch.int64)), 1)
    a = accept(drafted([[1]] * trials, [1] * trials), sampled)
    assert abs(float(a.accepted.double().mean()) - 0.5) < 0.015
    rejected = a.last[a.accepted == 0]
    assert not (rejected == 1).any()
    rest = torch.tensor([0.2, 0.2, 0.1]) / 0.5
    counts = torch.bincount(rejected, minlength=4)[[0, 2, 3]].double()
    expected = rest.double() * rejected.numel()
    assert float(((counts - expected) ** 2 / expected).sum()) < CHI2_2_999


def speculation(k: int = 3, context: int = 32) -> Speculation:
    s = Speculation(request_slots=4, kv_slots=64, context=context, device=torch.device("cpu"))
    s.config = SpeculativeConfig(k, 1, 2)
    return s


def test_drafts_come_from_the_rows_own_tokens_on_the_device() -> None:
    """Slot 2 holds 5 6 7 5 (KV slots 10..13) and its pending token 6 at position 4: the
    2-gram 5 6 occurred at 0, so it drafts what followed, 7 5 6 (the pending token included)."""
    s = speculation()
    req_to_token = torch.zeros(4, 33, dtype=torch.int64)
    req_to_token[2, :4] = torch.tensor([10, 11, 12, 13])
    s.record_inputs(torch.tensor([10, 11, 12, 13]), torch.tensor([5, 6, 7, 5]))
    s.record_sampled(torch.tensor([2]), torch.tensor([4]))
    d = s.draft(s.look_up(torch.tensor([2]), torch.tensor([6]), req_to_token, width=8), torch.tensor([1]))
    assert d.base.tolist() == [4] and d.counts.tolist() == [3]
    assert d.drafts.tolist() == [[7, 5, 6]] and d.inputs.tolist() == [[6, 7, 5, 6]]
    assert d.positions.tolist() == [[4, 5, 6, 7]] and d.table_positions.tolist() == [[4, 5, 6, 7]]


def test_positions_past_the_proposal_go_to_the_spare_column_and_saturate_at_the_context() -> None:
    """No earlier occurrence: no draft, the filler inputs repeat the pending token, and their
    KV goes to the spare column; near the context's end positions saturate."""
    s = speculation(k=3, context=6)
    req_to_token = torch.zeros(4, 7, dtype=torch.int64)
    s.record_sampled(torch.tensor([1]), torch.tensor([4]))
    d = s.draft(s.look_up(torch.tensor([1]), torch.tensor([9]), req_to_token, width=5), torch.tensor([1]))
    assert d.counts.tolist() == [0] and d.inputs.tolist() == [[9, 9, 9, 9]]
    assert d.table_positions.tolist() == [[4, 6, 6, 6]]
    assert d.positions.tolist() == [[4, 5, 5, 5]]
    a = accept(d, torch.tensor([[3, 0, 0, 0]]))
    s.record_accepted(torch.tensor([1]), d, a)
    assert s.next_pos[1].item() == 5


def test_drafting_and_accepting_read_nothing_back() -> None:
    s = speculation()
    req_to_token = torch.randint(0, 64, (4, 33))
    s.record_inputs(torch.arange(64), torch.randint(0, 5, (64,)))
    s.record_sampled(torch.tensor([0, 1, 3]), torch.tensor([20, 3, 31]))
    slots, pending, sampled = torch.tensor([0, 1, 3]), torch.tensor([1, 2, 3]), torch.randint(0, 5, (3, 4))
    drafting = torch.tensor([1, 0, 1])
    guard = TransferGuard()
    with guard.guarded():
        d = s.draft(s.look_up(slots, pending, req_to_token, width=32), drafting)
        a = accept(d, sampled)
        s.record_accepted(slots, d, a)
    assert not guard.violations, guard.violations


def test_a_row_that_does_not_draft_this_step_proposes_nothing() -> None:
    """A decode row of a drafting request (its drafts backed off): positions from the device,
    no drafts whatever its tokens hold, but what the lookup found is reported."""
    s = speculation()
    req_to_token = torch.zeros(4, 33, dtype=torch.int64)
    req_to_token[2, :4] = torch.tensor([10, 11, 12, 13])
    s.record_inputs(torch.tensor([10, 11, 12, 13]), torch.tensor([5, 6, 7, 5]))
    s.record_sampled(torch.tensor([2]), torch.tensor([4]))
    for drafting in (torch.tensor([0]), None):
        d = s.draft(s.look_up(torch.tensor([2]), torch.tensor([6]), req_to_token, width=8), drafting)
        assert d.counts.tolist() == [0] and d.drafts.tolist() == [[NO_DRAFT] * 3]
        assert d.positions[:, 0].tolist() == [4]
        assert d.found.tolist() == [3]  # what it would have carried: the scheduler is told
