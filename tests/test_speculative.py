"""Speculative decoding under overlap (docs/SPECULATIVE.md): n-gram drafts proposed on the worker
and verified one step ahead give exactly the tokens decoding without them gives (greedy and
seeded), at overlap depths 1 to 3, through preemption, aborts and stops inside an accepted run,
with every sampling feature (penalties, min_tokens, logit_bias, log-probabilities) and grammars
in the same batches; every KV slot comes back. A tiny random model falls into loops under greedy decoding,
so its drafts are accepted (asserted: the runs must exercise multi-token rows)."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from bench.promtext import scrape, total
from scheduler_svc.contract import FinishReason
from scheduler_svc.engine.outputs import Outbox
from scheduler_svc.engine.policy import PolicyConfig, SchedulingPolicy
from scheduler_svc.engine.request import Request
from scheduler_svc.engine.rows import SlotRows
from scheduler_svc.engine.running import DRAFT_BACKOFF_MAX, note_accepted
from scheduler_svc.engine.telemetry import SchedulerTelemetry
from scheduler_svc.process.cli import parse_args
from stepahead.processes import serving_pair
from stepahead.protocol import (
    Constraint,
    Launch,
    NewRequest,
    StepResult,
    TokenizerSpec,
    WorkerInfo,
    speculative_from_hello,
)
from stepahead.speculative import SpeculativeConfig, parse_speculative_config
from stepahead.v1 import generation_pb2 as pb
from stepahead.v1 import worker_pb2
from tests.harness import (
    WorkItem,
    make_engine,
    mixed_workload,
    params,
    serve_workload,
    with_forced_scenarios,
)
from tests.live import frontend_flags, generate, wait_all_free, worker_stats_after_drain
from tests.test_equivalence import assert_same_tokens, check_client_views, check_drained
from tests.test_sampling_equivalence import assert_same_outputs
from tests.test_structured import TINY as STRUCTURED
from tests.test_structured import check_run, structured_workload
from tests.test_worker_engine import prefill
from worker_svc.engine import LaunchError, WorkerEngine
from worker_svc.speculative import DraftPlaceholderError, Speculation

pytestmark = pytest.mark.anyio

SPEC = SpeculativeConfig(3, 1, 3)
KV = 600


def spec_workload(*, sampled: bool) -> list[WorkItem]:
    """The mixed workload (EOS, stop ids and strings, lengths, aborts, forced preemption) with
    penalized, log-probability and constrained requests beside the plain ones."""
    items = with_forced_scenarios(mixed_workload(48, seed=3, sampled=sampled), KV, sampled=sampled)
    temperature = 0.9 if sampled else 0.0
    extra = [
        WorkItem(
            "penalized",
            [40, 41, 42, 40, 41],
            params(24, temperature=temperature, repetition_penalty=1.3),
            0.0,
        ),
        WorkItem(
            "logprobs",
            [50, 51, 52, 50, 51],
            params(24, temperature=temperature, logprobs=True, top_logprobs=2),
            0.0,
        ),
        WorkItem(
            "grammar",
            [60, 61, 62],
            params(16, temperature=temperature, constraint=Constraint("regex", "[a-c]{3,12}")),
            0.0,
        ),
    ]
    return [*items[:5], *extra, *items[5:]]


# Depths, and whether the CPU resolves the rows on the host (False: the rows as the scheduler
# sent them, as on CUDA, `GpuShapedCpuStreams`).
ROW_SHAPES = ((1, True), (2, True), (2, False))


def accepted_tokens(engine: WorkerEngine) -> float:
    return float(engine.metrics.spec_accepted_tokens._value.get())


@pytest.mark.parametrize("model", ["sim", "tiny", "tiny-gpu-shaped"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
async def test_speculation_gives_the_tokens_decoding_without_it_gives(model: str, sampled: bool) -> None:
    """tiny: the CPU's rows resolved on the host (verify rows cut to their drafts, rows
    without drafts plain); tiny-gpu-shaped: the rows as the scheduler sent them, as on CUDA."""
    items = spec_workload(sampled=sampled)
    kw: dict[str, object] = dict(kv_slots=KV, request_slots=24, host_reads_free=model != "tiny-gpu-shaped")
    model = model.removesuffix("-gpu-shaped")
    reference, core, engine = await serve_workload(model, "overlap", items, **kw)  # type: ignore[arg-type]
    check_drained(core, engine)
    for depth in (1, 2, 3):
        got, core, engine = await serve_workload(
            model,
            "overlap",
            items,
            depth=depth,
            speculative=SPEC,
            **kw,  # type: ignore[arg-type]
        )
        check_client_views(items, got)
        check_drained(core, engine)  # every KV slot free or cached: reserved drafts' slots came back
        assert core.stats.preemptions > 0, "the workload must exercise preemption"
        assert_same_tokens(items, reference, got)
        assert engine.metrics.spec_draft_tokens._value.get() > 0
        if model == "tiny" and not sampled:
            assert accepted_tokens(engine) > 100, "the run must accept drafts"
    assert {v.finish_reason for v in got.values()} >= {
        FinishReason.LENGTH,
        FinishReason.STOP,
        FinishReason.ABORT,
    }


async def test_logprobs_and_logit_bias_draft_and_each_accepted_token_has_its_logprobs() -> None:
    """Requests with log-probabilities or `logit_bias` verify drafts like plain ones: the same
    tokens as without speculation, and log-probabilities for every token, the accepted drafts'
    among them, equal to the one-token steps' (to float error: a verify row's positions share
    one matrix product)."""
    prompt = [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7]
    items = [
        WorkItem("logprobs", prompt, params(40, ignore_eos=True, logprobs=True, top_logprobs=3), 0.0),
        WorkItem("bias", [p + 20 for p in prompt], params(40, ignore_eos=True, logit_bias=((33, 2.0),)), 0.0),
    ]
    for item in items:
        reference, core, engine = await serve_workload("tiny", "overlap", [item])
        for depth, resolved in ROW_SHAPES:
            got, core, engine = await serve_workload(
                "tiny", "overlap", [item], depth=depth, speculative=SPEC, host_reads_free=resolved
            )
            check_drained(core, engine)
            assert_same_tokens([item], reference, got)
            assert accepted_tokens(engine) > 0, f"{item.rid}: the run must accept drafts"
            ref, spec = reference[item.rid].logprobs, got[item.rid].logprobs
            assert len(spec) == len(ref) == (40 if item.rid == "logprobs" else 0)
            for a, b in zip(ref, spec, strict=True):
                assert b.logprob == pytest.approx(a.logprob, abs=1e-4)
                assert len(b.top_ids) == 3
                assert b.top_logprobs == pytest.approx(a.top_logprobs, abs=1e-4)


async def test_penalties_and_min_tokens_draft_and_count_accepted_tokens_only() -> None:
    """Penalized requests draft: entry j of a verify row counts its drafts 1..j as outputs (and
    finds them among its tokens), and the history keeps the emitted tokens only. A frequency
    penalty breaks a tiny model's greedy loop at a count, so a miscount parts from the tokens
    without speculation. `min_tokens` requests draft too: their stop ids are held back at the
    positions the device holds (the scheduler's are bounds), so a stop token that their loop
    would draw early first ends them past `min_tokens`, as without speculation."""
    prompt = [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7]
    penalties: list[dict[str, float]] = [
        dict(frequency_penalty=0.3),
        dict(presence_penalty=0.5),
        dict(repetition_penalty=1.1),
        dict(repetition_penalty=1.05, presence_penalty=0.2, frequency_penalty=0.1),
    ]
    items = [
        WorkItem(f"penalized{i}-{j}", [p + 7 * j for p in prompt], params(60, ignore_eos=True, **kw), 0.0)
        for i, kw in enumerate(penalties)
        for j in range(3)
    ]
    held = await held_stops(prompt)
    assert len(held) >= 2, "the workload needs stop tokens that min_tokens holds back"
    items += held
    reference, _, _ = await serve_workload("tiny", "overlap", items)
    for depth, resolved in ROW_SHAPES:
        got, core, engine = await serve_workload(
            "tiny", "overlap", items, depth=depth, speculative=SPEC, host_reads_free=resolved
        )
        check_drained(core, engine)
        assert_same_tokens(items, reference, got)
        assert accepted_tokens(engine) > 50, "the run must accept drafts"
    _, _, engine = await serve_workload("tiny", "overlap", held, speculative=SPEC)
    assert accepted_tokens(engine) > 0, "the min_tokens requests must accept drafts"


async def held_stops(prompt: list[int]) -> list[WorkItem]:
    """Requests whose stop token the tiny model's greedy output draws before their `min_tokens`
    and again after it (so they end with STOP, past min_tokens), up to three."""
    probe, _, _ = await serve_workload(
        "tiny", "overlap", [WorkItem("probe", prompt, params(40, ignore_eos=True), 0.0)]
    )
    first: dict[int, int] = {}
    for i, token in enumerate(probe["probe"].token_ids):
        first.setdefault(token, i)
    candidates = [
        WorkItem(
            f"held{stop}-{m}",
            prompt,
            params(60, ignore_eos=True, stop_token_ids=frozenset({stop}), min_tokens=m),
            0.0,
        )
        for stop, at in first.items()
        for m in (at + 6, at + 12)
    ]
    views, _, _ = await serve_workload("tiny", "overlap", candidates)
    held = [
        item
        for item in candidates
        if views[item.rid].finish_reason == FinishReason.STOP
        and len(views[item.rid].token_ids) > item.params.min_tokens
    ]
    return held[:3]


async def test_stops_and_lengths_inside_an_accepted_run_end_it_there() -> None:
    """A tiny model's greedy output loops, so whole runs of drafts are accepted; a stop token,
    a stop string or a length limit that falls inside such a run ends the request at that token,
    as without speculation."""
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 9]
    kw: dict[str, object] = dict(kv_slots=2048, request_slots=16)
    probe = [WorkItem("probe", prompt, params(60, ignore_eos=True), 0.0)]
    views, _, _ = await serve_workload("tiny", "overlap", probe, **kw)  # type: ignore[arg-type]
    loop = views["probe"].token_ids
    late = loop[30:]  # well inside the loop, where drafts are accepted
    stop_token = late[3]
    stop_text = bytes(late[5:7]).decode("latin-1") if all(t < 128 for t in late[5:7]) else ""
    items = [WorkItem(f"len{n}", prompt, params(n, ignore_eos=True), 0.0) for n in range(31, 40)]
    items.append(
        WorkItem("stop-id", prompt, params(60, ignore_eos=True, stop_token_ids=frozenset({stop_token})), 0.0)
    )
    if stop_text:
        items.append(WorkItem("stop-text", prompt, params(60, ignore_eos=True, stop=(stop_text,)), 0.0))
    reference, _, _ = await serve_workload("tiny", "overlap", items, **kw)  # type: ignore[arg-type]
    for depth, resolved in ((1, True), (3, True), (3, False)):
        got, core, engine = await serve_workload(
            "tiny",
            "overlap",
            items,
            depth=depth,
            speculative=SPEC,
            host_reads_free=resolved,
            **kw,  # type: ignore[arg-type]
        )
        check_drained(core, engine)
        assert accepted_tokens(engine) > 0
        for item in items:
            assert got[item.rid].token_ids == reference[item.rid].token_ids, item.rid
            assert got[item.rid].finish_reason == reference[item.rid].finish_reason, item.rid
        assert got["stop-id"].token_ids[-1] == stop_token
        for n in range(31, 40):
            assert len(got[f"len{n}"].token_ids) == n


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
async def test_constrained_requests_draft_through_their_matchers_and_give_the_same_outputs(
    sampled: bool,
) -> None:
    """The structured-outputs differential workload (JSON Schema, regex, choice, Lark and tool
    calls among plain requests, every sampling feature, chunked prefill, aborts, n > 1, a
    constrained call recomputed after a forced preemption) gives the same outputs with
    speculation at depths 1 and 3; the worker runs with --check-invariants, so a token drawn
    outside its entry's mask fails the step, and every matcher is released."""
    items = structured_workload(70, seed=41 + sampled, sampled=sampled)
    reference, core, engine = await serve_workload("tiny", "overlap", items, **STRUCTURED)  # type: ignore[arg-type]
    check_run(items, reference, core, engine)
    for depth, resolved in ((1, True), (3, True), (3, False)):
        got, core, engine = await serve_workload(
            "tiny",
            "overlap",
            items,
            depth=depth,
            link_delay_s=0.001 if depth > 1 else 0.0,  # holds `depth` batches in flight
            speculative=SPEC,
            host_reads_free=resolved,
            **STRUCTURED,  # type: ignore[arg-type]
        )
        check_run(items, got, core, engine)
        assert_same_outputs(items, reference, got)
        assert engine.metrics.spec_draft_tokens._value.get() > 0


async def test_a_grammar_whose_output_repeats_accepts_drafts_and_its_finish_ends_the_run() -> None:
    """A grammar that forces a repeating output: its drafts pass the matcher and are accepted,
    several per step; the token that finishes the grammar ends the request (STOP) even where
    the verify row went on past it (the entry after it draws from EOS alone, and, with
    ignore_eos, would otherwise be emitted). The same tokens as without speculation."""
    items = [
        WorkItem(
            f"abc{n}",
            [120, 121, 122, 97, 98],
            params(60, ignore_eos=True, constraint=Constraint("regex", f"(abc){{{n}}}")),
            0.0,
        )
        for n in (5, 6, 7, 8)
    ]
    items.append(
        WorkItem(
            "list",
            [120, 121, 122],
            params(120, constraint=Constraint("json", json.dumps(REPEATED_LIST))),
            0.0,
        )
    )
    reference, core, engine = await serve_workload("tiny", "overlap", items)
    assert engine.metrics.spec_draft_tokens._value.get() == 0
    for depth, resolved in ROW_SHAPES:
        got, core, engine = await serve_workload(
            "tiny", "overlap", items, depth=depth, speculative=SPEC, host_reads_free=resolved
        )
        check_drained(core, engine)
        assert engine.grammar_matchers() == 0
        assert_same_tokens(items, reference, got)
        for n in (5, 6, 7, 8):
            view = got[f"abc{n}"]
            assert bytes(view.token_ids).decode() == "abc" * n
            assert view.finish_reason == FinishReason.STOP
        assert json.loads(got["list"].text) == [{"k": "v"}] * 6
        drafts = engine.metrics.spec_drafts._value.get()
        assert accepted_tokens(engine) > drafts, "drafting rows must accept more than one draft each"


GREETING = "good morning to everyone in the room"
FIXED_TEXT = {
    "type": "object",
    "properties": {
        "greeting": {"const": GREETING},
        "count": {"enum": [1, 2, 3]},
    },
    "required": ["greeting", "count"],
    "additionalProperties": False,
}


async def test_the_tokens_a_grammar_forces_are_drafted_on_the_cpu() -> None:
    """On the CPU a constrained row drafts the tokens its grammar forces next (asked of its
    matcher once the grammar thread has taken the last step's tokens): an output that is
    mostly fixed text is accepted a run of drafts at a time, where prompt lookup alone (the
    rows as a GPU shapes them) finds little of it. The same tokens either way."""
    item = WorkItem(
        "fixed", [120, 121, 122], params(90, constraint=Constraint("json", json.dumps(FIXED_TEXT))), 0.0
    )
    reference, _, _ = await serve_workload("tiny", "overlap", [item])
    accepted: dict[tuple[int, bool], float] = {}
    for depth, resolved in ROW_SHAPES:
        got, core, engine = await serve_workload(
            "tiny", "overlap", [item], depth=depth, speculative=SPEC, host_reads_free=resolved
        )
        check_drained(core, engine)
        assert_same_tokens([item], reference, got)
        assert json.loads(got["fixed"].text)["greeting"] == GREETING
        accepted[depth, resolved] = accepted_tokens(engine)
    fixed = len(f'{{"greeting": "{GREETING}", "count": ')
    for depth in (1, 2):
        assert accepted[depth, True] >= fixed // 2, accepted
        assert accepted[depth, True] >= 2 * accepted[2, False], accepted


REPEATED_LIST = {
    "type": "array",
    "items": {"type": "object", "properties": {"k": {"const": "v"}}, "required": ["k"]},
    "minItems": 6,
    "maxItems": 6,
}


# ---- the worker: verify rows, their checks, the sentinel ------------------------------------


def verify_row(step: int, slot: int, start: int, kv: list[int]) -> Launch:
    return Launch(
        step,
        row_req_slots=[slot],
        row_start_pos=[start],
        row_num_tokens=[len(kv)],
        row_from_future=[True],
        row_sample=[True],
        kv_slots=kv,
    )


def test_a_verify_row_needs_a_speculating_session_and_k_plus_one_tokens() -> None:
    engine = make_engine("tiny", kv_slots=64, request_slots=4)
    try:
        engine.begin_session().result()
        engine.submit(
            prefill(1, 0, [1, 2, 3], [0, 1, 2], new_requests=[NewRequest(0, 0.0, 1.0, 0, 0)])
        ).result()
        with pytest.raises(
            LaunchError, match=r"row_num_tokens\[0\]: 4 tokens in a row_from_future row, which carries 1$"
        ):
            engine.submit(verify_row(2, 0, 3, [3, 4, 5, 6])).result()
        engine.begin_session(speculative=SPEC).result()
        engine.submit(
            prefill(1, 0, [1, 2, 3], [0, 1, 2], new_requests=[NewRequest(0, 0.0, 1.0, 0, 0)])
        ).result()
        with pytest.raises(LaunchError, match=r"row_num_tokens\[0\]: 3 tokens .* 1, or 4 as a verify row"):
            engine.submit(verify_row(2, 0, 3, [3, 4, 5])).result()
    finally:
        engine.shutdown()


def verify_steps(prompt: list[int], steps: int, host_reads_free: bool) -> list[tuple[StepResult, int, int]]:
    """A request's verify rows, one at a time after its prefill: each step's result, the
    tokens its forward computed and the drafts it proposed."""
    engine = make_engine("tiny", kv_slots=256, request_slots=4, host_reads_free=host_reads_free)
    k = SPEC.num_speculative_tokens
    try:
        engine.begin_session(speculative=SPEC).result()
        n = len(prompt)
        new = [NewRequest(0, 0.0, 1.0, 0, 0)]
        engine.submit(prefill(1, 0, prompt, list(range(n)), new_requests=new)).result()
        position, out = n, []
        metrics = engine.metrics
        for step in range(2, 2 + steps):
            computed, proposed = metrics.tokens["decode"]._value.get(), metrics.spec_draft_tokens._value.get()
            kv = list(range(n + (k + 1) * step, n + (k + 1) * (step + 1)))
            result = engine.submit(verify_row(step, 0, position, kv)).result()
            computed = metrics.tokens["decode"]._value.get() - computed
            proposed = metrics.spec_draft_tokens._value.get() - proposed
            out.append((result, int(computed), int(proposed)))
            position += result.token_counts[0] if result.token_counts else 1
        return out
    finally:
        engine.shutdown()


def test_the_cpu_computes_a_verify_rows_drafts_only() -> None:
    """The scheduler reserves K + 1 positions for a verify row; a CPU worker (reading the
    lookup costs it nothing) computes the pending token and the drafts proposed, a GPU-shaped
    one all K + 1. Each step gives both the same tokens, counts and lookups: some find no
    draft (one token computed), some find drafts (more)."""
    prompt = [100, 101, 102, 103, 104, 105, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    cpu = verify_steps(prompt, 12, host_reads_free=True)
    shaped = verify_steps(prompt, 12, host_reads_free=False)
    k = SPEC.num_speculative_tokens
    for (a, computed, proposed), (b, full, proposed_b) in zip(cpu, shaped, strict=True):
        # A step whose rows all ran plain sends no counts: one token each.
        assert (a.token_ids, a.token_counts or (1,), a.drafts_found) == (
            b.token_ids,
            b.token_counts,
            b.drafts_found,
        )
        assert proposed == proposed_b and full == k + 1
        assert computed == 1 + proposed
    assert {computed == 1 for _, computed, _ in cpu} == {True, False}


def test_a_verify_row_input_that_is_no_token_id_is_caught() -> None:
    """The sentinel check of --check-invariants: a placeholder (here a pending token never
    written) would reach the embedding."""
    s = Speculation(request_slots=2, kv_slots=8, context=16, device=torch.device("cpu"), check_inputs=True)
    s.config = SPEC
    with pytest.raises(DraftPlaceholderError, match="placeholder"):
        s.draft(
            s.look_up(torch.tensor([0]), torch.tensor([-1]), torch.zeros(2, 17, dtype=torch.int64), width=4)
        )


# ---- the configuration ------------------------------------------------------------------------


def test_the_configuration_takes_vllms_json_and_names_a_bad_field() -> None:
    c = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}')
    assert c == SpeculativeConfig(4, 3, 3)
    assert parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 2}') == SpeculativeConfig(
        2, 5, 5
    )
    bad = {
        '{"num_speculative_tokens": 2}': "method: required",
        '{"method": "eagle", "num_speculative_tokens": 2}': "method: one of ngram",
        '{"method": "ngram"}': "num_speculative_tokens: required",
        '{"method": "ngram", "num_speculative_tokens": 0}': r"num_speculative_tokens: must be in \[1, 16\]",
        '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}': (
            "prompt_lookup_min: 4 is above prompt_lookup_max 2"
        ),
        '{"method": "ngram", "num_speculative_tokens": "2"}': "num_speculative_tokens: an integer",
        '{"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}': "draft_model: not a field",
        "[1]": "a JSON object",
        "{": "not JSON",
    }
    for text, message in bad.items():
        with pytest.raises(ValueError, match=message):
            parse_speculative_config(text)


