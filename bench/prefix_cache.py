"""python -m bench.prefix_cache [--quick] [--out DIR]: what the scheduler's prefix cache buys
when every request starts with the same system prompt, cache on and off side by side, on
`tiny` (float32 on the CPU) and on the `sim` device.

The workload is loadgen's `prefix-repetition` dataset: one random prefix of 1,024 token ids
(32..126) shared by every request, then a random suffix of 32 ids of the request's own, and
exactly 64 new tokens (ignore_eos), sent as a closed loop at concurrency 64 over one gRPC
connection. Each (model, cache on/off) gets a fresh worker and overlap scheduler over gRPC
(`--no-prefix-cache` for off). Before the measured run, `concurrency` requests of the dataset's
warmup stream (the same prefix, suffixes no measured request has, 8 new tokens) go all at once,
so the measured run starts with the prefix cached when the cache is on; the measured run lies
between two scrapes of both /metrics endpoints, each taken once no request is live.

Per row: TTFT p50 and p99 and output tok/s (loadgen's summary of the measured requests); prefill
tokens computed, the scheduler's `stepahead_prompt_tokens_total` minus
`stepahead_prefix_cache_hit_tokens_total` over the run (prompt tokens of the admitted requests
that were not found in the cache); the worker's tokens executed (`stepahead_batch_tokens_total`,
prefill and decode rows together); device busy, the worker's forward time over its busy + idle
time (`bench.figures`); mean forward ms, its busy time per executed batch. The on/off ratios
divide the cache-on figure by the cache-off one of the same model.

Writes bench/results/<UTC date-time>-prefix-cache.{json,md} and prints the tables.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.cells import NONE, number, times
from bench.configs import SIM_KV_SLOTS, Configuration, Device
from bench.envelope import Envelope, begin
from bench.figures import BUSY, IDLE, busy_fraction, mean_forward_ms, ratio
from bench.machine import Machine, load_average
from bench.promtext import Samples, delta, scrape, total
from bench.run import Endpoints, Measurement, run_loadgen, serving, settle
from bench.save import RESULTS, command_line, publish
from loadgen import BenchmarkConfig
from loadgen.backend import Sampling
from loadgen.client import GrpcBackend
from loadgen.timing import RequestTiming
from loadgen.workload import WARMUP_STREAM, PrefixRepetitionDataset, load_workload

NAME = "prefix-cache"
TITLE = "Prefix cache: a shared system prompt, cache on and off"
PROMPT_TOKENS = "stepahead_prompt_tokens_total"
HIT_TOKENS = "stepahead_prefix_cache_hit_tokens_total"
EVICTED_SLOTS = "stepahead_prefix_cache_evicted_slots_total"
WORKER_TOKENS = "stepahead_batch_tokens_total"
TINY_KV_SLOTS = 81920  # tokens: 64 requests of 1,120 (71,680) fit without the cache
TTFT_TARGET_MODEL, TTFT_TARGET_FACTOR = "tiny", 3.0  # TTFT p50 at least 3x lower with the cache
BUSY_TARGET_MODEL, BUSY_TARGET = "sim", 0.98  # device busy with the cache on
CACHE_STATES = (True, False)  # on first, then off, for each model

Progress = Callable[[str], None]


def tiny(kv_slots: int = TINY_KV_SLOTS) -> Device:
    return Device("tiny", ("--model", "tiny", "--kv-slots", str(kv_slots)))


def sim(step_ms: float = 10.0, token_us: float = 20.0) -> Device:
    """The sim with a per-token cost, so that prefill tokens take device time."""
    args = ("--model", "sim", "--sim-step-ms", f"{step_ms:g}", "--sim-token-us", f"{token_us:g}")
    return Device("sim", (*args, "--kv-slots", str(SIM_KV_SLOTS)), step_ms)


@dataclass(frozen=True)
class CacheConfiguration(Configuration):
    """A configuration whose scheduler runs with its prefix cache on or off (`--no-prefix-cache`)."""

    prefix_cache: bool = True

    @property
    def name(self) -> str:
        return f"{super().name}, prefix cache {on_off(self.prefix_cache)}"

    @property
    def scheduler_args(self) -> tuple[str, ...]:
        args = super().scheduler_args
        return args if self.prefix_cache else (*args, "--no-prefix-cache")


def on_off(prefix_cache: bool) -> str:
    return "on" if prefix_cache else "off"


# ---- plans -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelPlan:
    device: Device
    prompts: int  # measured requests
    concurrency: int  # requests in flight (a closed loop); also the warmup's request count


@dataclass(frozen=True)
class Plan:
    name: str
    models: tuple[ModelPlan, ...]
    prefix_len: int = 1024
    suffix_len: int = 32
    num_prefixes: int = 1
    output_len: int = 64
    warmup_output_len: int = 8
    seed: int = 0

    def dataset(self, output_len: int | None = None) -> PrefixRepetitionDataset:
        new_tokens = self.output_len if output_len is None else output_len
        return PrefixRepetitionDataset(self.prefix_len, self.suffix_len, self.num_prefixes, new_tokens)

    @property
    def prompt_len(self) -> int:
        return self.prefix_len + self.suffix_len


FULL = Plan("full", (ModelPlan(tiny(), 384, 64), ModelPlan(sim(), 1024, 64)))
QUICK = Plan("quick", (ModelPlan(tiny(), 64, 32), ModelPlan(sim(), 128, 64)))


# ---- figures ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class CacheFigures:
    ttft_p50_ms: float
    ttft_p99_ms: float
    output_tokens_per_s: float
    prompt_tokens: int  # prompt tokens of the requests admitted during the run
    cache_hit_tokens: int  # of those, found in the prefix cache
    evicted_slots: int  # KV slots the cache gave back to make room
    worker_tokens: int  # tokens the worker's forwards executed, prefill and decode
    device_busy_fraction: float | None
    mean_forward_ms: float | None
    completed: int
    failed: int
    duration_s: float

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens computed: those not found in the cache."""
        return self.prompt_tokens - self.cache_hit_tokens

    @property
    def hit_ratio(self) -> float | None:
        return ratio(self.cache_hit_tokens, self.prompt_tokens)

    @property
    def prefill_tokens_per_request(self) -> float | None:
        return ratio(self.prefill_tokens, self.completed)


