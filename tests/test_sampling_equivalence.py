"""The sampling features under overlap: a mixed workload in which every feature is used
(penalties, min_tokens, logit_bias, logprobs, n; several at once on some requests), greedy and
seeded, with preemptions and aborts, served by the serial and the overlap loop on `tiny`:
the same tokens, the same log-probabilities, every slot free after the drain."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
import torch

from scheduler_svc.contract import FinishReason, SamplingParams
from scheduler_svc.engine.core import EngineCore
from tests.harness import ClientView, WorkItem, mixed_workload, serve_workload, with_forced_scenarios
from tests.test_equivalence import check_drained
from tests.test_model import reference_logits
from tests.test_worker_processing import model_of
from worker_svc.engine import WorkerEngine

pytestmark = pytest.mark.anyio

EOS = 257
LOGPROB_ATOL = 1e-5


def with_features(rng: random.Random, item: WorkItem) -> WorkItem:
    """The item with a random subset of the sampling features (none for about one in six)."""
    p = item.params
    features: dict[str, object] = {}
    if rng.random() < 0.4:
        features.update(logprobs=True, top_logprobs=rng.choice((0, 1, 5, 20)))
    if rng.random() < 0.3:
        features["repetition_penalty"] = rng.choice((0.8, 1.2, 1.5, 2.0))
    if rng.random() < 0.3:
        features["presence_penalty"] = rng.choice((-1.0, 0.5, 2.0))
    if rng.random() < 0.3:
        features["frequency_penalty"] = rng.choice((-0.5, 1.0, 2.0))
    if rng.random() < 0.25:
        features["min_tokens"] = rng.randint(1, p.max_new_tokens)
    if rng.random() < 0.25:
        ids = rng.sample(range(32, 127), rng.randint(1, 8)) + ([EOS] if rng.random() < 0.3 else [])
        features["logit_bias"] = tuple(sorted((i, rng.choice((-100.0, -5.0, 3.0, 100.0))) for i in ids))
    n = rng.choice((2, 3)) if rng.random() < 0.15 else 1
    return replace(item, params=replace(p, **features), n=n)  # type: ignore[arg-type]


def features_workload(count: int, seed: int, *, sampled: bool, kv_slots: int) -> list[WorkItem]:
    """The mixed workload of the equivalence tests (stops of every kind, aborts, long and short
    prompts) with random sampling features on five requests in six, after a call that forces
    preemption in a pool of `kv_slots` and with two aborts that land for sure."""
    rng = random.Random(seed)
    items = mixed_workload(count, seed, sampled=sampled)
    items = [item if rng.random() < 1 / 6 else with_features(rng, item) for item in items]
    scoring = random.Random(seed + 1)  # its own draws: the other features stay as they were
    items = [
        replace(item, params=replace(item.params, prompt_logprobs=scoring.choice((0, 1, 5))))
        if scoring.random() < 0.2
        else item
        for item in items
    ]
    return with_forced_scenarios(items, kv_slots, sampled=sampled)


def completions(items: list[WorkItem]) -> list[tuple[str, WorkItem]]:
    """(view key, item) of every completion the workload asks for."""
    return [(item.rid if i == 0 else f"{item.rid}/{i}", item) for item in items for i in range(item.n)]


def check_views(items: list[WorkItem], views: dict[str, ClientView]) -> None:
    """Finishes, lengths, min_tokens and the shape of the log-probabilities."""
    for key, item in completions(items):
        view, p = views[key], item.params
        assert view.finish_reason is not None, key
        assert len(view.token_ids) <= p.max_new_tokens, key
        if view.finish_reason == FinishReason.LENGTH:
            assert len(view.token_ids) == p.max_new_tokens, key
        if view.finish_reason == FinishReason.STOP:
            assert len(view.token_ids) > p.min_tokens, key  # the stop came after min_tokens
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else {EOS})
        assert not stops & set(view.token_ids[: p.min_tokens]), key
        if not p.min_tokens:  # else a stop string may sit in the first tokens' text
            assert not any(stop in view.text for stop in p.stop), key
        check_logprobs(key, item, view)
        check_prompt_logprobs(key, item, view)


def check_prompt_logprobs(key: str, item: WorkItem, view: ClientView) -> None:
    """Once, with the first token, one per prompt token after the first, whatever preemption
    recomputed; the alternatives as asked, and the prompt's token among them where it is."""
    asked = item.params.prompt_logprobs
    if asked is None or not view.token_ids:
        assert not view.prompt_logprobs, key
        return
    assert len(view.prompt_logprobs) == 1, key
    scores = view.prompt_logprobs[0]
    assert len(scores) == len(item.prompt_ids) - 1, key
    for token, lp in zip(item.prompt_ids[1:], scores, strict=True):
        assert len(lp.top_ids) == len(lp.top_logprobs) == asked, key
        assert lp.logprob <= 0.0 and math.isfinite(lp.logprob), key
        if token in lp.top_ids:
            assert lp.top_logprobs[lp.top_ids.index(token)] == pytest.approx(lp.logprob, abs=1e-6), key


