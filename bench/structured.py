"""python -m bench.structured [--quick] [--out DIR]: what structured outputs (grammar masks) cost,
on the model (part A) and through the services (part B), in one run.

Every constrained request is held to SCHEMA, a JSON Schema of realistic shape: an object whose
`records` array holds at least MIN_ITEMS records of an id, a short name and up to 3 short tags.
Its shortest word (`shortest_output`) is thousands of bytes, so no grammar finishes in a run:
every constrained row is drawn under a mask on every step it samples, and every request, held
or not, runs to its length.

Part A, the model, in this process: a `WorkerEngine` over `smollm2` and `tiny` in float32 on the
CPU (torch threads fixed, `--threads`). Per model, batch size B and constrained rows (`none`: 0,
`all`: B), a run starts a fresh engine session and registers B greedy requests (one request slot
each, all held to SCHEMA or none) with a prefill of B random prompts of 32 tokens, whose result
it awaits; then it launches D decode steps whose inputs the engine reads from its FutureMap, each
launched one step ahead (step k+1 is submitted before step k's result is read, as the overlap
loop does). The grammar figures are the differences of the engine's own metrics between the
prefill's result and the last decode result, so they hold decode steps alone:
  device ms/step   the mean of the decode steps' forward_end - forward_start (on the CPU, the
                   forward thread's whole step, its wait for masks and its masked draw included);
  decode tok/s     B x D over the first decode step's forward start to the last result in hand;
  mask ms/step     `stepahead_grammar_mask_seconds`' sum over its count: the grammar thread's time
                   to fill one step's masks (all its constrained rows); mask us/row: that sum over
                   `stepahead_grammar_masked_rows_total`;
  wait ms/step     `stepahead_grammar_wait_seconds_total` over D: how long the forward thread
                   waited for the masks, after it had run the forward and drawn the other rows.
A run fails if a grammar finishes or a decode row is drawn without a mask. After one untimed
warmup round (2 decode steps each), `none` and `all` run in turns; of the repeats the best counts
(the least time, the most tok/s).

Part B, the services: a `sim` worker (`--sim-step-ms 10 --sim-token-us 0`) at concurrency 64
and a `tiny` worker at concurrency 16, each with an overlap and a serial scheduler over gRPC
(fresh processes per device and mode), and on those processes 0%, 25% and 100% of the requests
held to SCHEMA, in turns, repeated (loadgen's `Constrained`: the fraction spread evenly over the
request indices, warmup's too). Closed loop, 32-token prompts (random ids), exactly 64 new tokens
(ignore_eos); a run counts as like for like only if every request finished by length with all its
tokens, and each held request drew every token under a mask (both checked, flagged in the
report). Each measured run lies between two scrapes of both /metrics endpoints (as
`bench.run.measure`); device busy is the worker's forward time over busy + idle
(`bench.figures`), the grammar figures are the worker's metric deltas per executed step. The
targets (sim, overlap, 25% held: tok/s >= 0.95 of 0%'s, device busy >= 0.98) take the best run of
each fraction.

Writes bench/results/<UTC date-time>-structured.{json,md} and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import torch
from prometheus_client import generate_latest

from bench import engine_decode
from bench.cells import NONE, number, times
from bench.configs import TINY, Case, Configuration, Device, Mode, Workload, sim
from bench.engine_decode import (
    WARMUP_STEPS,
    DecodeRun,
    EnginePlan,
    Progress,
    Variation,
    find,
    greedy,
    run_engine_part,
)
from bench.envelope import Envelope, begin, load_clause
from bench.figures import Figures, figures, ratio
from bench.machine import Machine, load_average
from bench.promtext import Samples, delta, parse, total
from bench.run import Endpoints, measure, serving
from bench.save import RESULTS, command_line, publish
from loadgen.backend import Constrained
from stepahead.protocol import Constraint, GrammarConstraint, NewRequest, StepResult
from worker_svc.backends import ModelBackend
from worker_svc.engine import WorkerEngine

NAME = "structured"
TITLE = "Structured outputs: grammar masks on the model and the services"
MODELS = ("smollm2", "tiny")
MIN_ITEMS = 64  # records the schema asks for at least
NAME_CHARS, TAG_CHARS, MAX_TAGS, MAX_ID = 12, 8, 3, 99_999
FRACTIONS = (0.0, 0.25, 1.0)  # of the requests held to the schema, in part B
SERVING_MODES: tuple[Mode, ...] = ("overlap", "serial")
SIM_STEP_MS, SIM_CONCURRENCY, TINY_CONCURRENCY = 10.0, 64, 16
TARGET_MODEL, TARGET_BATCH, TARGET_MASK_SHARE = "smollm2", 16, 0.10  # of a plain decode step
TARGET_FRACTION, TARGET_KEEP, TARGET_BUSY = 0.25, 0.95, 0.98  # sim, overlap
LENGTH = "LENGTH"  # the finish reason of a request that ran to max_new_tokens

# the worker's grammar metrics (worker_svc/telemetry.py)
MASK = "stepahead_grammar_mask_seconds"
MASKED_ROWS = "stepahead_grammar_masked_rows_total"
WAIT = "stepahead_grammar_wait_seconds_total"
BATCHES = "stepahead_batches_total"
Rows = Literal["none", "all"]  # a part A run's constrained rows: none of the batch, or all of it
ROWS: tuple[Rows, ...] = ("none", "all")


# ---- the schema ------------------------------------------------------------------------------


def records_schema(min_items: int = MIN_ITEMS) -> str:
    """An object with a `records` array of at least `min_items` records (id, name, tags)."""
    record = {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": MAX_ID},
            "name": {"type": "string", "maxLength": NAME_CHARS},
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": TAG_CHARS},
                "maxItems": MAX_TAGS,
            },
        },
        "required": ["id", "name", "tags"],
        "additionalProperties": False,
    }
    records = {"type": "array", "items": record, "minItems": min_items}
    return json.dumps(
        {
            "type": "object",
            "properties": {"records": records},
            "required": ["records"],
            "additionalProperties": False,
        }
    )


def shortest_output(min_items: int = MIN_ITEMS) -> str:
    """The schema's shortest word in the worker's JSON layout (`json.dumps`' separators): the
    least a constrained request must write before its grammar can finish. On a byte tokenizer
    (sim, tiny) each byte is a token."""
    return json.dumps({"records": [{"id": 0, "name": "", "tags": []}] * min_items})


SCHEMA = records_schema()
CONSTRAINT = Constraint("json", SCHEMA)


# ---- plans -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Served:
    """A device through the services, and the closed loop it serves in every run."""

    device: Device
    workload: Workload


@dataclass(frozen=True)
class ServingPlan:
    served: tuple[Served, ...]
    repeats: int  # measured runs of each fraction, in turns; the best counts for the targets
    fractions: tuple[float, ...] = FRACTIONS
    modes: tuple[Mode, ...] = SERVING_MODES


@dataclass(frozen=True)
class Plan:
    name: str
    engine: EnginePlan
    serving: ServingPlan


SERVED_INPUT_LEN, SERVED_OUTPUT_LEN = 32, 64


def closed_loop(prompts: int, concurrency: int) -> Workload:
    """Exactly SERVED_OUTPUT_LEN new tokens per request; a warmup of one wave."""
    return Workload(prompts, concurrency, SERVED_INPUT_LEN, SERVED_OUTPUT_LEN, 0.0, concurrency)


def serving_plan(sim_prompts: int, tiny_prompts: int, repeats: int) -> ServingPlan:
    served = (
        Served(sim(SIM_STEP_MS), closed_loop(sim_prompts, SIM_CONCURRENCY)),
        Served(TINY, closed_loop(tiny_prompts, TINY_CONCURRENCY)),
    )
    return ServingPlan(served, repeats)


FULL = Plan("full", EnginePlan(MODELS, (1, 16), steps=32, repeats=3), serving_plan(384, 64, repeats=2))
QUICK = Plan("quick", EnginePlan(MODELS, (1, 16), steps=8, repeats=1), serving_plan(128, 32, repeats=1))


# ---- part A: the model, in process -----------------------------------------------------------


@dataclass(frozen=True)
class Grammar:
    """The worker's grammar metrics over some steps (deltas)."""

    mask_s: float  # filling masks, on the grammar thread
    mask_steps: int  # steps that had masks filled
    masked_rows: int  # rows drawn under a mask
    wait_s: float  # the forward thread's wait for masks
    steps: int  # steps executed

    @property
    def mask_ms_per_step(self) -> float | None:
        """Per step with a constrained row."""
        return ratio(self.mask_s * 1e3, self.mask_steps)

    @property
    def mask_us_per_row(self) -> float | None:
        return ratio(self.mask_s * 1e6, self.masked_rows)

    @property
    def wait_ms_per_step(self) -> float | None:
        """Per executed step, constrained or not."""
        return ratio(self.wait_s * 1e3, self.steps)


def grammar_of(worker: Samples, steps: int) -> Grammar:
    """From a delta of the worker's metrics; `steps`: those executed meanwhile."""
    return Grammar(
        mask_s=total(worker, f"{MASK}_sum"),
        mask_steps=round(total(worker, f"{MASK}_count")),
        masked_rows=round(total(worker, MASKED_ROWS)),
        wait_s=total(worker, WAIT),
        steps=steps,
    )


@dataclass(frozen=True)
class GrammarRun(DecodeRun):
    """One run's decode steps and the grammar metrics over them."""

    grammar: Grammar


def best(values: Iterable[float | None], pick: Callable[[list[float]], float]) -> float | None:
    known = [v for v in values if v is not None]
    return pick(known) if known else None


class EngineRow(engine_decode.EngineRow[Rows, GrammarRun]):
    """The runs of a model and batch size with none or all of the rows held to SCHEMA."""

    @property
    def rows(self) -> Rows:
        return self.variant

    @property
    def constrained_rows(self) -> int:
        return self.batch if self.rows == "all" else 0

    @property
    def mask_ms_per_step(self) -> float | None:
        return best((r.grammar.mask_ms_per_step for r in self.runs), min)

    @property
    def mask_us_per_row(self) -> float | None:
        return best((r.grammar.mask_us_per_row for r in self.runs), min)

    @property
    def wait_ms_per_step(self) -> float | None:
        return best((r.grammar.wait_ms_per_step for r in self.runs), min)


class GrammarFinished(RuntimeError):
    """A constrained row's grammar finished, or a row was drawn without its mask, during a
    measured run: the figures would not be of every row held for every step."""


class GrammarWatch:
    """The engine's grammar metrics over a run's decode steps, from the prefill's result on: no
    grammar may finish, and `masked_rows` rows must be drawn under a mask."""

    def __init__(self, engine: WorkerEngine, masked_rows: int, steps: int) -> None:
        self.engine = engine
        self.masked_rows = masked_rows
        self.steps = steps
        self.before = self._metrics()

    def read(self, result: StepResult) -> StepResult:
        return check_running(result)

    def end(self, run: DecodeRun) -> GrammarRun:
        grammar = grammar_of(delta(self.before, self._metrics()), self.steps)
        check_masked(grammar, self.masked_rows)
        return GrammarRun(run.device_ms, run.wall_s, run.tokens, grammar)

    def _metrics(self) -> Samples:
        return parse(generate_latest(self.engine.metrics.registry).decode())


def check_running(result: StepResult) -> StepResult:
    if result.grammar_finished:
        raise GrammarFinished(
            f"step {result.step_id}: the grammar of rows {list(result.grammar_finished)} finished"
        )
    return result


def check_masked(grammar: Grammar, expected: int) -> None:
    if grammar.masked_rows != expected:
        raise GrammarFinished(f"{grammar.masked_rows} rows drawn under a mask, not {expected}")


class Held(Variation[Rows, GrammarRun, EngineRow]):
    """Runs that differ in which rows are held to SCHEMA: none of the batch, then all of it."""

    def __init__(self) -> None:
        super().__init__(ROWS)

    def requests(self, variant: Rows, batch: int, prompt_len: int, backend: ModelBackend) -> list[NewRequest]:
        grammar = GrammarConstraint(CONSTRAINT) if variant == "all" else None
        return [greedy(slot, grammar=grammar) for slot in range(batch)]

    def watch(self, engine: WorkerEngine, variant: Rows, batch: int, steps: int) -> GrammarWatch:
        return GrammarWatch(engine, batch * steps if variant == "all" else 0, steps)

    def row(self, model: str, batch: int, variant: Rows, runs: tuple[GrammarRun, ...]) -> EngineRow:
        return EngineRow(model, batch, variant, runs)

    def progress_line(self, rows: Sequence[EngineRow], row: EngineRow) -> str:
        return engine_progress_line(row, versus_plain(rows, row))


HELD = Held()


@dataclass(frozen=True)
class VersusPlain:
    """A row's best figures over the unconstrained row's at the same model and batch size."""

    device_ms: float | None
    tokens_per_s: float | None
    mask_share: float | None  # mask ms per step over the plain step's device ms


def versus_plain(rows: Sequence[EngineRow], row: EngineRow) -> VersusPlain:
    plain = find(rows, row.model, row.batch, "none")
    if plain is None:
        return VersusPlain(None, None, None)
    return VersusPlain(
        ratio(row.device_ms, plain.device_ms),
        ratio(row.tokens_per_s, plain.tokens_per_s),
        ratio(row.mask_ms_per_step, plain.device_ms),
    )


def engine_progress_line(row: EngineRow, vs: VersusPlain) -> str:
    return (
        f"{row.model} batch {row.batch:>2}, {row.constrained_rows:>2} constrained: {row.device_ms:8.2f} "
        f"ms/step ({times(vs.device_ms)}), {row.tokens_per_s:9,.1f} tok/s; mask "
        f"{number(row.mask_ms_per_step, 3)} ms/step, wait {number(row.wait_ms_per_step, 3)} ms/step"
    )


# ---- part B: the services --------------------------------------------------------------------


def constrained_requests(fraction: float, prompts: int) -> int:
    constrained = Constrained(fraction, SCHEMA)
    return sum(constrained.applies(i) for i in range(prompts))


@dataclass(frozen=True)
class ServingRow:
    device: str
    concurrency: int
    mode: Mode
    fraction: float  # of the requests held to the schema
    repeat: int  # 0, 1, ...: the turn it ran in
    constrained: int  # requests held to it
    output_len: int  # every request's max_new_tokens
    figures: Figures
    grammar: Grammar
    finish_reasons: dict[str, int]

    @property
    def to_length(self) -> bool:
        """Every request completed by length with all its tokens: like for like."""
        f = self.figures
        return (
            f.failed == 0
            and self.finish_reasons == {LENGTH: f.completed}
            and f.output_tokens == f.completed * self.output_len
        )

    @property
    def masked_as_expected(self) -> bool:
        """Each held request drew every token under a mask (its first one at the prefill)."""
        return self.grammar.masked_rows == self.constrained * self.output_len


def run_serving_part(plan: ServingPlan, progress: Progress) -> list[ServingRow]:
    """Fresh processes per device and mode; on them, the fractions in turns (0, 25, 100, 0, ...)."""
    rows = []
    for served in plan.served:
        for mode in plan.modes:
            case = Case(Configuration(served.device, mode, "grpc"), served.workload)
            with serving(case.configuration) as endpoints:
                for repeat in range(plan.repeats):
                    for fraction in plan.fractions:
                        rows.append(measure_fraction(endpoints, case, fraction, repeat))
                        progress(serving_progress_line(rows[-1]))
    return rows


def measure_fraction(endpoints: Endpoints, case: Case, fraction: float, repeat: int) -> ServingRow:
    workload = case.workload
    measured = measure(endpoints, workload, constrained=Constrained(fraction, SCHEMA))
    f = figures(case, measured)
    steps = round(total(measured.worker, BATCHES))
    return ServingRow(
        device=case.configuration.device.name,
        concurrency=workload.concurrency,
        mode=case.configuration.mode,
        fraction=fraction,
        repeat=repeat,
        constrained=constrained_requests(fraction, workload.num_prompts),
        output_len=workload.output_len,
        figures=f,
        grammar=grammar_of(measured.worker, steps),
        finish_reasons=dict(measured.summary.finish_reasons),
    )


def serving_progress_line(row: ServingRow) -> str:
    f, g = row.figures, row.grammar
    return (
        f"{row.device} {row.mode:>7}, {row.fraction:4.0%} constrained, run {row.repeat}: "
        f"{f.output_tokens_per_s:7,.1f} tok/s, "
        f"device busy {number(f.device_busy_fraction, 3)}, mask {number(g.mask_us_per_row, 1)} us/row, "
        f"wait {number(g.wait_ms_per_step, 3)} ms/step, {f.failed} failed"
    )


# ---- a run -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class StructuredRun:
    plan: Plan
    started_at: datetime  # UTC
    machine: Machine
    torch_threads: int
    load_average: tuple[float, float, float]  # before part A, after it, after part B
    engine: tuple[EngineRow, ...]
    serving: tuple[ServingRow, ...]


def to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_plan(plan: Plan, progress: Progress = to_stderr) -> StructuredRun:
    (started_at, machine), before = begin(), load_average()
    engine = run_engine_part(plan.engine, HELD, progress)
    between = load_average()
    served = run_serving_part(plan.serving, progress)
    loads = (before, between, load_average())
    return StructuredRun(
        plan, started_at, machine, torch.get_num_threads(), loads, tuple(engine), tuple(served)
    )


# ---- targets ---------------------------------------------------------------------------------


def engine_target_row(rows: Sequence[EngineRow]) -> EngineRow | None:
    return find(rows, TARGET_MODEL, TARGET_BATCH, "all")


def mask_share_at_target(rows: Sequence[EngineRow]) -> float | None:
    row = engine_target_row(rows)
    return None if row is None else versus_plain(rows, row).mask_share


def engine_target_met(rows: Sequence[EngineRow]) -> bool | None:
    share = mask_share_at_target(rows)
    return None if share is None else share < TARGET_MASK_SHARE


def sim_overlap(rows: Sequence[ServingRow], fraction: float) -> list[ServingRow]:
    return [r for r in rows if (r.device, r.mode, r.fraction) == ("sim", "overlap", fraction)]


@dataclass(frozen=True)
class ServingTarget:
    """Sim, overlap: TARGET_FRACTION constrained against none, the best run of each."""

    kept: float | None  # tok/s over the 0% runs'
    busy: float | None  # device busy at TARGET_FRACTION

    @property
    def kept_met(self) -> bool | None:
        return None if self.kept is None else self.kept >= TARGET_KEEP

    @property
    def busy_met(self) -> bool | None:
        return None if self.busy is None else self.busy >= TARGET_BUSY


def serving_target(rows: Sequence[ServingRow]) -> ServingTarget:
    plain, held = sim_overlap(rows, 0.0), sim_overlap(rows, TARGET_FRACTION)
    plain_tokens = best((r.figures.output_tokens_per_s for r in plain), max)
    held_tokens = best((r.figures.output_tokens_per_s for r in held), max)
    busy = best((r.figures.device_busy_fraction for r in held), max)
    return ServingTarget(ratio(held_tokens, plain_tokens), busy)


def verdict(met: bool | None) -> str:
    return "not measured" if met is None else ("met" if met else "not met")


# ---- reporting -------------------------------------------------------------------------------


def envelope(run: StructuredRun, command: str) -> Envelope:
    """The frame; the load average is this run's own: before part A, after it, after part B."""
    before, between, after = run.load_average
    clauses = (
        f"{run.torch_threads} torch threads",
        load_clause(before, {"part A": between, "part B": after}),
    )
    return Envelope.planned(TITLE, command, run.plan, run.started_at, run.machine, clauses=clauses)


def to_json(run: StructuredRun, command: str) -> dict[str, Any]:
    return envelope(run, command).json(
        {
            "torch_threads": run.torch_threads,
            "load_average_1m": dict(
                zip(("before", "after_engine", "after_serving"), run.load_average, strict=True)
            ),
            "schema": json.loads(SCHEMA),
            "shortest_output_bytes": len(shortest_output()),
            "engine": [_engine_json(run.engine, r) for r in run.engine],
            "serving": [_serving_json(r) for r in run.serving],
            "targets": _targets_json(run),
        }
    )


def _grammar_json(g: Grammar) -> dict[str, Any]:
    return {
        **asdict(g),
        "mask_ms_per_step": g.mask_ms_per_step,
        "mask_us_per_row": g.mask_us_per_row,
        "wait_ms_per_step": g.wait_ms_per_step,
    }


def _engine_json(rows: Sequence[EngineRow], r: EngineRow) -> dict[str, Any]:
    vs = versus_plain(rows, r)
    return {
        "model": r.model,
        "batch": r.batch,
        "constrained_rows": r.constrained_rows,
        "device_ms_per_step": r.device_ms,
        "decode_tokens_per_s": r.tokens_per_s,
        "mask_ms_per_step": r.mask_ms_per_step,
        "mask_us_per_row": r.mask_us_per_row,
        "wait_ms_per_step": r.wait_ms_per_step,
        "device_ms_over_plain": vs.device_ms,
        "tokens_per_s_over_plain": vs.tokens_per_s,
        "mask_over_plain_step": vs.mask_share,
        "runs": [
            {
                "device_ms": run.device_ms,
                "wall_s": run.wall_s,
                "tokens": run.tokens,
                "tokens_per_s": run.tokens_per_s,
                "grammar": _grammar_json(run.grammar),
            }
            for run in r.runs
        ],
    }


def _serving_json(r: ServingRow) -> dict[str, Any]:
    return {
        "device": r.device,
        "concurrency": r.concurrency,
        "mode": r.mode,
        "fraction": r.fraction,
        "repeat": r.repeat,
        "constrained_requests": r.constrained,
        "output_len": r.output_len,
        "finish_reasons": r.finish_reasons,
        "to_length": r.to_length,
        "masked_as_expected": r.masked_as_expected,
        "figures": asdict(r.figures),
        "grammar": _grammar_json(r.grammar),
    }


def _targets_json(run: StructuredRun) -> dict[str, Any]:
    target = serving_target(run.serving)
    return {
        "engine": {
            "model": TARGET_MODEL,
            "batch": TARGET_BATCH,
            "mask_over_plain_step_below": TARGET_MASK_SHARE,
            "mask_over_plain_step": mask_share_at_target(run.engine),
            "met": engine_target_met(run.engine),
        },
        "serving": {
            "device": "sim",
            "mode": "overlap",
            "fraction": TARGET_FRACTION,
            "tokens_per_s_kept_at_least": TARGET_KEEP,
            "tokens_per_s_kept": target.kept,
            "kept_met": target.kept_met,
            "busy_at_least": TARGET_BUSY,
            "busy": target.busy,
            "busy_met": target.busy_met,
        },
    }


def to_markdown(run: StructuredRun, command: str) -> str:
    return envelope(run, command).markdown(
        [
            "## A. The model, in process",
            "",
            *engine_table(run.engine),
            "",
            *engine_notes(run.plan.engine),
            *engine_target_lines(run.engine),
            "",
            "## B. The services",
            "",
            *serving_table(run.serving),
            "",
            *serving_notes(run.plan.serving),
            *serving_target_lines(run.serving),
            *serving_warnings(run.serving),
        ]
    )


def engine_table(rows: Sequence[EngineRow]) -> list[str]:
    header = (
        "| model | batch | constrained rows | device ms/step | vs plain | decode tok/s | vs plain "
        "| mask ms/step | mask us/row | mask / plain step | mask wait ms/step |"
    )
    return [header, "|---|---:|---:|" + "---:|" * 8, *(_engine_row(r, versus_plain(rows, r)) for r in rows)]


def _engine_row(r: EngineRow, vs: VersusPlain) -> str:
    cells = [
        r.model,
        str(r.batch),
        str(r.constrained_rows),
        number(r.device_ms, 2),
        times(vs.device_ms),
        number(r.tokens_per_s, 1),
        times(vs.tokens_per_s),
        number(r.mask_ms_per_step, 3),
        number(r.mask_us_per_row, 1),
        share(vs.mask_share),
        number(r.wait_ms_per_step, 3),
    ]
    return "| " + " | ".join(cells) + " |"


def share(value: float | None) -> str:
    return NONE if value is None else f"{value:.1%}"


def engine_notes(plan: EnginePlan) -> list[str]:
    return [
        f"- float32 on the CPU; batch B: B greedy requests, {plan.prompt_len}-token random prompts, "
        f"the prefill awaited, then {plan.steps} decode steps each launched one step ahead (FutureMap "
        f"inputs); best of {plan.repeats} runs per row, plain and constrained in turns after a "
        f"{WARMUP_STEPS}-step warmup round",
        "- constrained rows: all of the batch or none, held to the schema below; no grammar finished "
        "and every constrained decode row was drawn under a mask (checked)",
        "- device ms/step: mean forward_end - forward_start over a run's decode steps (the forward "
        "thread's whole step, its wait for masks included); decode tok/s: B x steps over first decode "
        "forward start to last result",
        "- mask ms/step: the grammar thread's time to fill one step's masks (all its rows); mask / plain "
        "step: that over the plain row's device ms/step; mask wait: the forward thread's wait for "
        "them, per decode step",
        f"- schema: an object whose `records` array holds at least {MIN_ITEMS} records (integer id "
        f"0-{MAX_ID:,}, name of at most {NAME_CHARS} characters, at most {MAX_TAGS} tags of at most "
        f"{TAG_CHARS}); its shortest output is {len(shortest_output()):,} bytes",
    ]


def engine_target_lines(rows: Sequence[EngineRow]) -> Iterator[str]:
    target = f"mask time per step < {TARGET_MASK_SHARE:.0%} of a plain decode step"
    share_at = mask_share_at_target(rows)
    if share_at is None:
        yield f"- target ({target}): not measured, no {TARGET_MODEL} rows at batch {TARGET_BATCH}"
        return
    yield (
        f"- target ({target}) on {TARGET_MODEL} at batch {TARGET_BATCH}: {share(share_at)}, "
        f"{verdict(engine_target_met(rows))}"
    )


def serving_table(rows: Sequence[ServingRow]) -> list[str]:
    header = (  # one row per measured run
        "| device | concurrency | mode | constrained | run | output tok/s | vs 0% | device busy "
        "| tokens/step | mean forward ms "
        "| mask us/row | mask ms/masked step | mask wait ms/step | all to length |"
    )
    return [header, "|---|---:|---|" + "---:|" * 10 + "---|", *(_serving_row(rows, r) for r in rows)]


def versus_unconstrained(rows: Sequence[ServingRow], row: ServingRow) -> float | None:
    """Output tok/s over the 0% run's of the same turn, on the same processes."""
    key = (row.device, row.mode, row.repeat, 0.0)
    plain = next((r for r in rows if (r.device, r.mode, r.repeat, r.fraction) == key), None)
    if plain is None:
        return None
    return ratio(row.figures.output_tokens_per_s, plain.figures.output_tokens_per_s)


def _serving_row(rows: Sequence[ServingRow], r: ServingRow) -> str:
    f, g = r.figures, r.grammar
    cells = [
        r.device,
        str(r.concurrency),
        r.mode,
        f"{r.fraction:.0%}",
        str(r.repeat),
        number(f.output_tokens_per_s, 1),
        times(versus_unconstrained(rows, r)),
        number(f.device_busy_fraction, 3),
        number(f.tokens_per_step, 1),
        number(f.mean_forward_ms, 2),
        number(g.mask_us_per_row, 1),
        number(g.mask_ms_per_step, 3),
        number(g.wait_ms_per_step, 3),
        "yes" if r.to_length else "**no**",
    ]
    return "| " + " | ".join(cells) + " |"


def serving_notes(plan: ServingPlan) -> list[str]:
    described = "; ".join(
        f"{s.device.name} `{' '.join(s.device.worker_args)}`, {s.workload.num_prompts} requests at "
        f"concurrency {s.workload.concurrency}"
        for s in plan.served
    )
    return [
        f"- {described}; fresh processes per device and mode, on them the fractions in turns, "
        f"{plan.repeats} times (run: the turn)",
        f"- closed loop, {SERVED_INPUT_LEN}-token prompts (random ids), exactly {SERVED_OUTPUT_LEN} "
        "new tokens (ignore_eos), greedy; warmup: one wave of 8 tokens, the same fraction held",
        "- constrained: the fraction of the requests held to the schema (loadgen's `Constrained`, spread "
        "evenly); all to length: every request finished by length with all its tokens",
        "- vs 0%: output tok/s over the 0% run's of the same turn; tokens/step: output tokens over the "
        "steps the scheduler launched (how full the batches were)",
        "- device busy: forward time over busy + idle; mask us/row: the grammar thread's mask time over "
        "the rows drawn under a mask; mask wait: the forward thread's wait for masks per executed step",
    ]


def serving_target_lines(rows: Sequence[ServingRow]) -> Iterator[str]:
    t = serving_target(rows)
    at = f"sim, overlap, {TARGET_FRACTION:.0%} constrained, the best run of each fraction"
    yield (
        f"- target ({at}): tok/s >= {TARGET_KEEP} of 0%'s: {times(t.kept)}, {verdict(t.kept_met)}; "
        f"device busy >= {TARGET_BUSY}: {number(t.busy, 3)}, {verdict(t.busy_met)}"
    )


def serving_warnings(rows: Sequence[ServingRow]) -> Iterator[str]:
    for r in rows:
        name = f"{r.device} {r.mode}, {r.fraction:.0%} constrained"
        if r.figures.failed:
            yield f"- **{r.figures.failed} requests failed** in {name}"
        if not r.to_length:
            yield f"- **not every request ran to length** in {name}: finish reasons {r.finish_reasons}"
        if not r.masked_as_expected:
            expected = r.constrained * r.output_len
            yield f"- **{r.grammar.masked_rows} rows drawn under a mask, not {expected}**, in {name}"


# ---- command line ----------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.structured", description=__doc__)
    p.add_argument(
        "--quick", action="store_true", help=f"a smoke run: {describe(QUICK)} (default: {describe(FULL)})"
    )
    p.add_argument("--threads", type=int, default=EnginePlan.threads, help="torch CPU threads for part A")
    p.add_argument("--out", type=Path, default=RESULTS, help="results directory (default: bench/results)")
    return p.parse_args(argv)


def describe(plan: Plan) -> str:
    e = plan.engine
    batches = ", ".join(map(str, e.batch_sizes))
    served = ", ".join(f"{s.device.name} {s.workload.num_prompts}" for s in plan.serving.served)
    return f"batches {batches}, {e.steps} steps, best of {e.repeats}; requests per run: {served}"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    command = command_line("bench.structured", argv)
    plan = QUICK if args.quick else FULL
    run = run_plan(replace(plan, engine=replace(plan.engine, threads=args.threads)))
    publish(NAME, run.started_at, to_json(run, command), to_markdown(run, command), args.out)


if __name__ == "__main__":
    main()
