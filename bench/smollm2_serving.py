"""python -m bench.smollm2_serving [--quick] [--out DIR]: SmolLM2-135M-Instruct (`--model
smollm2`) on the CPU through the services, serial and overlap side by side, at 1 and 2 worker
torch threads; output tok/s, time to first token, time per output token and how busy the model
kept the worker's device, and what overlap buys over serial at each thread count and concurrency.

Each (threads, mode) gets a fresh worker and scheduler over gRPC, whose points run lowest
concurrency first, each after a warmup and between two scrapes of both /metrics endpoints
(`bench.run.measure`): a closed loop of requests with exactly `input_len` prompt tokens (random
ids) and `output_len` new tokens (ignore_eos). The worker's threads share the machine's cores
with the scheduler's processes and the load generator. Writes
bench/results/<UTC date-time>-smollm2-serving.{json,md} and prints the table.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.cells import number, times
from bench.configs import MODES, Case, Configuration, Device, Mode, Workload
from bench.envelope import Envelope, begin
from bench.figures import Figures, figures, ratio
from bench.machine import Machine, load_average
from bench.run import Endpoints, Measurement, measure, serving
from bench.save import RESULTS, command_line, publish

NAME = "smollm2-serving"
TITLE = "Stepahead smollm2 serving benchmark"
THREAD_COUNTS = (1, 2)
KV_SLOTS = 4096  # tokens: 16 requests of 128 fit eight times over

Progress = Callable[[str], None]


def smollm2(threads: int) -> Device:
    args = ("--model", "smollm2", "--threads", str(threads), "--kv-slots", str(KV_SLOTS))
    return Device("smollm2", args)


@dataclass(frozen=True)
class Point:
    concurrency: int
    prompts: int  # requests in the measured run


@dataclass(frozen=True)
class Smollm2Plan:
    """Every point at every thread count in both modes."""

    name: str
    points: tuple[Point, ...]
    output_len: int
    input_len: int = 64
    thread_counts: tuple[int, ...] = THREAD_COUNTS
    modes: tuple[Mode, ...] = MODES

    def workload(self, point: Point) -> Workload:
        return Workload(
            point.prompts, point.concurrency, self.input_len, self.output_len, 0.0, point.concurrency
        )


FULL = Smollm2Plan("full", (Point(1, 6), Point(16, 48)), output_len=64)
QUICK = Smollm2Plan("quick", (Point(1, 2), Point(16, 16)), output_len=16)


# ---- results ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class PointResult:
    threads: int
    case: Case
    figures: Figures  # bench.figures: throughput, device, latency
    tpot_p50_ms: float  # loadgen's time per output token after the first, median over requests

    @property
    def mode(self) -> Mode:
        return self.case.configuration.mode

    @property
    def concurrency(self) -> int:
        return self.case.workload.concurrency

    @property
    def key(self) -> tuple[int, int, int]:
        """(threads, concurrency, mode): the table's order, serial before overlap."""
        return (self.threads, self.concurrency, MODES.index(self.mode))


@dataclass(frozen=True)
class Ratios:
    """Overlap over serial at one (threads, concurrency); None where a side is missing."""

    threads: int
    concurrency: int
    tokens_per_s: float | None
    ttft_p50: float | None


def point_result(threads: int, case: Case, measured: Measurement) -> PointResult:
    return PointResult(threads, case, figures(case, measured), measured.summary.tpot.median)


def find(results: Sequence[PointResult], threads: int, concurrency: int, mode: Mode) -> PointResult | None:
    wanted = (threads, concurrency, MODES.index(mode))
    return next((r for r in results if r.key == wanted), None)


def overlap_over_serial(results: Sequence[PointResult], threads: int, concurrency: int) -> Ratios:
    serial = find(results, threads, concurrency, "serial")
    overlap = find(results, threads, concurrency, "overlap")
    if serial is None or overlap is None:
        return Ratios(threads, concurrency, None, None)
    s, o = serial.figures, overlap.figures
    return Ratios(
        threads,
        concurrency,
        ratio(o.output_tokens_per_s, s.output_tokens_per_s),
        ratio(o.ttft_p50_ms, s.ttft_p50_ms),
    )


