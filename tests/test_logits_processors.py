"""Device-side logits processing against reference formulas and transformers' own processors."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch

from worker_svc.logits_processors import RowProcessing, TokenHistory, process_logits, token_logprobs

VOCAB = 40
SLOTS = 6


def rows(
    slots: list[int],
    *,
    repetition: list[float] | None = None,
    presence: list[float] | None = None,
    frequency: list[float] | None = None,
    min_tokens: list[int] | None = None,
    stops: list[list[int]] | None = None,
    bias: list[dict[int, float]] | None = None,
) -> RowProcessing:
    n = len(slots)
    stop_mask = torch.zeros(n, VOCAB, dtype=torch.bool)
    for r, ids in enumerate(stops or [[] for _ in slots]):
        stop_mask[r, ids] = True
    triples = [(r, i, v) for r, entries in enumerate(bias or [{} for _ in slots]) for i, v in entries.items()]
    return RowProcessing(
        slots=torch.tensor(slots),
        repetition_penalty=torch.tensor(repetition or [1.0] * n),
        presence_penalty=torch.tensor(presence or [0.0] * n),
        frequency_penalty=torch.tensor(frequency or [0.0] * n),
        min_tokens=torch.tensor(min_tokens or [0] * n),
        stop_mask=stop_mask,
        bias_rows=torch.tensor([t[0] for t in triples], dtype=torch.int64),
        bias_ids=torch.tensor([t[1] for t in triples], dtype=torch.int64),
        bias_values=torch.tensor([t[2] for t in triples], dtype=torch.float32),
    )


def history_of(prompts: dict[int, list[int]], outputs: dict[int, list[int]]) -> TokenHistory:
    history = TokenHistory(SLOTS, VOCAB, torch.device("cpu"))
    for slot, ids in prompts.items():
        history.add_prompt(
            torch.tensor([slot] * len(ids), dtype=torch.int64), torch.tensor(ids, dtype=torch.int64)
        )
    for slot, ids in outputs.items():
        history.add_outputs(
            torch.tensor([slot] * len(ids), dtype=torch.int64), torch.tensor(ids, dtype=torch.int64)
        )
    return history


def random_logits(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


PROMPTS = {0: [1, 2, 3, 3], 2: [5, 6], 4: [7]}
OUTPUTS = {0: [9, 9, 9, 2], 2: [6, 11], 4: []}


def test_no_processing_leaves_the_logits_as_they_are() -> None:
    logits = random_logits(3, 0)
    out = process_logits(logits, rows([0, 2, 4]), history_of(PROMPTS, OUTPUTS))
    assert torch.equal(out, logits)


def test_repetition_penalty_is_transformers_over_prompt_and_output() -> None:
    processors: Any = importlib.import_module("transformers.generation.logits_process")
    logits = random_logits(3, 1)
    out = process_logits(logits, rows([0, 2, 4], repetition=[1.3, 0.8, 2.0]), history_of(PROMPTS, OUTPUTS))
    for r, (slot, penalty) in enumerate(zip([0, 2, 4], [1.3, 0.8, 2.0], strict=True)):
        reference = processors.RepetitionPenaltyLogitsProcessor(penalty)
        seen = torch.tensor([PROMPTS[slot] + OUTPUTS[slot]])
        torch.testing.assert_close(
            out[r : r + 1], reference(seen, logits[r : r + 1].clone()), rtol=0, atol=1e-6
        )


def test_presence_and_frequency_penalties_are_openai_s_over_output_tokens_only() -> None:
    logits = random_logits(2, 2)
    out = process_logits(
        logits, rows([0, 2], presence=[0.5, -1.0], frequency=[0.25, 2.0]), history_of(PROMPTS, OUTPUTS)
    )
    for r, (slot, presence, frequency) in enumerate([(0, 0.5, 0.25), (2, -1.0, 2.0)]):
        expected = logits[r].clone()
        for token in set(OUTPUTS[slot]):
            expected[token] -= frequency * OUTPUTS[slot].count(token) + presence
        torch.testing.assert_close(out[r], expected, rtol=0, atol=1e-6)
    assert out[0, 1] == logits[0, 1]  # a prompt token is not an output token


def test_min_tokens_masks_eos_and_stop_ids_until_enough_were_generated() -> None:
    logits = random_logits(3, 3)
    processing = rows([0, 2, 4], min_tokens=[5, 2, 1], stops=[[39, 7], [39], [39]])
    out = process_logits(logits, processing, history_of(PROMPTS, OUTPUTS))
    assert out[0, 39] == out[0, 7] == float("-inf")  # 4 generated < 5
    assert out[1, 39] == logits[1, 39]  # 2 generated, not < 2
    assert out[2, 39] == float("-inf")  # none generated
    finite = torch.ones_like(out, dtype=torch.bool)
    finite[0, [39, 7]] = finite[2, 39] = False
    assert torch.equal(out[finite], logits[finite])


def test_logit_bias_adds_to_the_listed_ids_of_its_own_row() -> None:
    logits = random_logits(2, 4)
    out = process_logits(logits, rows([0, 2], bias=[{3: 100.0, 4: -100.0}, {3: 1.5}]), history_of({}, {}))
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
        min_tokens=[9, 0, 1],
        stops=[[39], [38], [39]],
        bias=[{1: 2.0}, {}, {5: -3.0}],
    )
    logits = random_logits(3, 5)
    together = process_logits(logits, rows([0, 2, 4], **settings), history)
    for r in range(3):
        alone_settings = {k: [v[r]] for k, v in settings.items()}
        alone = process_logits(logits[r : r + 1], rows([[0, 2, 4][r]], **alone_settings), history)
        assert torch.equal(alone[0], together[r])


def test_history_counts_repeated_outputs_and_a_reset_forgets_the_slot() -> None:
    history = history_of(PROMPTS, OUTPUTS)
    history.add_outputs(torch.tensor([0, 0, 2]), torch.tensor([9, 9, 6]))  # one step may repeat a slot
    assert history.output_counts[0, 9] == 5 and history.output_counts[2, 6] == 2
    assert history.generated.tolist()[:3] == [6, 0, 3]
    history.reset(torch.tensor([0]))
    assert not history.in_prompt[0].any() and not history.output_counts[0].any() and history.generated[0] == 0
    assert history.in_prompt[2, 5] and history.generated[2] == 3


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
