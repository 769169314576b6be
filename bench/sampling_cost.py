"""python -m bench.sampling_cost [--quick] [--out DIR]: what the worker's sampling features cost,
on the model (part A) and through the services (part B), in one run.

Feature sets: `none` (no logits processing), `penalties` (repetition 1.2, presence 0.5,
frequency 0.5), `logprobs` (the sampled token's log-probability and the top 5) and `all`
(penalties, logprobs top 5, min_tokens 8 with EOS as its stop id, and a logit_bias of 50
random ids at random values in [-1, 1]).

Part A, the model, in this process (`bench.engine_decode`): a `WorkerEngine` over `tiny` and
`smollm2` in float32 on the CPU (torch threads fixed, `--threads`). Per model, batch size B and
feature set, a run starts a fresh engine session, registers B greedy requests of the set (one
request slot each) with a prefill of B random prompts of 32 tokens, whose result it awaits, then
launches D decode steps whose inputs the engine reads from its FutureMap, each launched one step
ahead (step k+1 is submitted before step k's result is read, as the overlap loop does). Device ms
per step: the mean of the decode steps' `forward_end - forward_start` (on the CPU, the forward
thread's whole step: batch building, forward, logits processing, sampling, log-probabilities).
Decode tok/s: B x D over the wall time from the first decode step's forward start to the last
one's result in hand. After one untimed warmup round (2 decode steps per set), the feature sets
run in turns (none, penalties, logprobs, all, none, ...) so that a competing load hits them
alike; of the repeats the best counts (the least device ms, the most tok/s). Each figure is also
given over `none`'s at the same model and batch size.

Part B, the services: a `sim` worker (`--sim-step-ms 10 --sim-token-us 0`, the sim sweep's
device) and an overlap scheduler over gRPC; a closed loop of loadgen requests at concurrency 64
with exactly 128 prompt tokens (random ids) and 64 new tokens (ignore_eos), every request
(warmup's too) asking for no feature or for `all`, in turns, on the same processes. Each
measured run lies between two scrapes of both /metrics endpoints (as `bench.run.measure`);
device busy is the worker's forward time over its busy + idle time (`bench.figures`). The sim
ignores penalties, logit_bias and min_tokens but returns log-probabilities, so this measures
what carrying the features and log-probabilities costs the scheduler, the link and the frontend.

Writes bench/results/<UTC date-time>-sampling-cost.{json,md} and prints the tables.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from bench import engine_decode
from bench.cells import NONE, number, percent, times
from bench.configs import Case, Configuration, Workload, sim
from bench.engine_decode import (
    WARMUP_STEPS,
    DecodeRun,
    Progress,
    Unwatched,
    Variation,
    find,
    greedy,
    run_engine_part,
)
from bench.envelope import Envelope, begin, load_clause
from bench.figures import Figures, figures, ratio
from bench.machine import Machine, load_average
from bench.run import measure, serving
from bench.save import RESULTS, command_line, publish
from loadgen.backend import SamplingFeatures
from stepahead.protocol import LogitsProcessing, NewRequest
from worker_svc.backends import ModelBackend
from worker_svc.engine import WorkerEngine
from worker_svc.loading import TINY_CONFIG

NAME = "sampling-cost"
TITLE = "Sampling features: their cost on the model and the services"
FEATURE_SETS = ("none", "penalties", "logprobs", "all")
MODELS = ("tiny", "smollm2")
REPETITION, PRESENCE, FREQUENCY = 1.2, 0.5, 0.5
TOP_LOGPROBS = 5
MIN_TOKENS = 8
BIAS_IDS = 50
SEED = 0  # of the logit_bias ids and values
TARGET_MODEL, TARGET_BATCH, TARGET_OVERHEAD = "smollm2", 64, 0.10  # penalties + logprobs
TARGET_BUSY, SERVING_STEP_MS = 0.98, 10.0


# ---- plans -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class EnginePlan(engine_decode.EnginePlan):
    feature_sets: tuple[str, ...] = FEATURE_SETS  # the variants, in the order they run


@dataclass(frozen=True)
class ServingPlan:
    prompts: int  # requests per measured run
    repeats: int  # measured runs of each feature set, in turns
    concurrency: int = 64
    input_len: int = 128
    output_len: int = 64

    @property
    def workload(self) -> Workload:
        return Workload(
            self.prompts, self.concurrency, self.input_len, self.output_len, 0.0, self.concurrency
        )


@dataclass(frozen=True)
class Plan:
    name: str
    engine: EnginePlan
    serving: ServingPlan


FULL = Plan("full", EnginePlan(MODELS, (1, 16, 64), steps=32, repeats=5), ServingPlan(512, repeats=2))
QUICK = Plan("quick", EnginePlan(MODELS, (1, 16), steps=8, repeats=2), ServingPlan(128, repeats=1))


# ---- the feature sets ------------------------------------------------------------------------


def logit_bias(vocab: int, seed: int = SEED) -> tuple[tuple[int, float], ...]:
    """BIAS_IDS distinct ids of the vocabulary, each at a value in [-1, 1]."""
    rng = random.Random(seed)
    return tuple((token, round(rng.uniform(-1.0, 1.0), 3)) for token in rng.sample(range(vocab), BIAS_IDS))


def processing(features: str, prompt_len: int, backend: ModelBackend) -> LogitsProcessing | None:
    """A request's LogitsProcessing under a feature set."""
    if features == "none":
        return None
    if features == "penalties":
        return LogitsProcessing(prompt_len, REPETITION, PRESENCE, FREQUENCY)
    if features == "logprobs":
        return LogitsProcessing(prompt_len, logprobs=True, top_logprobs=TOP_LOGPROBS)
    if features == "all":
        bias = logit_bias(backend.vocab_size)
        stops = backend.eos_token_ids
        return LogitsProcessing(
            prompt_len, REPETITION, PRESENCE, FREQUENCY, MIN_TOKENS, stops, bias, True, TOP_LOGPROBS
        )
    raise ValueError(f"unknown feature set {features!r}")