def all_ratios(results: Sequence[PointResult]) -> list[Ratios]:
    pairs = dict.fromkeys((r.threads, r.concurrency) for r in sorted(results, key=lambda r: r.key))
    return [overlap_over_serial(results, threads, concurrency) for threads, concurrency in pairs]


def best_threads(results: Sequence[PointResult]) -> dict[int, PointResult]:
    """The overlap row with the most output tok/s at each concurrency (the fewer threads on a tie)."""
    best: dict[int, PointResult] = {}
    for r in sorted((r for r in results if r.mode == "overlap"), key=lambda r: r.key):
        held = best.get(r.concurrency)
        if held is None or r.figures.output_tokens_per_s > held.figures.output_tokens_per_s:
            best[r.concurrency] = r
    return dict(sorted(best.items()))


# ---- running ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Smollm2Run:
    plan: Smollm2Plan
    started_at: datetime  # UTC
    machine: Machine
    load_average_after: float
    results: tuple[PointResult, ...]  # by threads, concurrency, mode


def to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_plan(plan: Smollm2Plan, progress: Progress = to_stderr) -> Smollm2Run:
    started_at, machine = begin()
    results = [
        result
        for threads in plan.thread_counts
        for mode in plan.modes
        for result in run_pair(plan, threads, Configuration(smollm2(threads), mode, "grpc"), progress)
    ]
    ordered = tuple(sorted(results, key=lambda r: r.key))
    return Smollm2Run(plan, started_at, machine, load_average(), ordered)


def run_pair(
    plan: Smollm2Plan, threads: int, configuration: Configuration, progress: Progress
) -> list[PointResult]:
    """One worker and scheduler for every point, lowest concurrency first."""
    points = sorted(plan.points, key=lambda p: p.concurrency)
    with serving(configuration) as endpoints:
        return [run_point(plan, threads, configuration, endpoints, p, progress) for p in points]


def run_point(
    plan: Smollm2Plan,
    threads: int,
    configuration: Configuration,
    endpoints: Endpoints,
    point: Point,
    progress: Progress,
) -> PointResult:
    case = Case(configuration, plan.workload(point))
    result = point_result(threads, case, measure(endpoints, case.workload))
    progress(progress_line(result))
    return result


def progress_line(r: PointResult) -> str:
    f = r.figures
    return (
        f"threads {r.threads}, {r.mode:>7}, concurrency {r.concurrency:>2}: "
        f"{f.output_tokens_per_s:7,.1f} tok/s, TTFT p50 {f.ttft_p50_ms:,.0f} ms, "
        f"TPOT p50 {r.tpot_p50_ms:,.1f} ms, {f.failed} failed"
    )


# ---- reporting -------------------------------------------------------------------------------


def envelope(run: Smollm2Run, command: str) -> Envelope:
    return Envelope.planned(
        TITLE, command, run.plan, run.started_at, run.machine, load_after=run.load_average_after
    )


def to_json(run: Smollm2Run, command: str) -> dict[str, Any]:
    return envelope(run, command).json(
        {
            "points": [_point_json(r) for r in run.results],
            "overlap_over_serial": [asdict(r) for r in all_ratios(run.results)],
            "best_overlap_threads": {str(c): r.threads for c, r in best_threads(run.results).items()},
        }
    )


def _point_json(r: PointResult) -> dict[str, Any]:
    w = r.case.workload
    return {
        "name": r.case.configuration.name,
        "threads": r.threads,
        "mode": r.mode,
        "concurrency": r.concurrency,
        "worker_args": list(r.case.configuration.device.worker_args),
        "scheduler_args": list(r.case.configuration.scheduler_args),
        "workload": {**asdict(w), "input_bounds": w.input_bounds, "output_bounds": w.output_bounds},
        "figures": asdict(r.figures),
        "tpot_p50_ms": r.tpot_p50_ms,
    }