def cache_figures(measured: Measurement) -> CacheFigures:
    s, scheduler, worker = measured.summary, measured.scheduler, measured.worker
    return CacheFigures(
        ttft_p50_ms=s.ttft.median,
        ttft_p99_ms=s.ttft.p99,
        output_tokens_per_s=s.output_throughput,
        prompt_tokens=_count(scheduler, PROMPT_TOKENS),
        cache_hit_tokens=_count(scheduler, HIT_TOKENS),
        evicted_slots=_count(scheduler, EVICTED_SLOTS),
        worker_tokens=_count(worker, WORKER_TOKENS),
        device_busy_fraction=busy_fraction(total(worker, BUSY), total(worker, IDLE)),
        mean_forward_ms=mean_forward_ms(worker),
        completed=s.completed,
        failed=s.failed,
        duration_s=s.duration_s,
    )


def _count(samples: Samples, name: str) -> int:
    return round(total(samples, name))


@dataclass(frozen=True)
class Row:
    configuration: CacheConfiguration
    prompts: int
    concurrency: int
    warmup_failed: int
    figures: CacheFigures

    @property
    def model(self) -> str:
        return self.configuration.device.name

    @property
    def prefix_cache(self) -> bool:
        return self.configuration.prefix_cache


@dataclass(frozen=True)
class OnOverOff:
    """The cache-on figure over the cache-off one of the same model; None where a side is missing."""

    model: str
    ttft_p50: float | None
    prefill_tokens: float | None
    output_tokens_per_s: float | None
    device_busy: float | None

    @property
    def ttft_p50_times_lower(self) -> float | None:
        """How many times lower TTFT p50 is with the cache: off over on."""
        return None if self.ttft_p50 is None else ratio(1.0, self.ttft_p50)


def find(rows: Sequence[Row], model: str, prefix_cache: bool) -> Row | None:
    return next((r for r in rows if (r.model, r.prefix_cache) == (model, prefix_cache)), None)


def on_over_off(rows: Sequence[Row], model: str) -> OnOverOff:
    on, off = find(rows, model, True), find(rows, model, False)
    if on is None or off is None:
        return OnOverOff(model, None, None, None, None)
    a, b = on.figures, off.figures
    return OnOverOff(
        model,
        ratio(a.ttft_p50_ms, b.ttft_p50_ms),
        ratio(a.prefill_tokens, b.prefill_tokens),
        ratio(a.output_tokens_per_s, b.output_tokens_per_s),
        ratio(a.device_busy_fraction, b.device_busy_fraction),
    )