def loadgen_features(features: str) -> SamplingFeatures:
    """What every loadgen request asks for under a feature set (`none` or `all`)."""
    if features == "none":
        return SamplingFeatures()
    if features == "all":
        return SamplingFeatures(
            repetition_penalty=REPETITION,
            presence_penalty=PRESENCE,
            frequency_penalty=FREQUENCY,
            min_tokens=MIN_TOKENS,
            logprobs=TOP_LOGPROBS,
            logit_bias=dict(logit_bias(TINY_CONFIG.vocab_size)),  # the sim's vocabulary
        )
    raise ValueError(f"the services run `none` or `all`, not {features!r}")


# ---- part A: the model, in process (`bench.engine_decode`) -----------------------------------


class EngineRow(engine_decode.EngineRow[str, DecodeRun]):
    """A feature set's runs at a model and batch size."""

    @property
    def features(self) -> str:
        return self.variant


@dataclass(frozen=True)
class VersusNone:
    """A row's best figures over `none`'s at the same model and batch size."""

    device_ms: float | None
    tokens_per_s: float | None

    @property
    def overhead_percent(self) -> float | None:
        """Device time added by the features, in % of `none`'s."""
        return None if self.device_ms is None else (self.device_ms - 1.0) * 100.0


class Features(Variation[str, DecodeRun, EngineRow]):
    """Runs that differ in their requests' feature set, every request of a run asking for it."""

    def requests(self, variant: str, batch: int, prompt_len: int, backend: ModelBackend) -> list[NewRequest]:
        p = processing(variant, prompt_len, backend)
        return [greedy(slot, p) for slot in range(batch)]

    def watch(self, engine: WorkerEngine, variant: str, batch: int, steps: int) -> Unwatched:
        return Unwatched()

    def row(self, model: str, batch: int, variant: str, runs: tuple[DecodeRun, ...]) -> EngineRow:
        return EngineRow(model, batch, variant, runs)

    def progress_line(self, rows: Sequence[EngineRow], row: EngineRow) -> str:
        return engine_progress_line(row, versus_none(rows, row))