def check_logprobs(key: str, item: WorkItem, view: ClientView) -> None:
    p = item.params
    if not p.logprobs:
        assert not view.logprobs, key
        return
    assert len(view.logprobs) == len(view.token_ids), key
    for token, lp in zip(view.token_ids, view.logprobs, strict=True):
        assert len(lp.top_ids) == len(lp.top_logprobs) == p.top_logprobs, key
        assert list(lp.top_logprobs) == sorted(lp.top_logprobs, reverse=True), key
        assert lp.logprob <= 0.0 and math.isfinite(lp.logprob), key
        if p.temperature == 0 and not shapes_logits(p):
            assert lp.top_ids[:1] in ((), (token,)), key  # greedy picks the model's most likely
        if token in lp.top_ids:
            assert lp.top_logprobs[lp.top_ids.index(token)] == pytest.approx(lp.logprob, abs=1e-6), key


def check_prompt_scores_against_the_model(
    items: list[WorkItem], views: dict[str, ClientView], engine: WorkerEngine
) -> None:
    """Each prompt's scores are the model's: the log-softmax of a dense forward of the prompt."""
    model = model_of(engine)
    for key, item in completions(items):
        if not views[key].prompt_logprobs:
            continue
        expected = reference_logits(model, item.prompt_ids).double().log_softmax(-1)
        targets = torch.tensor(item.prompt_ids[1:], dtype=torch.long)
        chosen = expected[torch.arange(len(targets)), targets]
        got = [lp.logprob for lp in views[key].prompt_logprobs[0]]
        assert got == pytest.approx(chosen.tolist(), abs=LOGPROB_ATOL), key


def shapes_logits(p: SamplingParams) -> bool:
    """Whether anything but the model's own logits decides the token."""
    penalized = p.repetition_penalty != 1 or p.presence_penalty != 0 or p.frequency_penalty != 0
    return penalized or bool(p.logit_bias) or p.min_tokens > 0


def assert_same_outputs(items: list[WorkItem], a: dict[str, ClientView], b: dict[str, ClientView]) -> None:
    for key, _ in completions(items):
        va, vb = a[key], b[key]
        n = len(va.token_ids)
        if FinishReason.ABORT in (va.finish_reason, vb.finish_reason):
            # An abort lands after a timing-dependent number of tokens: compare the prefix.
            n = min(n, len(vb.token_ids))
        else:
            assert va.finish_reason == vb.finish_reason, key
            assert len(va.token_ids) == len(vb.token_ids), key
        assert va.token_ids[:n] == vb.token_ids[:n], key
        for x_scores, y_scores in zip(va.prompt_logprobs, vb.prompt_logprobs, strict=False):
            assert [x.top_ids for x in x_scores] == [y.top_ids for y in y_scores], key
            assert [x.logprob for x in x_scores] == pytest.approx(
                [y.logprob for y in y_scores], abs=LOGPROB_ATOL
            )
        for x, y in zip(va.logprobs[:n], vb.logprobs[:n], strict=True):
            assert x.top_ids == y.top_ids, key
            assert abs(x.logprob - y.logprob) <= LOGPROB_ATOL, key
            assert all(
                abs(u - v) <= LOGPROB_ATOL for u, v in zip(x.top_logprobs, y.top_logprobs, strict=True)
            )


POOL = 1500  # KV slots


async def serve(mode: str, items: list[WorkItem]) -> tuple[dict[str, ClientView], EngineCore, WorkerEngine]:
    # float64 keeps row results independent of batch composition to ~1e-15, so a near-tie cannot
    # flip a token between the two loops' batchings; the KV pool is small enough to preempt.
    return await serve_workload("tiny", mode, items, kv_slots=POOL, request_slots=48, dtype=torch.float64)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
async def test_every_feature_overlap_equals_serial(sampled: bool) -> None:
    """On a real model (tiny), greedy and seeded: requests with every feature and requests with
    none (one in six, and the forced scenarios') give the same outputs in both loops."""
    items = features_workload(200, seed=11 + sampled, sampled=sampled, kv_slots=POOL)
    views, dropped = {}, {}
    for mode in ("serial", "overlap"):
        got, core, engine = await serve(mode, items)
        check_views(items, got)
        check_drained(core, engine)
        assert core.stats.preemptions > 0, "the workload must exercise preemption"
        views[mode], dropped[mode] = got, core.stats.dropped_inflight_tokens
    assert_same_outputs(items, views["serial"], views["overlap"])
    overlap = views["overlap"]
    assert {v.finish_reason for v in overlap.values()} >= {FinishReason.STOP, FinishReason.LENGTH}
    assert any(v.finish_reason == FinishReason.ABORT for v in overlap.values())
    assert sum(item.n > 1 for item in items) >= 10
    assert sum(bool(v.logprobs) for v in overlap.values()) >= 40
    assert sum(bool(v.prompt_logprobs) for v in overlap.values()) >= 20
    check_prompt_scores_against_the_model(items, overlap, engine)
    plain = [item for item in items if not shapes_logits(item.params) and not item.params.logprobs]
    assert len(plain) >= 30, "requests without features too"
    # Serial drops only the in-flight token of a client abort (one for each completion of it);
    # overlap also the extra token of each request that ended on EOS/stop with batch k+1 launched.
    assert dropped["serial"] <= sum(item.n for item in items if item.abort_after is not None)
    assert dropped["overlap"] > dropped["serial"]