def models_of(rows: Sequence[Row]) -> list[str]:
    return list(dict.fromkeys(r.model for r in rows))


def all_ratios(rows: Sequence[Row]) -> list[OnOverOff]:
    return [on_over_off(rows, model) for model in models_of(rows)]


# ---- running ---------------------------------------------------------------------------------


def warm_up(address: str, dataset: PrefixRepetitionDataset, seed: int, count: int) -> int:
    """`count` requests of the dataset's warmup stream, all at once, over one connection: the
    measured run's prefixes with suffixes of their own. Returns how many failed."""
    return asyncio.run(_warm_up(address, dataset, seed, count))


async def _warm_up(address: str, dataset: PrefixRepetitionDataset, seed: int, count: int) -> int:
    workload = load_workload(dataset, seed, WARMUP_STREAM)
    timings = [RequestTiming(i, workload.prompt(i)) for i in range(count)]
    backend = GrpcBackend(address, 1, Sampling(0.0, ignore_eos=True))
    try:
        await backend.connect()
        await asyncio.gather(*(backend.send(t, time.perf_counter) for t in timings))
    finally:
        await backend.close()
    return sum(t.error is not None for t in timings)


def measured_config(address: str, plan: Plan, model: ModelPlan) -> BenchmarkConfig:
    return BenchmarkConfig(
        server=address,
        dataset=plan.dataset(),
        num_prompts=model.prompts,
        max_concurrency=model.concurrency,
        connections=1,
        seed=plan.seed,
        ignore_eos=True,
    )


def measure(endpoints: Endpoints, plan: Plan, model: ModelPlan) -> tuple[Measurement, int]:
    """The warmup, then the measured run between two scrapes of each process, each taken once
    no request is live; with the warmup's failures."""
    warmup = plan.dataset(plan.warmup_output_len)
    warmup_failed = warm_up(endpoints.address, warmup, plan.seed, model.concurrency)
    settle(endpoints)
    scheduler_before, worker_before = scrape(endpoints.scheduler_metrics), scrape(endpoints.worker_metrics)
    cpu_before = time.process_time()
    summary = run_loadgen(measured_config(endpoints.address, plan, model))
    client_cpu_s = time.process_time() - cpu_before
    settle(endpoints)
    scheduler = delta(scheduler_before, scrape(endpoints.scheduler_metrics))
    worker = delta(worker_before, scrape(endpoints.worker_metrics))
    return Measurement(summary, scheduler, worker, client_cpu_s), warmup_failed


def run_row(plan: Plan, model: ModelPlan, prefix_cache: bool) -> Row:
    configuration = CacheConfiguration(model.device, "overlap", "grpc", prefix_cache=prefix_cache)
    with serving(configuration) as endpoints:
        measured, warmup_failed = measure(endpoints, plan, model)
    return Row(configuration, model.prompts, model.concurrency, warmup_failed, cache_figures(measured))


@dataclass(frozen=True)
class PrefixCacheRun:
    plan: Plan
    started_at: datetime  # UTC
    machine: Machine
    load_average_after: dict[str, float]  # 1-minute load average after each model's rows
    rows: tuple[Row, ...]  # by model, cache on before off


def to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_plan(plan: Plan, progress: Progress = to_stderr) -> PrefixCacheRun:
    started_at, machine = begin()
    rows: list[Row] = []
    loads: dict[str, float] = {}
    for model in plan.models:
        for prefix_cache in CACHE_STATES:
            rows.append(run_row(plan, model, prefix_cache))
            progress(progress_line(rows[-1]))
        loads[model.device.name] = load_average()
    return PrefixCacheRun(plan, started_at, machine, loads, tuple(rows))


def progress_line(r: Row) -> str:
    f = r.figures
    return (
        f"{r.model}, prefix cache {on_off(r.prefix_cache):>3}: TTFT p50 {f.ttft_p50_ms:,.1f} ms, "
        f"{f.prefill_tokens:,} prefill tokens computed, {f.output_tokens_per_s:,.1f} tok/s, "
        f"device busy {number(f.device_busy_fraction, 3)}, {f.failed} failed"
    )


