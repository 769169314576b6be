"""Run a plan: every case on fresh processes, then the concurrency sweep."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from bench.configs import MODES, Case, Configuration, Plan, Sweep
from bench.envelope import begin
from bench.figures import Figures, figures
from bench.machine import Machine, load_average
from bench.run import measure, serving

Progress = Callable[[str], None]


@dataclass(frozen=True)
class CaseResult:
    case: Case
    figures: Figures


@dataclass(frozen=True)
class RunResult:
    plan: Plan
    started_at: datetime  # UTC
    machine: Machine  # described before the first configuration starts
    load_average_after: float  # the 1-minute load average when the run ended
    cases: tuple[CaseResult, ...]
    sweep: tuple[CaseResult, ...]  # by mode, then by concurrency
    arrivals: tuple[CaseResult, ...] = ()


def to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_plan(plan: Plan, progress: Progress = to_stderr) -> RunResult:
    started_at, machine = begin()
    cases = tuple(run_case(case, progress) for case in plan.cases)
    sweep = () if plan.sweep is None else run_sweep(plan.sweep, progress)
    arrivals = tuple(run_case(case, progress) for case in plan.arrivals)
    return RunResult(plan, started_at, machine, load_average(), cases, sweep, arrivals)


def run_case(case: Case, progress: Progress) -> CaseResult:
    with serving(case.configuration) as endpoints:
        result = CaseResult(case, figures(case, measure(endpoints, case.workload)))
    progress(_progress_line(result))
    return result


def run_sweep(sweep: Sweep, progress: Progress) -> tuple[CaseResult, ...]:
    points = []
    for mode in MODES:
        configuration = Configuration(sweep.device, mode, "grpc")
        with serving(configuration) as endpoints:
            for concurrency in sweep.concurrencies:
                case = Case(configuration, sweep.workload(concurrency))
                points.append(CaseResult(case, figures(case, measure(endpoints, case.workload))))
                progress(_progress_line(points[-1]))
    return tuple(points)


def _progress_line(result: CaseResult) -> str:
    f, busy = result.figures, result.figures.device_busy_fraction
    return (
        f"{result.case.configuration.name:<36} concurrency {result.case.workload.concurrency:>3}: "
        f"{f.output_tokens_per_s:8,.0f} tok/s, device busy {'-' if busy is None else f'{busy:.3f}'}, "
        f"{f.completed} done, {f.failed} failed"
    )
