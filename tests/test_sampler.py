"""Sampling: greedy, top-k/top-p cuts, exact categorical draws, and batch invariance."""

from __future__ import annotations

import pytest
import torch

from worker_svc.sampler import _row_keys, gumbel_noise, sample, uniform_bits

VOCAB = 258


def random_logits(rows: int, seed: int, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3.0


Params = tuple[float, float, int, int, int]  # temperature, top_p, top_k, seed, position


def param_tensors(params: list[Params]) -> tuple[torch.Tensor, ...]:
    temperature, top_p, top_k, seeds, positions = zip(*params, strict=True)
    return (
        torch.tensor(temperature, dtype=torch.float32),
        torch.tensor(top_p, dtype=torch.float32),
        torch.tensor(top_k, dtype=torch.int64),
        torch.tensor(seeds, dtype=torch.int64),
        torch.tensor(positions, dtype=torch.int64),
    )


def draw_rows(logits: torch.Tensor, params: list[Params]) -> torch.Tensor:
    return sample(logits, *param_tensors(params))


def repeat_row(logits: torch.Tensor, n: int) -> torch.Tensor:
    return logits[None, :].expand(n, -1).contiguous()


def test_greedy_is_argmax() -> None:
    logits = random_logits(16, 0)
    tokens = draw_rows(logits, [(0.0, 0.5, 3, i, i) for i in range(16)])
    assert torch.equal(tokens, logits.argmax(-1))
    assert tokens.dtype == torch.int64


@pytest.mark.parametrize("temperature", [0.5, 1.0, 3.0])
def test_top_k_one_and_tiny_top_p_are_greedy(temperature: float) -> None:
    logits = random_logits(32, 1)
    greedy = logits.argmax(-1)
    assert torch.equal(draw_rows(logits, [(temperature, 1.0, 1, i, 7) for i in range(32)]), greedy)
    assert torch.equal(draw_rows(logits, [(temperature, 1e-9, 0, i, 7) for i in range(32)]), greedy)


MIXED_PARAMS: list[Params] = [
    (0.0, 1.0, 0, 1, 5),  # greedy
    (1.0, 1.0, 0, 2, 5),  # plain
    (0.7, 1.0, 20, 3, 9),  # top-k
    (1.3, 0.8, 0, 4, 11),  # top-p
    (1.0, 0.9, 50, -5, 2**40),  # both, negative seed, large position
    (2.0, 1.0, VOCAB, 2**63 - 1, 0),  # top-k == V is no cut
    (0.9, 1.0, 0, -(2**63), 3),
    (1.0, 0.5, 5, 42, 100),
]


def test_row_draw_is_independent_of_batch_composition() -> None:
    logits = random_logits(len(MIXED_PARAMS), 2)
    together = draw_rows(logits, MIXED_PARAMS)
    for i, params in enumerate(MIXED_PARAMS):
        assert int(draw_rows(logits[i : i + 1], [params])) == int(together[i])
    for seed in range(3):
        order = torch.randperm(len(MIXED_PARAMS), generator=torch.Generator().manual_seed(seed))
        shuffled = draw_rows(logits[order], [MIXED_PARAMS[i] for i in order.tolist()])
        assert torch.equal(shuffled, together[order])


def test_unfiltered_rows_draw_the_same_next_to_filtered_rows() -> None:
    # Unfiltered-only batches take a path without sorting; mixing in a top-k row forces the
    # sorted path, which must not change the unfiltered rows' draws.
    logits = random_logits(64, 3)
    plain = [(1.0, 1.0, 0, seed, 17) for seed in range(64)]
    alone = draw_rows(logits, plain)
    extra = random_logits(1, 4)
    mixed = draw_rows(torch.cat([extra, logits]), [(1.0, 1.0, 3, 0, 0), *plain])
    assert torch.equal(mixed[1:], alone)


def test_different_seeds_and_positions_give_different_draws() -> None:
    flat = torch.zeros(256, VOCAB)
    by_seed = draw_rows(flat, [(1.0, 1.0, 0, seed, 3) for seed in range(256)])
    by_position = draw_rows(flat, [(1.0, 1.0, 0, 9, pos) for pos in range(256)])
    assert len(set(by_seed.tolist())) > 120
    assert len(set(by_position.tolist())) > 120
    assert not torch.equal(by_seed, by_position)


def test_same_seed_and_position_repeat_exactly() -> None:
    logits = random_logits(1, 5)
    first = draw_rows(logits, [(1.0, 0.95, 40, 1234, 56)])
    assert all(torch.equal(first, draw_rows(logits, [(1.0, 0.95, 40, 1234, 56)])) for _ in range(3))


def empirical(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / tokens.numel()


NUM_DRAWS = 40000
SMALL_LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def test_draws_follow_softmax() -> None:
    logits = repeat_row(SMALL_LOGITS, NUM_DRAWS)
    for temperature in (1.0, 0.5, 2.0):
        tokens = draw_rows(logits, [(temperature, 1.0, 0, s, 0) for s in range(NUM_DRAWS)])
        expected = (SMALL_LOGITS.double() / temperature).softmax(-1)
        torch.testing.assert_close(empirical(tokens, 6), expected, atol=0.01, rtol=0)


def test_draws_across_positions_follow_softmax() -> None:
    logits = repeat_row(SMALL_LOGITS, NUM_DRAWS)
    tokens = draw_rows(logits, [(1.0, 1.0, 0, 77, pos) for pos in range(NUM_DRAWS)])
    torch.testing.assert_close(empirical(tokens, 6), SMALL_LOGITS.double().softmax(-1), atol=0.01, rtol=0)


def test_top_k_and_top_p_renormalise_over_the_kept_set() -> None:
    logits = repeat_row(SMALL_LOGITS, NUM_DRAWS)
    top3 = draw_rows(logits, [(1.0, 1.0, 3, s, 1) for s in range(NUM_DRAWS)])
    expected = torch.cat([SMALL_LOGITS[:3].double().softmax(-1), torch.zeros(3).double()])
    torch.testing.assert_close(empirical(top3, 6), expected, atol=0.01, rtol=0)
    # softmax(SMALL_LOGITS) = [.574, .211, .128, .078, .029, .004]: top_p 0.7 keeps two tokens.
    nucleus = draw_rows(logits, [(1.0, 0.7, 0, s, 1) for s in range(NUM_DRAWS)])
    expected = torch.cat([SMALL_LOGITS[:2].double().softmax(-1), torch.zeros(4).double()])
    torch.testing.assert_close(empirical(nucleus, 6), expected, atol=0.01, rtol=0)


def test_top_k_never_draws_outside_the_top_k() -> None:
    logits = repeat_row(random_logits(1, 6)[0] / 3.0, 4000)
    tokens = draw_rows(logits, [(1.5, 1.0, 5, s, s) for s in range(4000)])
    allowed = set(logits[0].topk(5).indices.tolist())
    assert set(tokens.tolist()) == allowed


def test_top_p_never_draws_outside_the_nucleus() -> None:
    row = random_logits(1, 7)[0] / 3.0
    temperature, top_p = 0.8, 0.6
    probs, order = (row / temperature).softmax(-1).sort(descending=True)
    size = int((probs.cumsum(-1) < top_p).sum()) + 1
    nucleus = set(order[:size].tolist())
    tokens = draw_rows(repeat_row(row, 4000), [(temperature, top_p, 0, s, 3) for s in range(4000)])
    assert set(tokens.tolist()) <= nucleus
    assert len(set(tokens.tolist())) >= min(size, 10)


def test_top_k_then_top_p_combined() -> None:
    row = random_logits(1, 8)[0] / 3.0
    tokens = draw_rows(repeat_row(row, 2000), [(1.0, 0.5, 4, s, 0) for s in range(2000)])
    top4 = row.topk(4).indices
    # top-p applies to the distribution renormalised over the top k.
    size = int((row[top4].softmax(-1).cumsum(-1) < 0.5).sum()) + 1
    assert set(tokens.tolist()) == set(top4[:size].tolist())


def draw_min_p(
    row: torch.Tensor, n: int, temperature: float, min_p: float, top_p: float = 1.0
) -> torch.Tensor:
    temperatures, top_ps, top_ks, seeds, positions = param_tensors(
        [(temperature, top_p, 0, s, 2) for s in range(n)]
    )
    min_ps = torch.full((n,), min_p, dtype=torch.float32)
    return sample(repeat_row(row, n), temperatures, top_ps, top_ks, seeds, positions, min_p=min_ps)


def test_min_p_renormalises_over_the_tokens_at_least_min_p_as_likely_as_the_top_one() -> None:
    # softmax(SMALL_LOGITS) = [.574, .211, .128, .078, .029, .004]; min_p 0.2 keeps p >= .115.
    tokens = draw_min_p(SMALL_LOGITS, NUM_DRAWS, 1.0, 0.2)
    expected = torch.cat([SMALL_LOGITS[:3].double().softmax(-1), torch.zeros(3).double()])
    torch.testing.assert_close(empirical(tokens, 6), expected, atol=0.01, rtol=0)
    # After temperature (as vLLM): at 2.0 the probabilities flatten and min_p 0.2 keeps five.
    hot = draw_min_p(SMALL_LOGITS, NUM_DRAWS, 2.0, 0.2)
    kept = (SMALL_LOGITS.double() / 2.0).softmax(-1)
    kept = torch.where(kept >= 0.2 * kept.max(), kept, 0.0)
    assert int((kept > 0).sum()) == 5
    torch.testing.assert_close(empirical(hot, 6), kept / kept.sum(), atol=0.01, rtol=0)


def test_min_p_one_is_greedy_and_a_min_p_that_cuts_nothing_changes_no_draw() -> None:
    row = random_logits(1, 9)[0]
    assert set(draw_min_p(row, 500, 1.5, 1.0).tolist()) == {int(row.argmax())}
    probs = row.softmax(-1)
    below_all = float(probs.min() / probs.max()) * 0.5
    plain = draw_rows(repeat_row(row, 500), [(1.0, 1.0, 0, s, 2) for s in range(500)])
    assert torch.equal(draw_min_p(row, 500, 1.0, below_all), plain)


def test_min_p_then_top_p_over_what_min_p_kept() -> None:
    row = random_logits(1, 10)[0] / 3.0
    probs = row.softmax(-1)
    kept = torch.where(probs >= 0.3 * probs.max(), probs, 0.0)
    kept = kept / kept.sum()
    ordered, order = kept.sort(descending=True)
    size = int((ordered.cumsum(-1) < 0.5).sum()) + 1
    tokens = draw_min_p(row, 3000, 1.0, 0.3, top_p=0.5)
    assert set(tokens.tolist()) == set(order[:size].tolist())


def mix32(x: int) -> int:
    """Pure-Python (unbounded integers) statement of the 32-bit mixer."""
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    return x ^ (x >> 16)


def python_bits(seed: int, position: int, token: int) -> int:
    seed &= 0xFFFFFFFFFFFFFFFF
    key = mix32(((seed & 0xFFFFFFFF) + 0x9E3779B9) & 0xFFFFFFFF)
    key = mix32(key ^ (seed >> 32))
    key = mix32(key ^ (position & 0xFFFFFFFF))
    second = mix32(key ^ 0x7F4A7C15)
    return mix32(mix32((token + key) & 0xFFFFFFFF) ^ second)


@pytest.mark.parametrize("seed", [0, 1, -1, 2**63 - 1, -(2**63), 0xDEADBEEF12345678 - 2**64])
def test_random_bits_match_unbounded_integer_arithmetic(seed: int) -> None:
    # Equality with big-integer arithmetic shows that no int64 intermediate overflowed.
    position = 2**33 + 12345
    keys = _row_keys(torch.tensor([seed]), torch.tensor([position]))
    tokens = torch.tensor([[0, 1, 255, 2**20, 2**31 - 1]])
    bits = uniform_bits(keys, tokens)[0].tolist()
    assert bits == [python_bits(seed, position, t) for t in tokens[0].tolist()]
    noise = gumbel_noise(keys, tokens)
    assert noise.dtype == torch.float64 and bool(torch.isfinite(noise).all())


def test_all_greedy_and_filter_hints_do_not_change_results() -> None:
    logits = random_logits(len(MIXED_PARAMS), 9)
    args = param_tensors(MIXED_PARAMS)
    hinted = sample(logits, *args, all_greedy=False, any_filter=True)
    assert torch.equal(hinted, sample(logits, *args))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_draws_equal_cpu_draws() -> None:
    logits = random_logits(len(MIXED_PARAMS), 10)
    args = param_tensors(MIXED_PARAMS)
    on_cuda = sample(logits.cuda(), *(t.cuda() for t in args))
    assert torch.equal(on_cuda.cpu(), sample(logits, *args))
