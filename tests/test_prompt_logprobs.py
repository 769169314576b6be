"""Prompt log-probabilities (`echo` with `logprobs` on /v1/completions, `sampling.prompt_logprobs`
on the gRPC API): the worker scores each prompt position against the prompt token that follows it,
as it computes the prompt, chunk by chunk (`Launch.row_score`), and the first token carries them
to the client.

The reference is transformers: its log-softmax over the whole prompt at once, on a tiny random
checkpoint it wrote itself (tests/test_architectures.py).
"""

from __future__ import annotations

import asyncio
import pathlib
from typing import Any

import grpc
import openai
import pytest
import torch

from stepahead.processes import serving_pair
from stepahead.protocol import (
    IN_ROW,
    NOT_SCORED,
    Launch,
    NewRequest,
    StepLogprobs,
    StepResult,
    launch_from_proto,
    launch_to_proto,
    result_from_proto,
    result_to_proto,
)
from stepahead.v1 import generation_pb2 as pb
from stepahead.v1 import generation_pb2_grpc
from stepahead_cli.serve import free_port
from tests.live import CALL_TIMEOUT_S
from tests.test_architectures import VOCAB, hf_checkpoint, prompt, write_char_tokenizer
from tests.test_worker_processing import engine_of
from worker_svc import backends
from worker_svc.backends import SIM_UNLIKELY_LOGPROB, load_backend, sim_next_token
from worker_svc.engine import WorkerEngine
from worker_svc.launch_check import LaunchError, LaunchLimits, check_launch

CPU = torch.device("cpu")
ATOL = 1e-4  # float32 against float32, the same weights (tests/test_architectures.py)
TOP = 3
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, pathlib.Path]:
    directory = tmp_path_factory.mktemp("llama")
    model = hf_checkpoint("llama", directory)
    write_char_tokenizer(directory)
    return model, directory


def reference(model: Any, tokens: list[int]) -> torch.Tensor:
    """transformers' log-probabilities [n - 1, V] of each position's next token, the whole prompt at once."""
    with torch.no_grad():
        logits: torch.Tensor = model(torch.tensor([tokens])).logits[0].float()
    return logits[:-1].log_softmax(-1)


def check_scores(scores: StepLogprobs, expected: torch.Tensor, targets: list[int]) -> None:
    assert len(scores.chosen) == len(targets) == expected.shape[0]
    got = torch.tensor(scores.chosen)
    assert torch.allclose(got, expected[torch.arange(len(targets)), torch.tensor(targets)], atol=ATOL)
    top_values, top_ids = expected.topk(scores.top_n, dim=-1)
    assert scores.top_ids == top_ids.flatten().tolist()
    assert torch.allclose(torch.tensor(scores.top_logprobs), top_values.flatten(), atol=ATOL)


def submit(engine: WorkerEngine, launch: Launch) -> StepResult:
    return engine.submit(launch).result(timeout=120)


# ---- the worker ----------------------------------------------------------------------------------