def versus_none(rows: Sequence[EngineRow], row: EngineRow) -> VersusNone:
    none = find(rows, row.model, row.batch, "none")
    if none is None:
        return VersusNone(None, None)
    return VersusNone(ratio(row.device_ms, none.device_ms), ratio(row.tokens_per_s, none.tokens_per_s))


def engine_progress_line(row: EngineRow, vs: VersusNone) -> str:
    return (
        f"{row.model} batch {row.batch:>2} {row.features:>9}: {row.device_ms:8.2f} ms/step "
        f"({times(vs.device_ms)}), {row.tokens_per_s:9,.1f} tok/s ({times(vs.tokens_per_s)})"
    )


# ---- part B: the services on the sim ---------------------------------------------------------


@dataclass(frozen=True)
class ServingRow:
    features: str
    repeat: int  # 0, 1, ...: the turn it ran in
    figures: Figures


def serving_configuration() -> Configuration:
    return Configuration(sim(SERVING_STEP_MS), "overlap", "grpc")


def run_serving_part(plan: ServingPlan, progress: Progress) -> list[ServingRow]:
    """One worker and scheduler for every run: none, all, none, all, ..."""
    case = Case(serving_configuration(), plan.workload)
    rows = []
    with serving(case.configuration) as endpoints:
        for repeat in range(plan.repeats):
            for features in ("none", "all"):
                measured = measure(endpoints, case.workload, 1, loadgen_features(features))
                rows.append(ServingRow(features, repeat, figures(case, measured)))
                progress(serving_progress_line(rows[-1]))
    return rows


def serving_progress_line(row: ServingRow) -> str:
    f = row.figures
    return (
        f"sim overlap, {row.features:>4} features, run {row.repeat}: {f.output_tokens_per_s:7,.1f} tok/s, "
        f"device busy {number(f.device_busy_fraction, 3)}, {f.failed} failed"
    )


# ---- a run -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplingCostRun:
    plan: Plan
    started_at: datetime  # UTC
    machine: Machine
    torch_threads: int
    load_average: tuple[float, float, float]  # before part A, after it, after part B
    engine: tuple[EngineRow, ...]
    serving: tuple[ServingRow, ...]


def to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_plan(plan: Plan, progress: Progress = to_stderr) -> SamplingCostRun:
    (started_at, machine), before = begin(), load_average()
    engine = run_engine_part(plan.engine, Features(plan.engine.feature_sets), progress)
    between = load_average()
    served = run_serving_part(plan.serving, progress)
    loads = (before, between, load_average())
    return SamplingCostRun(
        plan, started_at, machine, torch.get_num_threads(), loads, tuple(engine), tuple(served)
    )


# ---- targets ---------------------------------------------------------------------------------


def overhead_at_target(rows: Sequence[EngineRow]) -> dict[str, float | None]:
    """Each feature set's device-time overhead (%) on TARGET_MODEL at TARGET_BATCH."""
    at = [r for r in rows if (r.model, r.batch) == (TARGET_MODEL, TARGET_BATCH) and r.features != "none"]
    return {r.features: versus_none(rows, r).overhead_percent for r in at}


def engine_target_met(rows: Sequence[EngineRow]) -> bool | None:
    """`all` holds penalties and logprobs (and more): its overhead bounds theirs together."""
    overhead = overhead_at_target(rows).get("all")
    return None if overhead is None else overhead <= TARGET_OVERHEAD * 100.0


def least_busy_with_features(rows: Sequence[ServingRow]) -> float | None:
    busy = [r.figures.device_busy_fraction for r in rows if r.features == "all"]
    known = [b for b in busy if b is not None]
    return min(known) if known and len(known) == len(busy) else None


def serving_target_met(rows: Sequence[ServingRow]) -> bool | None:
    busy = least_busy_with_features(rows)
    return None if busy is None else busy >= TARGET_BUSY


# ---- reporting -------------------------------------------------------------------------------


def envelope(run: SamplingCostRun, command: str) -> Envelope:
    """The frame; the load average is this run's own: before part A, after it, after part B."""
    before, between, after = run.load_average
    clauses = (
        f"{run.torch_threads} torch threads",
        load_clause(before, {"part A": between, "part B": after}),
    )
    return Envelope.planned(TITLE, command, run.plan, run.started_at, run.machine, clauses=clauses)


