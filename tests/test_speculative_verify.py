"""Verifying drafts (worker_svc/speculative.py): greedy rows emit exactly what one-at-a-time
greedy decoding would; sampled rows, by rejection sampling, emit each token with exactly the
model's distribution, shown statistically over many independent rows of a tiny vocabulary (a
fixed seed: the test is deterministic); nothing is read back to the host."""

from __future__ import annotations

import pytest
import torch

from tests.transfer_guard import TransferGuard
from worker_svc.speculative import NO_TOKEN, verify

# Chi-square at the 0.999 quantile for 3 degrees of freedom (a vocabulary of 4).
CHI2_3_999 = 16.27


def one_hot_greedy(argmaxes: list[list[int]], vocab: int) -> torch.Tensor:
    """[R, k + 1, V] distributions whose argmax at each position is given (not one-hot: the
    argmax holds 0.4 and the rest share 0.6)."""
    rows = torch.full((len(argmaxes), len(argmaxes[0]), vocab), 0.6 / (vocab - 1))
    for r, row in enumerate(argmaxes):
        for j, a in enumerate(row):
            rows[r, j, a] = 0.4
    return rows


def test_greedy_rows_accept_the_leading_argmax_drafts_then_the_argmax() -> None:
    vocab = 6
    argmaxes = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [5, 0, 0, 0]]
    drafts = torch.tensor([[1, 2, 3], [1, 5, 3], [1, 2, 0], [2, 2, 2]])
    counts = torch.tensor([3, 3, 2, 0])
    v = verify(
        one_hot_greedy(argmaxes, vocab),
        drafts,
        counts,
        torch.ones(4, dtype=torch.bool),
        torch.zeros(4, 3),
        torch.zeros(4, 4),
    )
    assert v.tokens.tolist() == [
        [1, 2, 3, 4],  # every draft passes: the last position's argmax follows
        [1, 2, NO_TOKEN, NO_TOKEN],  # the second draft fails: replaced by that position's argmax
        [1, 2, 3, NO_TOKEN],  # two drafts proposed, both pass
        [5, NO_TOKEN, NO_TOKEN, NO_TOKEN],  # no drafts: one token, as without speculation
    ]
    assert v.counts.tolist() == [4, 2, 3, 1]
    assert v.accepted.tolist() == [3, 1, 2, 0]


def chi_square(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * samples.numel()
    return float(((counts - expected) ** 2 / expected).sum())


def test_sampled_rows_emit_the_models_distribution() -> None:
    """Two drafts a row, the first of them likely (0.5) and the second unlikely (0.1): the first
    token emitted is distributed as p0, and where the first draft was accepted the second token
    as p1 (the distribution the forward computed after that draft)."""
    generator = torch.Generator().manual_seed(1234)
    trials = 40_000
    p0 = torch.tensor([0.2, 0.5, 0.2, 0.1])
    p1 = torch.tensor([0.1, 0.3, 0.4, 0.2])
    p2 = torch.tensor([0.25, 0.25, 0.25, 0.25])
    probs = torch.stack((p0, p1, p2))[None].expand(trials, 3, 4)
    drafts = torch.tensor([1, 3]).expand(trials, 2)
    v = verify(
        probs,
        drafts,
        torch.full((trials,), 2),
        torch.zeros(trials, dtype=torch.bool),
        torch.rand(trials, 2, generator=generator),
        torch.rand(trials, 3, generator=generator),
    )
    first = v.tokens[:, 0]
    assert chi_square(first, p0) < CHI2_3_999
    second = v.tokens[first == 1, 1]
    assert chi_square(second, p1) < CHI2_3_999
    # Acceptance as the theory says: the first draft p0(1) of the time, the second p1(3) of those.
    assert abs(float((v.accepted >= 1).double().mean()) - 0.5) < 0.01
    assert abs(float((v.accepted == 2).double().mean()) - 0.5 * 0.2) < 0.01


def test_always_accepting_would_fail_the_distribution_check() -> None:
    """The statistic's power: the first draft emitted every time is far from p0."""
    p0 = torch.tensor([0.2, 0.5, 0.2, 0.1])
    assert chi_square(torch.full((40_000,), 1), p0) > 100 * CHI2_3_999


def test_nothing_is_read_back_to_the_host() -> None:
    probs = torch.softmax(torch.randn(5, 4, 11), -1)
    drafts, counts = torch.randint(0, 11, (5, 3)), torch.tensor([3, 0, 1, 2, 3])
    greedy = torch.tensor([True, False, True, False, False])
    accept, draw = torch.rand(5, 3), torch.rand(5, 4)
    guard = TransferGuard()
    with guard.guarded():
        verify(probs, drafts, counts, greedy, accept, draw)
    assert not guard.violations, guard.violations


def test_no_draft_position_is_refused() -> None:
    with pytest.raises(ValueError, match="no draft"):
        verify(
            torch.ones(1, 1, 4) / 4,
            torch.zeros(1, 0, dtype=torch.int64),
            torch.zeros(1, dtype=torch.int64),
            torch.zeros(1, dtype=torch.bool),
            torch.zeros(1, 0),
            torch.zeros(1, 1),
        )