# ---- targets ---------------------------------------------------------------------------------


def ttft_target_met(rows: Sequence[Row]) -> bool | None:
    times_lower = on_over_off(rows, TTFT_TARGET_MODEL).ttft_p50_times_lower
    return None if times_lower is None else times_lower >= TTFT_TARGET_FACTOR


def busy_with_cache(rows: Sequence[Row]) -> float | None:
    on = find(rows, BUSY_TARGET_MODEL, True)
    return None if on is None else on.figures.device_busy_fraction


def busy_target_met(rows: Sequence[Row]) -> bool | None:
    busy = busy_with_cache(rows)
    return None if busy is None else busy >= BUSY_TARGET


# ---- reporting -------------------------------------------------------------------------------


def envelope(run: PrefixCacheRun, command: str) -> Envelope:
    return Envelope.planned(
        TITLE, command, run.plan, run.started_at, run.machine, load_after=run.load_average_after
    )


def to_json(run: PrefixCacheRun, command: str) -> dict[str, Any]:
    return envelope(run, command).json(
        {
            "dataset": asdict(run.plan.dataset()),
            "rows": [_row_json(r) for r in run.rows],
            "on_over_off": [
                {**asdict(r), "ttft_p50_times_lower": r.ttft_p50_times_lower} for r in all_ratios(run.rows)
            ],
            "targets": _targets_json(run.rows),
        }
    )


def _row_json(r: Row) -> dict[str, Any]:
    f = r.figures
    derived = {
        "prefill_tokens": f.prefill_tokens,
        "prefill_tokens_per_request": f.prefill_tokens_per_request,
        "hit_ratio": f.hit_ratio,
    }
    return {
        "name": r.configuration.name,
        "model": r.model,
        "prefix_cache": r.prefix_cache,
        "prompts": r.prompts,
        "concurrency": r.concurrency,
        "worker_args": list(r.configuration.device.worker_args),
        "scheduler_args": list(r.configuration.scheduler_args),
        "warmup_failed": r.warmup_failed,
        "figures": {**asdict(f), **derived},
    }


def _targets_json(rows: Sequence[Row]) -> dict[str, Any]:
    ttft = on_over_off(rows, TTFT_TARGET_MODEL)
    return {
        "ttft": {
            "model": TTFT_TARGET_MODEL,
            "times_lower_at_least": TTFT_TARGET_FACTOR,
            "times_lower": ttft.ttft_p50_times_lower,
            "met": ttft_target_met(rows),
        },
        "device_busy": {
            "model": BUSY_TARGET_MODEL,
            "at_least": BUSY_TARGET,
            "with_cache": busy_with_cache(rows),
            "met": busy_target_met(rows),
        },
    }


def to_markdown(run: PrefixCacheRun, command: str) -> str:
    return envelope(run, command).markdown(
        [
            *table(run.rows),
            "",
            *ratio_table(run.rows),
            "",
            *notes(run.plan, run.rows),
            *target_lines(run.rows),
            *failure_lines(run.rows),
        ]
    )


def table(rows: Sequence[Row]) -> list[str]:
    header = (
        "| model | prefix cache | concurrency | TTFT p50 ms | TTFT p99 ms | prefill tokens computed "
        "| per request | hit ratio | worker tokens | output tok/s | device busy | mean forward ms | failed |"
    )
    return [header, "|---|---|" + "---:|" * 11, *(_row(r) for r in rows)]


def _row(r: Row) -> str:
    f = r.figures
    cells = [
        r.model,
        on_off(r.prefix_cache),
        str(r.concurrency),
        number(f.ttft_p50_ms, 1),
        number(f.ttft_p99_ms, 1),
        f"{f.prefill_tokens:,}",
        number(f.prefill_tokens_per_request, 1),
        number(f.hit_ratio, 3),
        f"{f.worker_tokens:,}",
        number(f.output_tokens_per_s, 1),
        number(f.device_busy_fraction, 3),
        number(f.mean_forward_ms, 2),
        str(f.failed),
    ]
    return "| " + " | ".join(cells) + " |"


def ratio_table(rows: Sequence[Row]) -> list[str]:
    header = "| model | TTFT p50 on/off | prefill tokens on/off | output tok/s on/off | device busy on/off |"
    return [header, "|---|" + "---:|" * 4, *(_ratio_row(r) for r in all_ratios(rows))]