@pytest.mark.parametrize("score_slice", [backends.SCORE_SLICE, 3])
def test_a_prompt_scored_in_two_chunks_equals_transformers_whole_prompt(
    checkpoint: tuple[Any, pathlib.Path], score_slice: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first chunk's last position is scored against the second chunk's first token (its
    launch names it); the second chunk's last position samples and is not scored. Another
    request's rows in the same launches are not scored. The scores' logits are made a slice of
    positions at a time (`SCORE_SLICE`): the same, whatever the slice."""
    monkeypatch.setattr(backends, "SCORE_SLICE", score_slice)
    model, directory = checkpoint
    engine = engine_of(load_backend(str(directory), CPU, torch.float32, 1.0, 0.0))
    try:
        tokens, other = prompt(20, seed=5), prompt(6, seed=6)
        cut = 8
        first = Launch(
            1,
            new_requests=[NewRequest(0, 0.0, 1.0, 0, 0), NewRequest(1, 0.0, 1.0, 0, 0)],
            row_req_slots=[1, 0],
            row_start_pos=[0, 0],
            row_num_tokens=[len(other), cut],
            row_from_future=[False, False],
            row_sample=[True, False],
            prompt_ids=other + tokens[:cut],
            kv_slots=list(range(len(other) + cut)),
            row_score=[NOT_SCORED, tokens[cut]],
            score_top_n=TOP,
        )
        second = Launch(
            2,
            row_req_slots=[0, 1],
            row_start_pos=[cut, len(other)],
            row_num_tokens=[len(tokens) - cut, 1],
            row_from_future=[False, True],
            row_sample=[True, True],
            prompt_ids=tokens[cut:],
            kv_slots=list(range(100, 100 + len(tokens) - cut + 1)),
            row_score=[IN_ROW, NOT_SCORED],
            score_top_n=TOP,
        )
        assert (first.num_scored, second.num_scored) == (cut, len(tokens) - cut - 1)
        one, two = submit(engine, first), submit(engine, second)
    finally:
        engine.shutdown()
    expected = reference(model, tokens)
    assert one.prompt_logprobs is not None and two.prompt_logprobs is not None
    check_scores(one.prompt_logprobs, expected[:cut], tokens[1 : cut + 1])
    check_scores(two.prompt_logprobs, expected[cut:], tokens[cut + 1 :])
    with torch.no_grad():  # the sampling rows are as they were: the greedy next tokens
        greedy = int(model(torch.tensor([tokens])).logits[0, -1].argmax())
    assert two.token_ids[0] == greedy


def test_a_launch_that_scores_nothing_returns_no_prompt_logprobs() -> None:
    engine = engine_of(load_backend("tiny", CPU, torch.float32, 1.0, 0.0))
    try:
        launch = Launch(
            1,
            new_requests=[NewRequest(0, 0.0, 1.0, 0, 0)],
            row_req_slots=[0],
            row_start_pos=[0],
            row_num_tokens=[4],
            row_from_future=[False],
            row_sample=[True],
            prompt_ids=[5, 6, 7, 8],
            kv_slots=[0, 1, 2, 3],
        )
        assert submit(engine, launch).prompt_logprobs is None
    finally:
        engine.shutdown()


def test_the_sim_scores_its_own_next_token_as_certain() -> None:
    """A target that is the sim's own next token scores 0.0, any other SIM_UNLIKELY_LOGPROB."""
    engine = engine_of(load_backend("sim", CPU, torch.float32, 0.0, 0.0))
    try:
        tokens = [40, 41, sim_next_token(41, 2), 50, 60]  # position 1's next is the sim's own
        launch = Launch(
            1,
            new_requests=[NewRequest(0, 0.0, 1.0, 0, 0)],
            row_req_slots=[0],
            row_start_pos=[0],
            row_num_tokens=[len(tokens)],
            row_from_future=[False],
            row_sample=[True],
            prompt_ids=tokens,
            kv_slots=list(range(len(tokens))),
            row_score=[IN_ROW],
            score_top_n=2,
        )
        scores = submit(engine, launch).prompt_logprobs
    finally:
        engine.shutdown()
    assert scores is not None and scores.top_n == 2
    expected = [
        0.0 if tokens[p + 1] == sim_next_token(tokens[p], p + 1) else SIM_UNLIKELY_LOGPROB for p in range(4)
    ]
    assert scores.chosen == expected and expected[1] == 0.0
    assert scores.top_ids[2:4] == [sim_next_token(tokens[1], 2), sim_next_token(tokens[1], 2) + 1]


LIMITS = LaunchLimits(
    kv_slots=64, request_slots=4, max_context_len=64, vocab_size=VOCAB, max_batch_tokens=64, draft_tokens=0
)


def scored_launch(**changes: Any) -> Launch:
    fields: dict[str, Any] = {
        "new_requests": [NewRequest(0, 0.0, 1.0, 0, 0)],
        "row_req_slots": [0],
        "row_start_pos": [0],
        "row_num_tokens": [3],
        "row_from_future": [False],
        "row_sample": [True],
        "prompt_ids": [4, 5, 6],
        "kv_slots": [0, 1, 2],
        "row_score": [IN_ROW],
        "score_top_n": 1,
    }
    return Launch(1, **{**fields, **changes})


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"row_score": [IN_ROW, IN_ROW]}, "row_score: 2 entries for 1 rows"),
        ({"row_score": [-3]}, "row_score[0]: -3 is not"),
        ({"row_score": [VOCAB]}, f"row_score[0]: {VOCAB} is not"),
        ({"score_top_n": 21}, "score_top_n: 21 is outside [0, 20]"),
        (
            {"row_from_future": [True], "row_num_tokens": [1], "prompt_ids": [], "kv_slots": [0]},
            "row_score[0]: a row_from_future row has no prompt positions",
        ),
    ],
)
def test_a_malformed_score_column_is_refused_by_name(changes: dict[str, Any], named: str) -> None:
    check_launch(scored_launch(), LIMITS)
    with pytest.raises(LaunchError, match=named.replace("[", r"\[").replace("]", r"\]")):
        check_launch(scored_launch(**changes), LIMITS)


def test_the_score_fields_round_trip_the_wire() -> None:
    launch = scored_launch(row_score=[7], score_top_n=4)
    assert launch_from_proto(launch_to_proto(launch)) == launch
    scores = StepLogprobs([-1.5, -0.25], 1, [3, 4], [-0.125, -0.5])  # float32 exactly
    result = StepResult(1, [9], prompt_logprobs=scores)
    assert result_from_proto(result_to_proto(result)).prompt_logprobs == scores
    assert result_from_proto(result_to_proto(StepResult(1, [9]))).prompt_logprobs is None


