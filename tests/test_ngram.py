"""Prompt-lookup drafts on the device (worker_svc/ngram.py) against a plain reference written
from the definition: the longest suffix n-gram (min_n..max_n) that occurred earlier in the row,
its earliest occurrence, up to k of the tokens that followed it, none past the context limit;
for a batch of rows of different lengths in one padded tensor, with nothing read back."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.transfer_guard import TransferGuard
from worker_svc.ngram import NO_DRAFT, propose


def reference(tokens: list[int], min_n: int, max_n: int, k: int, max_context_len: int) -> list[int]:
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        for p in range(len(tokens) - n):  # earliest first; ends before the last token
            if tokens[p : p + n] == suffix:
                room = max(0, max_context_len - len(tokens))
                return tokens[p + n : p + n + min(k, room)]
    return []


def run(
    rows: list[list[int]], min_n: int, max_n: int, k: int, max_context_len: int, pad: int = 0
) -> list[list[int]]:
    width = max(len(r) for r in rows) + pad
    history = torch.full((len(rows), width), 7, dtype=torch.int64)  # padding that could match
    for i, r in enumerate(rows):
        history[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    drafts = propose(history, lengths, min_n, max_n, k, max_context_len)
    out = []
    for i in range(len(rows)):
        count = int(drafts.counts[i])
        assert all(t == NO_DRAFT for t in drafts.tokens[i, count:].tolist())
        out.append(drafts.tokens[i, :count].tolist())
    return out


def test_the_longest_suffix_match_proposes_what_followed_it() -> None:
    # [4, 2, 3] never occurred before; [2, 3] did, followed by 4, 2, 3 (three tokens: fewer than k).
    assert run([[1, 2, 3, 4, 2, 3]], 2, 3, 4, 100) == [[4, 2, 3]]
    # The earliest of two matches; a longer n-gram beats a shorter, later one.
    assert run([[5, 1, 9, 8, 5, 1, 6, 6, 5, 1]], 1, 2, 2, 100) == [[9, 8]]
    assert run([[5, 1, 7, 3, 5, 1, 9, 3, 5, 1]], 2, 3, 2, 100) == [[9, 3]]
    # A run of one token matches itself shifted by one.
    assert run([[8, 8, 8, 8]], 2, 2, 3, 100) == [[8, 8]]
    # No match, too short a row, no room left in the context.
    assert run([[1, 2, 3, 4]], 1, 2, 3, 100) == [[]]
    assert run([[1, 1]], 2, 2, 3, 100) == [[]]
    assert run([[1, 2, 1, 2, 1]], 1, 1, 3, 5) == [[]]
    assert run([[1, 2, 1, 2, 1]], 1, 1, 3, 6) == [[2]]


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=24), min_size=1, max_size=6),
    min_n=st.integers(1, 3),
    extra_n=st.integers(0, 3),
    k=st.integers(1, 5),
    room=st.integers(0, 6),
    pad=st.integers(0, 3),
)
def test_batched_drafts_equal_the_reference_row_by_row(
    rows: list[list[int]], min_n: int, extra_n: int, k: int, room: int, pad: int
) -> None:
    max_n = min_n + extra_n
    max_context_len = max(len(r) for r in rows) + room
    expected = [reference(r, min_n, max_n, k, max_context_len) for r in rows]
    assert run(rows, min_n, max_n, k, max_context_len, pad) == expected


def test_nothing_is_read_back_to_the_host() -> None:
    history = torch.randint(0, 4, (8, 64))
    lengths = torch.randint(1, 65, (8,))
    guard = TransferGuard()
    with guard.guarded():
        propose(history, lengths, 1, 4, 3, 128)
    assert not guard.violations, guard.violations


def test_a_bad_configuration_is_refused() -> None:
    history, lengths = torch.zeros(1, 4, dtype=torch.int64), torch.tensor([4])
    for min_n, max_n, k in ((0, 2, 1), (3, 2, 1), (1, 2, 0)):
        with pytest.raises(ValueError, match="min_n"):
            propose(history, lengths, min_n, max_n, k, 8)