def test_the_scheduler_flag_and_the_workers_hello() -> None:
    config = parse_args(
        ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 3})]
    )
    assert config.core.policy.speculative == SpeculativeConfig(3, 5, 5)
    assert config.worker.link.speculative == config.core.policy.speculative
    with pytest.raises(SystemExit):
        parse_args(
            [
                "--speculative-config",
                '{"method": "ngram", "num_speculative_tokens": 8}',
                "--max-batch-tokens",
                "4",
            ]
        )
    hello = worker_pb2.Hello()
    assert speculative_from_hello(hello) is None
    hello.speculative.method = "ngram"
    hello.speculative.num_speculative_tokens = 40
    hello.speculative.prompt_lookup_min = hello.speculative.prompt_lookup_max = 2
    with pytest.raises(ValueError, match=r"^hello.speculative.num_speculative_tokens: must be in"):
        speculative_from_hello(hello)


# ---- live services ----------------------------------------------------------------------------

TINY = ["--model", "tiny", "--kv-slots", "1024", "--request-slots", "16", "--check-invariants"]


async def tokens_of(address: str, rid: str, prompt: list[int], max_tokens: int) -> list[int]:
    sampling = pb.SamplingParams(max_new_tokens=max_tokens, ignore_eos=True)
    request = pb.GenerateRequest(request_id=rid, input_ids=pb.TokenIds(ids=prompt), sampling=sampling)
    return [t for r in await generate(address, request) for t in r.token_ids]


