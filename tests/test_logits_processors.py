"""Device-side logits processing against reference formulas and transformers' own processors."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch

from stepahead.protocol import LogitsProcessing
from worker_svc.logits_processors import (
    HostSampled,
    RowPenalties,
    RowProcessing,
    Sampled,
    TokenHistory,
    pack_for_host,
    plan_step,
    process_logits,
    token_logprobs,
    unpack_from_host,
)

VOCAB = 40
SLOTS = 6
CONTEXT = 16


def rows(
    slots: list[int],
    history: TokenHistory,
    *,
    repetition: list[float] | None = None,
    presence: list[float] | None = None,
    frequency: list[float] | None = None,
    masked: list[list[int]] | None = None,
    bias: list[dict[int, float]] | None = None,
) -> RowProcessing:
    """The RowProcessing the engine builds for rows of `slots`; `masked`: each row's ids that
    min_tokens holds back this step."""
    n = len(slots)
    pairs = [(r, i) for r, ids in enumerate(masked or [[] for _ in slots]) for i in ids]
    stop_mask = (
        torch.tensor([p[0] for p in pairs], dtype=torch.int64),
        torch.tensor([p[1] for p in pairs], dtype=torch.int64),
    )
    width = max(len(entries) for entries in bias or [{}])
    bias_ids = torch.zeros(n, width, dtype=torch.int64)
    bias_values = torch.zeros(n, width)
    for r, entries in enumerate(bias or []):
        bias_ids[r, : len(entries)] = torch.tensor(list(entries), dtype=torch.int64)
        bias_values[r, : len(entries)] = torch.tensor(list(entries.values()))
    index = torch.tensor(slots)
    lengths = torch.tensor([LENGTHS.get(slot, 1) for slot in slots])
    seen = history.seen(index, lengths, int(lengths.max()))
    penalties = RowPenalties(
        torch.tensor(repetition or [1.0] * n),
        torch.tensor(presence or [0.0] * n),
        torch.tensor(frequency or [0.0] * n),
        seen,
        history.output_counts[index[:, None], seen],
    )
    return RowProcessing(stop_mask, (bias_ids, bias_values), penalties)


LENGTHS: dict[int, int] = {}  # each slot's tokens in the history (the position it samples)


def history_of(prompts: dict[int, list[int]], outputs: dict[int, list[int]]) -> TokenHistory:
    """Each slot's prompt then outputs, by position; its outputs counted."""
    history = TokenHistory(SLOTS, VOCAB, CONTEXT, torch.device("cpu"))
    LENGTHS.clear()
    for slot in prompts.keys() | outputs.keys():
        ids = prompts.get(slot, []) + outputs.get(slot, [])
        LENGTHS[slot] = len(ids)
        slots = torch.tensor([slot] * len(ids), dtype=torch.int64)
        history.add_tokens(slots, torch.arange(len(ids)), torch.tensor(ids, dtype=torch.int64))
        generated = outputs.get(slot, [])
        history.add_outputs(slots[: len(generated)], torch.tensor(generated, dtype=torch.int64))
    return history