def to_markdown(run: Smollm2Run, command: str) -> str:
    return envelope(run, command).markdown(
        [
            *table(run.results),
            "",
            *notes(run.plan),
            *best_lines(run.results),
            *failure_lines(run.results),
        ]
    )


def table(results: Sequence[PointResult]) -> list[str]:
    header = (
        "| threads | mode | concurrency | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms "
        "| ITL p50 ms | device busy | overlap/serial tok/s | overlap/serial TTFT p50 |"
    )
    ratios = {(r.threads, r.concurrency): r for r in all_ratios(results)}
    rows = (_row(r, ratios[r.threads, r.concurrency]) for r in sorted(results, key=lambda r: r.key))
    return [header, "|---:|---|" + "---:|" * 9, *rows]


def _row(r: PointResult, ratios: Ratios) -> str:
    f, overlap = r.figures, r.mode == "overlap"
    cells = [
        str(r.threads),
        r.mode,
        str(r.concurrency),
        number(f.output_tokens_per_s, 1),
        number(f.ttft_p50_ms, 0),
        number(f.ttft_p99_ms, 0),
        number(r.tpot_p50_ms, 1),
        number(f.itl_p50_ms, 1),
        number(f.device_busy_fraction, 3),
        times(ratios.tokens_per_s, 2) if overlap else "",
        times(ratios.ttft_p50, 2) if overlap else "",
    ]
    return "| " + " | ".join(cells) + " |"


def notes(plan: Smollm2Plan) -> list[str]:
    points = ", ".join(f"{p.prompts} requests at concurrency {p.concurrency}" for p in plan.points)
    return [
        f"- each (threads, mode): a fresh worker (`--model smollm2 --threads N --kv-slots {KV_SLOTS}`, "
        f"float32 on the CPU) and scheduler over gRPC; points: {points}; {plan.input_len}-token prompts "
        f"(random ids), exactly {plan.output_len} new tokens (ignore_eos), a closed loop; warmup: "
        "concurrency x 8 tokens",
        "- TTFT: time to first token; TPOT: time per output token after the first, per request; ITL: "
        "time between streamed tokens; device busy: the worker's forward time over its busy + idle time",
        "- overlap/serial: overlap's figure over serial's at the same threads and concurrency (tok/s "
        "above 1 and TTFT below 1 favour overlap)",
    ]


def best_lines(results: Sequence[PointResult]) -> Iterator[str]:
    for concurrency, best in best_threads(results).items():
        others = [
            f"{number(r.figures.output_tokens_per_s, 1)} with {r.threads}"
            for r in results
            if r.mode == "overlap" and r.concurrency == concurrency and r.threads != best.threads
        ]
        against = f" (vs {', '.join(others)})" if others else ""
        threads = f"{best.threads} thread{'' if best.threads == 1 else 's'}"
        tokens_per_s = number(best.figures.output_tokens_per_s, 1)
        yield f"- best overlap tok/s at concurrency {concurrency}: {threads}, {tokens_per_s} tok/s{against}"


def failure_lines(results: Sequence[PointResult]) -> Iterator[str]:
    """Figures cover completed requests only: a point with failures is flagged."""
    for r in results:
        if r.figures.failed:
            yield ""
            yield (
                f"**{r.figures.failed} of {r.figures.failed + r.figures.completed} requests failed** at "
                f"threads {r.threads}, {r.mode}, concurrency {r.concurrency}."
            )


# ---- command line ----------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.smollm2_serving", description=__doc__)
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"a smoke run: {_describe(QUICK.points)}, {QUICK.output_len} new tokens "
        f"(default: {_describe(FULL.points)}, {FULL.output_len})",
    )
    p.add_argument("--out", type=Path, default=RESULTS, help="results directory (default: bench/results)")
    return p.parse_args(argv)


def _describe(points: Sequence[Point]) -> str:
    return " and ".join(f"{p.prompts} requests at concurrency {p.concurrency}" for p in points)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    command = command_line("bench.smollm2_serving", argv)
    run = run_plan(QUICK if args.quick else FULL)
    publish(NAME, run.started_at, to_json(run, command), to_markdown(run, command), args.out)


if __name__ == "__main__":
    main()