def live_tokens(frontends: int, speculative: bool) -> tuple[dict[str, list[int]], float]:
    spec = [
        "--speculative-config",
        json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}),
    ]
    flags = ["--overlap-depth", "2", *frontend_flags(frontends), *(spec if speculative else [])]
    prompts = {f"r{i}": [5 + i, 6, 7, 8, 5 + i, 6, 7, 8, 9 + i] for i in range(6)}
    with serving_pair(TINY, flags) as (worker, scheduler):

        async def run() -> dict[str, list[int]]:
            jobs = [tokens_of(scheduler.address, r, p, 40 + i) for i, (r, p) in enumerate(prompts.items())]
            got = dict(zip(prompts, await asyncio.gather(*jobs), strict=True))
            await wait_all_free(scheduler.address)
            stats = await worker_stats_after_drain(worker.address)
            assert stats.sentinel_reads == 0 and stats.out_of_order_launches == 0
            return got

        tokens = asyncio.run(run())
        accepted = total(scrape(worker.metrics_url), "stepahead_spec_decode_num_accepted_tokens_total")
    return tokens, accepted


@pytest.mark.parametrize("frontends", [0, 2])
def test_live_services_speculate_and_give_the_same_tokens(frontends: int) -> None:
    plain, none_accepted = live_tokens(frontends, speculative=False)
    speculated, accepted = live_tokens(frontends, speculative=True)
    assert speculated == plain
    assert none_accepted == 0 and accepted > 0