# ---- served: the OpenAI API and the gRPC API ---------------------------------------------------


def text_of(tokens: list[int]) -> str:
    """The char tokenizer's text of `tokens` (id i + 3 is character 33 + i)."""
    return "".join(chr(30 + t) for t in tokens)


def test_served_echo_with_logprobs_scores_the_prompt_as_transformers_does(
    checkpoint: tuple[Any, pathlib.Path],
) -> None:
    """The prompt is taken in chunks of at most 8 tokens (--max-batch-tokens 8), so chunk
    boundaries are scored across launches; a second request for the same prompt is scored again
    (no prefix-cache reuse). max_tokens 0 gives the prompt alone; the stream's first chunk
    carries the prompt's entries; the gRPC API returns them on the first message."""
    model, directory = checkpoint
    tokens = prompt(21, seed=9)
    text = text_of(tokens)
    expected = reference(model, tokens)
    chosen = expected[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])].tolist()
    scheduler_args = ["--max-batch-tokens", "8", "--http-port", str(free_port())]
    with serving_pair(["--model", str(directory)], scheduler_args) as (_, scheduler):
        url = scheduler.http_url + "/v1"
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=CALL_TIMEOUT_S)
        name = client.models.list().data[0].id
        for _ in range(2):
            got = client.completions.create(
                model=name, prompt=text, echo=True, logprobs=2, max_tokens=1, temperature=0
            )
            choice = got.choices[0]
            lp = choice.logprobs
            assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
            assert choice.text.startswith(text) and len(choice.text) == len(text) + 1
            assert lp.tokens[: len(tokens)] == list(text) and len(lp.tokens) == len(tokens) + 1
            assert lp.token_logprobs[0] is None and lp.top_logprobs is not None and lp.top_logprobs[0] is None
            assert lp.token_logprobs[1 : len(tokens)] == pytest.approx(chosen, abs=ATOL)
            assert lp.text_offset == list(range(len(tokens) + 1))
            for position in range(1, len(tokens)):
                top = lp.top_logprobs[position]
                assert top is not None and len(top) <= 3  # 2 alternatives and the token itself
                best = int(expected[position - 1].argmax())
                assert top[text_of([best])] == pytest.approx(float(expected[position - 1, best]), abs=ATOL)

        alone = client.completions.create(model=name, prompt=text, echo=True, logprobs=0, max_tokens=0)
        assert alone.choices[0].text == text and alone.choices[0].finish_reason == "length"
        assert alone.usage is not None and alone.usage.completion_tokens == 0
        alone_lp = alone.choices[0].logprobs
        assert alone_lp is not None and alone_lp.tokens == list(text)
        assert alone_lp.token_logprobs is not None
        assert alone_lp.token_logprobs[1:] == pytest.approx(chosen, abs=ATOL)

        # Sampled at temperature 1: without ignore_eos a sampled EOS would end it short of 3 tokens.
        stream = client.completions.create(
            model=name, prompt=text, echo=True, logprobs=1, max_tokens=3, stream=True, extra_body=NO_EOS
        )
        chunks = [c for c in stream if c.choices]
        first = chunks[0].choices[0]
        assert first.text.startswith(text) and first.logprobs is not None
        assert first.logprobs.tokens is not None and first.logprobs.tokens[: len(tokens)] == list(text)
        assert first.logprobs.token_logprobs is not None
        assert first.logprobs.token_logprobs[1 : len(tokens)] == pytest.approx(chosen, abs=ATOL)
        streamed = [t for c in chunks for t in (c.choices[0].logprobs.tokens or [])]  # type: ignore[union-attr]
        assert len(streamed) == len(tokens) + 3

        with pytest.raises(openai.BadRequestError, match="max_tokens"):
            client.completions.create(model=name, prompt=text, max_tokens=0)

        async def over_grpc() -> list[pb.GenerateResponse]:
            async with grpc.aio.insecure_channel(scheduler.address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                sampling = pb.SamplingParams(max_new_tokens=2, prompt_logprobs=1)
                request = pb.GenerateRequest(input_ids=pb.TokenIds(ids=tokens), sampling=sampling)
                return [r async for r in stub.Generate(request, timeout=CALL_TIMEOUT_S)]

        responses = asyncio.run(over_grpc())
    scored = responses[0].prompt_logprobs
    assert [s.token_id for s in scored] == tokens[1:]
    assert [s.logprob for s in scored] == pytest.approx(chosen, abs=ATOL)
    assert all(len(s.top_logprobs) == 1 for s in scored)
    assert all(not r.prompt_logprobs for r in responses[1:])