def to_json(run: SamplingCostRun, command: str) -> dict[str, Any]:
    return envelope(run, command).json(
        {
            "torch_threads": run.torch_threads,
            "load_average_1m": dict(
                zip(("before", "after_engine", "after_serving"), run.load_average, strict=True)
            ),
            "engine": [_engine_json(run.engine, r) for r in run.engine],
            "serving": {
                "worker_args": list(serving_configuration().device.worker_args),
                "scheduler_args": list(serving_configuration().scheduler_args),
                "features": {name: asdict(loadgen_features(name)) for name in ("none", "all")},
                "runs": [
                    {"features": r.features, "repeat": r.repeat, "figures": asdict(r.figures)}
                    for r in run.serving
                ],
            },
            "targets": _targets_json(run),
        }
    )


def _engine_json(rows: Sequence[EngineRow], r: EngineRow) -> dict[str, Any]:
    vs = versus_none(rows, r)
    return {
        "model": r.model,
        "batch": r.batch,
        "features": r.features,
        "device_ms_per_step": r.device_ms,
        "decode_tokens_per_s": r.tokens_per_s,
        "device_ms_over_none": vs.device_ms,
        "tokens_per_s_over_none": vs.tokens_per_s,
        "runs": [{**asdict(run), "tokens_per_s": run.tokens_per_s} for run in r.runs],
    }


def _targets_json(run: SamplingCostRun) -> dict[str, Any]:
    return {
        "engine": {
            "model": TARGET_MODEL,
            "batch": TARGET_BATCH,
            "overhead_percent_at_most": TARGET_OVERHEAD * 100.0,
            "checked_on": "all",
            "overhead_percent": overhead_at_target(run.engine),
            "met": engine_target_met(run.engine),
        },
        "serving": {
            "busy_at_least": TARGET_BUSY,
            "least_busy_with_all": least_busy_with_features(run.serving),
            "met": serving_target_met(run.serving),
        },
    }


def to_markdown(run: SamplingCostRun, command: str) -> str:
    return envelope(run, command).markdown(
        [
            "## A. The model, in process",
            "",
            *engine_table(run.engine),
            "",
            *engine_notes(run.plan.engine),
            *engine_target_lines(run.engine),
            "",
            "## B. The services, on the sim",
            "",
            *serving_table(run.serving),
            "",
            *serving_notes(run.plan.serving),
            *serving_target_lines(run.serving),
        ]
    )


def engine_table(rows: Sequence[EngineRow]) -> list[str]:
    header = "| model | batch | features | device ms/step | vs none | decode tok/s | vs none |"
    return [
        header,
        "|---|---:|---|---:|---:|---:|---:|",
        *(_engine_row(r, versus_none(rows, r)) for r in rows),
    ]


def _engine_row(r: EngineRow, vs: VersusNone) -> str:
    cells = [
        r.model,
        str(r.batch),
        r.features,
        number(r.device_ms, 2),
        times(vs.device_ms),
        number(r.tokens_per_s, 1),
        times(vs.tokens_per_s),
    ]
    return "| " + " | ".join(cells) + " |"


def engine_notes(plan: EnginePlan) -> list[str]:
    return [
        f"- float32 on the CPU; batch B: B greedy requests, {plan.prompt_len}-token random prompts, "
        f"{plan.steps} decode steps each launched one step ahead (FutureMap inputs); best of "
        f"{plan.repeats} runs per row, the sets in turns after a {WARMUP_STEPS}-step warmup round",
        "- device ms/step: mean forward_end - forward_start over a run's decode steps (the forward "
        "thread's whole step); decode tok/s: B x steps over first decode forward start to last result",
        f"- penalties: repetition {REPETITION}, presence {PRESENCE}, frequency {FREQUENCY}; logprobs: "
        f"top {TOP_LOGPROBS}; all: both, min_tokens {MIN_TOKENS} (EOS stopped), logit_bias of {BIAS_IDS} ids",
        "- vs none: the row's figure over `none`'s at the same model and batch",
    ]


