"""The figures of one measured run, from loadgen's summary and the metric deltas."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from bench.configs import Case
from bench.promtext import Samples, histogram_buckets, histogram_quantile, total
from bench.run import Measurement

STEP_PHASE = "stepahead_step_phase_seconds"
PHASES = ("pick", "launch", "wait", "process")
CPU = "process_cpu_seconds_total"
BUSY = "stepahead_device_busy_seconds_total"
IDLE = "stepahead_device_idle_seconds_total"
GAP = "stepahead_device_gap_seconds"


@dataclass(frozen=True)
class Figures:
    output_tokens_per_s: float
    ideal_tokens_per_s: float | None  # the sim's bound; None for a real model
    fraction_of_ideal: float | None
    device_busy_fraction: float | None  # None when the worker saw neither busy nor idle time
    median_device_gap_ms: float | None  # None when the worker recorded no gap
    mean_device_gap_ms: float | None
    mean_forward_ms: float | None  # device time per executed batch (the sim: its step plus batch building)
    step_ms: float | None  # wall time per launched step: forward + gap, on average
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    scheduler_cpu_ms_per_step: float | None  # includes the worker engine's threads when in-process
    worker_cpu_ms_per_step: float | None  # None when the worker runs in the scheduler's process
    client_cpu_ms_per_step: float | None  # the load generator, in the bench process
    scheduler_phase_ms: Mapping[str, float | None]  # mean wall time per step in each loop phase
    steps: int  # batches launched during the measured run
    tokens_per_step: float | None  # output tokens / steps: how full the batches were
    completed: int
    failed: int
    output_tokens: int
    duration_s: float


def busy_fraction(busy_s: float, idle_s: float) -> float | None:
    spent = busy_s + idle_s
    return busy_s / spent if spent > 0 else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator; None when either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def launched_steps(scheduler: Samples) -> int:
    return round(total(scheduler, f"{STEP_PHASE}_count", phase="launch"))


def median_gap_ms(worker: Samples) -> float | None:
    gap_s = histogram_quantile(0.5, histogram_buckets(worker, GAP))
    return None if gap_s is None else gap_s * 1e3


def mean_gap_ms(worker: Samples) -> float | None:
    return ratio(total(worker, f"{GAP}_sum") * 1e3, total(worker, f"{GAP}_count"))


def mean_forward_ms(worker: Samples) -> float | None:
    return ratio(total(worker, BUSY) * 1e3, total(worker, "stepahead_batches_total"))


def phase_ms_per_step(scheduler: Samples, steps: int) -> dict[str, float | None]:
    return {phase: per_step_ms(total(scheduler, f"{STEP_PHASE}_sum", phase=phase), steps) for phase in PHASES}


def per_step_ms(seconds: float, steps: int) -> float | None:
    return ratio(seconds * 1e3, steps)


def figures(case: Case, measured: Measurement) -> Figures:
    summary, steps = measured.summary, launched_steps(measured.scheduler)
    # The sim's bound assumes full batches: a closed loop at that concurrency.
    closed = case.workload.closed_loop
    ideal = case.configuration.device.ideal_tokens_per_s(case.workload.concurrency) if closed else None
    worker_cpu = (
        None if case.configuration.shares_process else per_step_ms(total(measured.worker, CPU), steps)
    )
    return Figures(
        output_tokens_per_s=summary.output_throughput,
        ideal_tokens_per_s=ideal,
        fraction_of_ideal=ratio(summary.output_throughput, ideal),
        device_busy_fraction=busy_fraction(total(measured.worker, BUSY), total(measured.worker, IDLE)),
        median_device_gap_ms=median_gap_ms(measured.worker),
        mean_device_gap_ms=mean_gap_ms(measured.worker),
        mean_forward_ms=mean_forward_ms(measured.worker),
        step_ms=per_step_ms(summary.duration_s, steps),
        ttft_p50_ms=summary.ttft.median,
        ttft_p99_ms=summary.ttft.p99,
        itl_p50_ms=summary.itl.median,
        itl_p99_ms=summary.itl.p99,
        scheduler_cpu_ms_per_step=per_step_ms(total(measured.scheduler, CPU), steps),
        worker_cpu_ms_per_step=worker_cpu,
        client_cpu_ms_per_step=per_step_ms(measured.client_cpu_s, steps),
        scheduler_phase_ms=phase_ms_per_step(measured.scheduler, steps),
        steps=steps,
        tokens_per_step=ratio(summary.total_output_tokens, steps),
        completed=summary.completed,
        failed=summary.failed,
        output_tokens=summary.total_output_tokens,
        duration_s=summary.duration_s,
    )