def random_logits(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


PROMPTS = {0: [1, 2, 3, 3], 2: [5, 6], 4: [7]}
OUTPUTS = {0: [9, 9, 9, 2], 2: [6, 11], 4: []}


def test_no_processing_leaves_the_logits_as_they_are() -> None:
    logits = random_logits(3, 0)
    out = process_logits(logits, rows([0, 2, 4], history_of(PROMPTS, OUTPUTS)))
    assert torch.equal(out, logits)
    assert torch.equal(process_logits(logits, RowProcessing(None, None, None)), logits)


def test_repetition_penalty_is_transformers_over_prompt_and_output() -> None:
    processors: Any = importlib.import_module("transformers.generation.logits_process")
    logits = random_logits(3, 1)
    out = process_logits(logits, rows([0, 2, 4], history_of(PROMPTS, OUTPUTS), repetition=[1.3, 0.8, 2.0]))
    for r, (slot, penalty) in enumerate(zip([0, 2, 4], [1.3, 0.8, 2.0], strict=True)):
        reference = processors.RepetitionPenaltyLogitsProcessor(penalty)
        seen = torch.tensor([PROMPTS[slot] + OUTPUTS[slot]])
        torch.testing.assert_close(
            out[r : r + 1], reference(seen, logits[r : r + 1].clone()), rtol=0, atol=1e-6
        )


def test_presence_and_frequency_penalties_are_openai_s_over_output_tokens_only() -> None:
    logits = random_logits(2, 2)
    out = process_logits(
        logits, rows([0, 2], history_of(PROMPTS, OUTPUTS), presence=[0.5, -1.0], frequency=[0.25, 2.0])
    )
    for r, (slot, presence, frequency) in enumerate([(0, 0.5, 0.25), (2, -1.0, 2.0)]):
        expected = logits[r].clone()
        for token in set(OUTPUTS[slot]):
            expected[token] -= frequency * OUTPUTS[slot].count(token) + presence
        torch.testing.assert_close(out[r], expected, rtol=0, atol=1e-6)
    assert out[0, 1] == logits[0, 1]  # a prompt token is not an output token


def test_min_tokens_masks_the_stop_ids_of_rows_that_generated_too_few() -> None:
    requests = [
        LogitsProcessing(prompt_len=4, min_tokens=5, stop_ids=(39, 7)),
        LogitsProcessing(prompt_len=2, min_tokens=2, stop_ids=(39,)),
        None,  # a plain row
        LogitsProcessing(prompt_len=1, min_tokens=1, stop_ids=(39,)),
    ]
    # Sampling positions 8, 4, 9, 1: generated so far 4, 2, -, 0.
    plan = plan_step(requests, [8, 4, 9, 1])
    assert list(zip(plan.mask_rows, plan.mask_ids, strict=True)) == [(0, 39), (0, 7), (3, 39)]
    assert plan.processes and not plan.penalized and plan.bias_width == 0 and plan.top_logprobs is None
    logits = random_logits(4, 3)
    mask = (torch.tensor(plan.mask_rows), torch.tensor(plan.mask_ids))
    out = process_logits(logits, RowProcessing(mask, None, None))
    assert out[0, 39] == out[0, 7] == out[3, 39] == float("-inf")
    finite = torch.ones_like(out, dtype=torch.bool)
    finite[0, [39, 7]] = finite[3, 39] = False
    assert torch.equal(out[finite], logits[finite])


def test_a_step_plan_takes_the_most_alternatives_of_the_rows_that_ask() -> None:
    asks = [LogitsProcessing(1, logprobs=True, top_logprobs=3), LogitsProcessing(1, logprobs=True)]
    penalized = LogitsProcessing(1, frequency_penalty=0.5, logit_bias=((1, 2.0), (3, 1.0)))
    plan = plan_step([*asks, penalized, None], [5, 5, 5, 5])
    assert plan.top_logprobs == 3 and plan.penalized and plan.bias_width == 2 and not plan.mask_ids
    only_chosen = plan_step([asks[1]], [5])
    assert only_chosen.top_logprobs == 0 and not only_chosen.processes
    assert plan_step([LogitsProcessing(1, top_logprobs=5)], [5]).top_logprobs is None  # logprobs off


def test_logit_bias_adds_to_the_listed_ids_of_its_own_row() -> None:
    logits = random_logits(2, 4)
    out = process_logits(logits, rows([0, 2], history_of({}, {}), bias=[{3: 100.0, 4: -100.0}, {3: 1.5}]))
    expected = logits.clone()
    expected[0, 3] += 100.0
    expected[0, 4] -= 100.0
    expected[1, 3] += 1.5
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_a_row_is_processed_the_same_alone_and_in_any_batch() -> None:
    history = history_of(PROMPTS, OUTPUTS)
    settings: dict[str, Any] = dict(
        repetition=[1.2, 1.5, 0.9],
        presence=[0.3, 0.0, 1.0],
        frequency=[0.1, 0.7, 0.0],
        masked=[[39], [], [39, 12]],
        bias=[{1: 2.0}, {}, {5: -3.0, 39: 1.0}],
    )
    logits = random_logits(3, 5)
    together = process_logits(logits, rows([0, 2, 4], history, **settings))
    for r in range(3):
        alone_settings = {k: [v[r]] for k, v in settings.items()}
        alone = process_logits(logits[r : r + 1], rows([[0, 2, 4][r]], history, **alone_settings))
        assert torch.equal(alone[0], together[r])


def test_history_counts_repeated_outputs_and_a_reset_forgets_the_slot() -> None:
    history = history_of(PROMPTS, OUTPUTS)
    history.add_outputs(torch.tensor([0, 0, 2]), torch.tensor([9, 9, 6]))  # one step may repeat a slot
    assert history.output_counts[0, 9] == 5 and history.output_counts[2, 6] == 2
    history.reset(torch.tensor([0]))
    assert not history.output_counts[0].any() and history.output_counts[2, 11] == 1


def test_a_row_sees_its_tokens_below_its_length_and_repeats_its_first_beyond() -> None:
    history = history_of(PROMPTS, OUTPUTS)
    history.add_tokens(torch.tensor([2]), torch.tensor([6]), torch.tensor([33]))  # beyond slot 2's length
    seen = history.seen(torch.tensor([0, 2, 4]), torch.tensor([8, 4, 1]), 8)
    assert seen.tolist() == [[1, 2, 3, 3, 9, 9, 9, 2], [5, 6, 6, 11, 5, 5, 5, 5], [7] * 8]


@pytest.mark.parametrize("top_n", [0, 1, 5, 20])
def test_logprobs_are_the_model_distribution_s_log_softmax(top_n: int) -> None:
    logits = random_logits(4, 6)
    chosen = torch.tensor([0, 5, 39, 17])
    got = token_logprobs(logits, chosen, top_n)
    reference = torch.log_softmax(logits.double(), dim=-1)
    torch.testing.assert_close(
        got.chosen.double(), reference.gather(1, chosen[:, None])[:, 0], rtol=0, atol=1e-5
    )
    assert got.top_ids.shape == (4, top_n)
    expected_ids = reference.argsort(dim=-1, descending=True)[:, :top_n]
    assert torch.equal(got.top_ids, expected_ids)
    torch.testing.assert_close(
        got.top_logprobs.double(), reference.gather(1, expected_ids), rtol=0, atol=1e-5
    )


@pytest.mark.parametrize("top_n", [0, 3])
def test_ids_and_logprobs_survive_the_packed_copy(top_n: int) -> None:
    logits = random_logits(3, 7)
    ids = torch.tensor([4, 39, 0])
    sampled = Sampled(ids, token_logprobs(logits, ids, top_n))
    packed = pack_for_host(sampled)
    assert packed.shape == (3, 2 + 2 * top_n) and packed.dtype == torch.float64
    host = unpack_from_host(packed)
    logprobs = host.logprobs
    assert host.tokens == [4, 39, 0] and logprobs is not None and logprobs.top_n == top_n
    lp = sampled.logprobs
    assert lp is not None
    assert logprobs.chosen == lp.chosen.tolist()
    assert logprobs.top_ids == lp.top_ids.flatten().tolist()
    assert logprobs.top_logprobs == lp.top_logprobs.flatten().tolist()
    assert unpack_from_host(pack_for_host(Sampled(ids))) == HostSampled([4, 39, 0], None, None)
    # With a verify row, each entry's state rides along as the last column.
    states = torch.tensor([1, 3, 2])
    with_states = unpack_from_host(pack_for_host(Sampled(ids, sampled.logprobs, states)), with_states=True)
    assert with_states.tokens == [4, 39, 0] and with_states.states == [1, 3, 2]
    assert with_states.logprobs is not None and with_states.logprobs.chosen == logprobs.chosen
    plain = unpack_from_host(pack_for_host(Sampled(ids, None, states)), with_states=True)
    assert plain == HostSampled([4, 39, 0], None, [1, 3, 2])