# ---- the core's accounting of a verify row ----------------------------------------------------


def test_a_verify_rows_kv_slots_join_the_request_in_position_order_and_the_rest_are_freed() -> None:
    """Two verify rows in flight (depth 2): the first emits 3 tokens (2 drafts accepted), so the
    request's KV slots are its prompt's, then the first row's first three, then the second
    row's first; the first row's last slot is free again. The second emits 1: its drafts' slots
    are freed, and its first slot holds the next position."""
    policy = SchedulingPolicy(PolicyConfig(speculative=SPEC), Outbox(), SchedulerTelemetry("overlap"))
    info = WorkerInfo("tiny", 258, 2048, (257,), None, 64, 4, "cpu", TokenizerSpec("byte"))
    policy.begin_session(info)
    req = Request("r", [1, 2, 3, 4], params(40), 0)
    policy.add_request(req)
    prefill_batch = policy.schedule()
    first = policy.schedule()
    second = policy.schedule()
    assert prefill_batch is not None and first is not None and second is not None
    prompt_slots = prefill_batch.launch.kv_slots
    assert first.launch.row_num_tokens == [4] and first.launch.row_from_future == [True]
    # Bounds on the first positions (true: 4, then 4 + 1..4): computed plus K per row in flight.
    assert first.launch.row_start_pos == [4 + 3 * 1] and second.launch.row_start_pos == [5 + 3 * 2]
    v1, v2 = first.launch.kv_slots, second.launch.kv_slots
    free = policy.kv.num_free
    policy.update_from_result(prefill_batch, [10])
    policy.update_from_result(first, [11, 12, 13], token_counts=(3,))
    assert req.output_ids == [10, 11, 12, 13]
    assert req.kv_slots == [*prompt_slots, *v1[:3], v2[0]]
    assert policy.kv.num_free == free + 1 and list(req.draft_slots) == [v2[1:]]
    assert (req.num_computed, req.num_inflight) == (4 + 3 + 1, 1)
    # As the overlap loop does, the next row is picked before the last result is processed.
    third = policy.schedule()
    assert third is not None and third.launch.row_num_tokens == [4]
    policy.update_from_result(second, [14], token_counts=(1,))  # no draft accepted
    assert req.kv_slots == [*prompt_slots, *v1[:3], v2[0], third.launch.kv_slots[0]]
    assert policy.kv.num_free == free and len(req.draft_slots) == 1  # third's 4 taken, v2's 3 back
    # So its next decode row carries no drafts (a run of 1: read from the FutureMap at the
    # position the worker holds, a bound sent), and the one after drafts again.
    fourth = policy.schedule()
    assert (
        fourth is not None and fourth.launch.row_num_tokens == [1] and fourth.launch.row_from_future == [True]
    )
    assert fourth.launch.row_start_pos == [req.num_computed - 1 + 3 * 1]
    policy.update_from_result(third, [15], token_counts=(1,))  # none again: a run of 2 next
    fifth = policy.schedule()
    assert fifth is not None
    policy.update_from_result(fourth, [16])
    sixth = policy.schedule()
    policy.update_from_result(fifth, [17], token_counts=(1,))
    seventh = policy.schedule()
    picked = [b.launch.row_num_tokens if b else None for b in (fifth, sixth, seventh)]
    assert picked == [[1], [1], [4]]
    # The worker's lookup found no draft for it at sixth's step: its next row carries none.
    policy.update_from_result(sixth, [18], token_counts=(1,), drafts_found=(False,))  # type: ignore[arg-type]
    eighth = policy.schedule()
    assert eighth is not None and eighth.launch.row_num_tokens == [1]
    policy.abort("r")
    assert policy.kv.num_free + policy.kv.tree.size == policy.kv.capacity and not req.draft_slots


def test_verify_rows_that_gain_little_back_off_doubling_up_to_the_most() -> None:
    rows = SlotRows(2, draft_tokens=4)
    rows.drafts[0] = 4
    runs = []
    for accepted in (1, 0, 1, 0, 0, 0, 0, 0):  # fewer than half of 4: a failure each
        note_accepted(rows, 0, accepted)
        runs.append(rows.skip[0])
    assert runs == [1, 2, 4, 8, 16, 32, 32, 32] and DRAFT_BACKOFF_MAX == 32
    note_accepted(rows, 0, 2)  # half: the run ends
    assert (rows.skip[0], rows.backoff[0]) == (0, 0)