def engine_target_lines(rows: Sequence[EngineRow]) -> Iterator[str]:
    overhead, met = overhead_at_target(rows), engine_target_met(rows)
    if met is None:
        target = f"penalties + logprobs <= {TARGET_OVERHEAD:.0%}"
        yield f"- target ({target}): not measured, no {TARGET_MODEL} rows at batch {TARGET_BATCH}"
        return
    listed = ", ".join(f"{name} {percent(value)}" for name, value in overhead.items())
    verdict = "met" if met else "not met"
    yield (
        f"- forward overhead on {TARGET_MODEL} at batch {TARGET_BATCH}: {listed}; target penalties + "
        f"logprobs <= {TARGET_OVERHEAD:.0%} (checked on `all`, which holds both): {verdict}"
    )


def serving_table(rows: Sequence[ServingRow]) -> list[str]:
    header = (
        "| features | run | output tok/s | of ideal | device busy | mean forward ms | mean gap ms "
        "| tokens/step | completed | failed |"
    )
    return [header, "|---|---:|" + "---:|" * 8, *(_serving_row(r) for r in rows)]


def _serving_row(r: ServingRow) -> str:
    f = r.figures
    cells = [
        r.features,
        str(r.repeat),
        number(f.output_tokens_per_s, 1),
        number(f.fraction_of_ideal, 3),
        number(f.device_busy_fraction, 3),
        number(f.mean_forward_ms, 2),
        number(f.mean_device_gap_ms, 3),
        number(f.tokens_per_step, 1),
        str(f.completed),
        str(f.failed),
    ]
    return "| " + " | ".join(cells) + " |"


def serving_notes(plan: ServingPlan) -> list[str]:
    args = " ".join(serving_configuration().device.worker_args)
    return [
        f"- worker `{args}`, scheduler `--mode overlap` over gRPC; {plan.prompts} requests per run, a "
        f"closed loop at concurrency {plan.concurrency}, {plan.input_len}-token prompts (random ids), "
        f"exactly {plan.output_len} new tokens (ignore_eos); warmup: concurrency x 8 tokens, same features",
        f"- all: repetition {REPETITION}, presence {PRESENCE}, frequency {FREQUENCY}, "
        f"min_tokens {MIN_TOKENS}, logprobs {TOP_LOGPROBS}, logit_bias of {BIAS_IDS} ids (the sim "
        "applies only the log-probabilities)",
        "- of ideal: output tok/s over concurrency / step time; device busy: forward time over busy + idle",
    ]


def serving_target_lines(rows: Sequence[ServingRow]) -> Iterator[str]:
    busy, met = least_busy_with_features(rows), serving_target_met(rows)
    verdict = NONE if met is None else ("met" if met else "not met")
    yield f"- target: device busy >= {TARGET_BUSY} with all features: least {number(busy, 3)}, {verdict}"
    for r in rows:
        if r.figures.failed:
            yield f"- **{r.figures.failed} requests failed** in run {r.repeat} with {r.features} features"


# ---- command line ----------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.sampling_cost", description=__doc__)
    p.add_argument(
        "--quick", action="store_true", help=f"a smoke run: {describe(QUICK)} (default: {describe(FULL)})"
    )
    p.add_argument("--threads", type=int, default=EnginePlan.threads, help="torch CPU threads for part A")
    p.add_argument("--out", type=Path, default=RESULTS, help="results directory (default: bench/results)")
    return p.parse_args(argv)


def describe(plan: Plan) -> str:
    e, s = plan.engine, plan.serving
    batches = ", ".join(map(str, e.batch_sizes))
    return f"batches {batches}, {e.steps} steps, best of {e.repeats}; {s.prompts} requests x {s.repeats}"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    command = command_line("bench.sampling_cost", argv)
    plan = QUICK if args.quick else FULL
    run = run_plan(replace(plan, engine=replace(plan.engine, threads=args.threads)))
    publish(NAME, run.started_at, to_json(run, command), to_markdown(run, command), args.out)


if __name__ == "__main__":
    main()