def _ratio_row(r: OnOverOff) -> str:
    cells = [
        r.model,
        times(r.ttft_p50),
        times(r.prefill_tokens),
        times(r.output_tokens_per_s),
        times(r.device_busy),
    ]
    return "| " + " | ".join(cells) + " |"


def notes(plan: Plan, rows: Sequence[Row]) -> list[str]:
    workers = "; ".join(f"{model} `{_worker_args(rows, model)}`" for model in models_of(rows))
    n = plan.num_prefixes
    prefixes = "one prefix" if n == 1 else f"{n} prefixes (request i takes prefix i mod {n})"
    lines = [
        f"- workload: loadgen's prefix-repetition dataset, {prefixes} of {plan.prefix_len:,} random "
        f"ids, then {plan.suffix_len} random ids of the request's own ({plan.prompt_len:,} prompt "
        f"tokens), exactly {plan.output_len} new tokens (ignore_eos), a closed loop over one gRPC "
        "connection",
        f"- each row: a fresh worker and overlap scheduler over gRPC, `--no-prefix-cache` for off; "
        f"workers: {workers}; warmup: concurrency x {plan.warmup_output_len} new tokens, the same "
        "prefixes with suffixes of their own, so the measured run starts with them cached",
        "- prefill tokens computed: the scheduler's prompt tokens minus prefix cache hit tokens over "
        "the run; hit ratio: hits over prompt tokens; worker tokens: tokens the forwards executed "
        "(prefill + decode)",
        "- TTFT and output tok/s: loadgen; device busy: the worker's forward time over busy + idle; "
        "on/off: the cache-on figure over the cache-off one of the same model",
    ]
    if "tiny" in models_of(rows):
        lines.append(
            "- tiny computes on the CPUs that the scheduler, its frontend and the load generator share"
        )
    return lines


def _worker_args(rows: Sequence[Row], model: str) -> str:
    row = next(r for r in rows if r.model == model)
    return " ".join(row.configuration.device.worker_args)


def target_lines(rows: Sequence[Row]) -> Iterator[str]:
    times_lower, met = on_over_off(rows, TTFT_TARGET_MODEL).ttft_p50_times_lower, ttft_target_met(rows)
    yield (
        f"- target: TTFT p50 at least {TTFT_TARGET_FACTOR:g}x lower with the cache on "
        f"{TTFT_TARGET_MODEL}: {_lower(times_lower)}, {_verdict(met)}"
    )
    concurrency = next((r.concurrency for r in rows if r.model == BUSY_TARGET_MODEL), None)
    at = "" if concurrency is None else f" at concurrency {concurrency}"
    yield (
        f"- target: device busy >= {BUSY_TARGET} with the cache on {BUSY_TARGET_MODEL}{at}: "
        f"{number(busy_with_cache(rows), 3)}, {_verdict(busy_target_met(rows))}"
    )


def failure_lines(rows: Sequence[Row]) -> Iterator[str]:
    """Figures cover completed requests only: a row with failures is flagged."""
    for r in rows:
        f = r.figures
        if f.failed or r.warmup_failed:
            yield (
                f"- **{f.failed} of {f.failed + f.completed} requests failed** ({r.warmup_failed} "
                f"of the warmup's) on {r.model} with the prefix cache {on_off(r.prefix_cache)}"
            )


def _verdict(met: bool | None) -> str:
    return "not measured" if met is None else ("met" if met else "not met")


def _lower(value: float | None) -> str:
    return NONE if value is None else f"{value:.1f}x lower"


# ---- command line ----------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.prefix_cache", description=__doc__)
    p.add_argument(
        "--quick", action="store_true", help=f"a smoke run: {describe(QUICK)} (default: {describe(FULL)})"
    )
    p.add_argument("--out", type=Path, default=RESULTS, help="results directory (default: bench/results)")
    return p.parse_args(argv)


def describe(plan: Plan) -> str:
    return ", ".join(
        f"{m.device.name} {m.prompts} requests at concurrency {m.concurrency}" for m in plan.models
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    command = command_line("bench.prefix_cache", argv)
    run = run_plan(QUICK if args.quick else FULL)
    publish(NAME, run.started_at, to_json(run, command), to_markdown(run, command), args.out)


if __name__ == "__main__":
    main()
