"""python -m bench.replicas [--quick] [--out DIR]: one worker + scheduler pair against two
(replicas) serving the same `sim` device, side by side, the load generator balancing over the two
with gRPC's round_robin policy; throughput and the two-over-one ratio.

Each replica count gets fresh pairs (a worker and an overlap scheduler over gRPC, each scheduler
with its default frontend), whose points run lowest concurrency first. A point is a closed loop
keeping `per replica x replicas` requests in flight: 64 vs 128 in all, and 128 vs 256, over four
loadgen channels (`--server A,B`: each channel connects to each scheduler and sends its calls round
robin over them).
Before each, a warmup (the total concurrency x 8 tokens; it also lets the channel connect to every
replica), then the measured run between two scrapes of every /metrics endpoint, each taken once no
request is live (`bench.run.settle`). Writes bench/results/<UTC date-time>-replicas.{json,md} and
prints the tables.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.cells import NONE, number, times
from bench.configs import Configuration, Workload, sim, waves
from bench.envelope import Envelope, begin
from bench.figures import BUSY, CPU, IDLE, busy_fraction, ratio
from bench.frontends import BOX_BOUND, FRONTEND_CPU, GENERATED
from bench.machine import Machine, load_average
from bench.promtext import Samples, delta, scrape, total
from bench.run import Endpoints, run_loadgen, serving, settle
from bench.save import RESULTS, command_line, publish
from loadgen import BenchmarkConfig, Summary

NAME = "replicas"
TITLE = "Replicas: one scheduler + worker pair vs two"
FINISHED = "stepahead_requests_finished_total"
TARGET_PER_REPLICA, TARGET_RATIO = 64, 1.8  # two replicas at least 1.8x one, at 64 per replica

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Plan:
    """Every per-replica concurrency at every replica count: `waves` x concurrency requests of
    exactly `input_len` prompt and `output_len` new tokens (ignore_eos)."""

    name: str
    waves: int
    replica_counts: tuple[int, ...] = (1, 2)
    per_replica: tuple[int, ...] = (64, 128)
    step_ms: float = 10.0
    input_len: int = 16
    output_len: int = 128
    # loadgen channels, each connected to every replica: several, so that no single connection
    # carries every stream of a scheduler (at 128 per replica one connection held 1 replica back)
    connections: int = 4

    def workload(self, concurrency: int) -> Workload:
        return waves(self.waves, concurrency, self.input_len, self.output_len, 0.0)


FULL = Plan("full", waves=16)
QUICK = Plan("quick", waves=2)


# ---- measuring -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Measured:
    """One measured run over every replica: loadgen's summary and each process's scrape deltas."""

    summary: Summary
    schedulers: tuple[Samples, ...]  # by replica
    workers: tuple[Samples, ...]
    client_cpu_s: float  # CPU time of this process (the load generator) during the run


def servers(endpoints: Sequence[Endpoints]) -> str:
    """loadgen's --server: every replica's scheduler, comma-separated."""
    return ",".join(e.address for e in endpoints)


def loadgen_config(
    endpoints: Sequence[Endpoints], plan: Plan, workload: Workload, warmup: bool
) -> BenchmarkConfig:
    return BenchmarkConfig(
        server=servers(endpoints),
        dataset=workload.warmup_dataset if warmup else workload.dataset,
        num_prompts=workload.warmup_prompts if warmup else workload.num_prompts,
        max_concurrency=workload.concurrency,
        connections=plan.connections,
        seed=workload.seed + 1 if warmup else workload.seed,
        ignore_eos=True,
    )


def scrape_all(endpoints: Sequence[Endpoints]) -> list[tuple[Samples, Samples]]:
    """(scheduler, worker) samples of every replica, once none holds a request."""
    for e in endpoints:
        settle(e)
    return [(scrape(e.scheduler_metrics), scrape(e.worker_metrics)) for e in endpoints]


def measure(endpoints: Sequence[Endpoints], plan: Plan, workload: Workload) -> Measured:
    run_loadgen(loadgen_config(endpoints, plan, workload, warmup=True))
    before = scrape_all(endpoints)
    cpu_before = time.process_time()
    summary = run_loadgen(loadgen_config(endpoints, plan, workload, warmup=False))
    client_cpu_s = time.process_time() - cpu_before
    after = scrape_all(endpoints)
    return Measured(
        summary,
        tuple(delta(b[0], a[0]) for b, a in zip(before, after, strict=True)),
        tuple(delta(b[1], a[1]) for b, a in zip(before, after, strict=True)),
        client_cpu_s,
    )


# ---- figures ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplicaFigures:
    output_tokens_per_s: float
    ideal_tokens_per_s: float  # every replica's device yielding one token per request per step
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    request_shares: tuple[float, ...]  # each replica's part of the requests ended, by replica
    device_busy: tuple[float | None, ...]  # each replica's worker: busy / (busy + idle)
    generated_tokens: int  # Δ stepahead_generation_tokens_total over the schedulers
    scheduler_cpu_s: float  # every scheduler: engine core and frontend processes
    worker_cpu_s: float  # every worker
    loadgen_cpu_s: float  # the bench process
    cpus: int
    completed: int
    failed: int
    duration_s: float

    @property
    def fraction_of_ideal(self) -> float | None:
        return ratio(self.output_tokens_per_s, self.ideal_tokens_per_s)

    def us_per_token(self, cpu_s: float) -> float | None:
        return ratio(cpu_s * 1e6, self.generated_tokens)

    @property
    def cpus_used(self) -> float | None:
        """CPU seconds of every process per wall second of the run."""
        spent = self.scheduler_cpu_s + self.worker_cpu_s + self.loadgen_cpu_s
        return ratio(spent, self.duration_s)

    @property
    def box_bound(self) -> bool:
        return self.cpus_used is not None and self.cpus_used >= BOX_BOUND * self.cpus

    @property
    def cpus_by_side(self) -> tuple[float | None, float | None, float | None]:
        """CPUs the schedulers, the workers and loadgen each kept busy: what bounds a run."""
        wall_s = self.duration_s
        return (
            ratio(self.scheduler_cpu_s, wall_s),
            ratio(self.worker_cpu_s, wall_s),
            ratio(self.loadgen_cpu_s, wall_s),
        )


def shares(counts: Sequence[float]) -> tuple[float, ...]:
    spent = sum(counts)
    return tuple(c / spent for c in counts) if spent > 0 else ()


def replica_figures(measured: Measured, ideal_tokens_per_s: float) -> ReplicaFigures:
    s, schedulers, workers = measured.summary, measured.schedulers, measured.workers
    return ReplicaFigures(
        output_tokens_per_s=s.output_throughput,
        ideal_tokens_per_s=ideal_tokens_per_s,
        ttft_p50_ms=s.ttft.median,
        ttft_p99_ms=s.ttft.p99,
        itl_p50_ms=s.itl.median,
        request_shares=shares([total(samples, FINISHED) for samples in schedulers]),
        device_busy=tuple(busy_fraction(total(w, BUSY), total(w, IDLE)) for w in workers),
        generated_tokens=round(sum(total(samples, GENERATED) for samples in schedulers)),
        scheduler_cpu_s=sum(total(samples, CPU) + total(samples, FRONTEND_CPU) for samples in schedulers),
        worker_cpu_s=sum(total(w, CPU) for w in workers),
        loadgen_cpu_s=measured.client_cpu_s,
        cpus=os.cpu_count() or 1,
        completed=s.completed,
        failed=s.failed,
        duration_s=s.duration_s,
    )


# ---- running ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Point:
    replicas: int
    per_replica: int  # requests in flight per replica
    workload: Workload
    figures: ReplicaFigures

    @property
    def concurrency(self) -> int:
        return self.replicas * self.per_replica


@dataclass(frozen=True)
class ReplicasRun:
    plan: Plan
    configuration: Configuration  # what each replica runs
    started_at: datetime  # UTC
    machine: Machine
    load_average_after: float
    points: tuple[Point, ...]  # by replica count, then concurrency


def to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_plan(plan: Plan, progress: Progress = to_stderr) -> ReplicasRun:
    started_at, machine = begin()
    configuration = Configuration(sim(plan.step_ms), "overlap", "grpc")
    points = [
        point for count in plan.replica_counts for point in run_replicas(plan, configuration, count, progress)
    ]
    return ReplicasRun(plan, configuration, started_at, machine, load_average(), tuple(points))


def run_replicas(plan: Plan, configuration: Configuration, count: int, progress: Progress) -> list[Point]:
    """`count` fresh pairs for every per-replica concurrency, lowest first."""
    with ExitStack() as stack:
        endpoints = [stack.enter_context(serving(configuration)) for _ in range(count)]
        return [run_point(plan, configuration, endpoints, c, progress) for c in sorted(plan.per_replica)]


def run_point(
    plan: Plan,
    configuration: Configuration,
    endpoints: Sequence[Endpoints],
    per_replica: int,
    progress: Progress,
) -> Point:
    workload = plan.workload(per_replica * len(endpoints))
    ideal = configuration.device.ideal_tokens_per_s(workload.concurrency) or 0.0
    point = Point(
        len(endpoints), per_replica, workload, replica_figures(measure(endpoints, plan, workload), ideal)
    )
    progress(progress_line(point))
    return point


def progress_line(p: Point) -> str:
    f = p.figures
    return (
        f"{p.replicas} replica(s), {p.per_replica} per replica ({p.concurrency} in all): "
        f"{f.output_tokens_per_s:8,.0f} tok/s, split {split(f.request_shares)}, "
        f"CPUs used {number(f.cpus_used, 2)}, {f.failed} failed"
    )


# ---- ratios and target -----------------------------------------------------------------------


@dataclass(frozen=True)
class Scaling:
    """The most replicas' tok/s over one replica's, at the same concurrency per replica."""

    per_replica: int
    replicas: int
    one: float | None
    many: float | None

    @property
    def ratio(self) -> float | None:
        return ratio(self.many, self.one)


def find(points: Sequence[Point], replicas: int, per_replica: int) -> Point | None:
    return next((p for p in points if (p.replicas, p.per_replica) == (replicas, per_replica)), None)


def scaling(points: Sequence[Point]) -> list[Scaling]:
    most = max((p.replicas for p in points), default=1)
    rows = []
    for per_replica in sorted({p.per_replica for p in points}):
        one = find(points, 1, per_replica)
        many = find(points, most, per_replica) if most > 1 else None
        rows.append(Scaling(per_replica, most, _tok_s(one), _tok_s(many)))
    return rows


def _tok_s(point: Point | None) -> float | None:
    return None if point is None else point.figures.output_tokens_per_s


def target_ratio(points: Sequence[Point]) -> float | None:
    return next((s.ratio for s in scaling(points) if s.per_replica == TARGET_PER_REPLICA), None)


def target_met(points: Sequence[Point]) -> bool | None:
    measured = target_ratio(points)
    return None if measured is None else measured >= TARGET_RATIO


# ---- reporting -------------------------------------------------------------------------------


def envelope(run: ReplicasRun, command: str) -> Envelope:
    return Envelope.planned(
        TITLE, command, run.plan, run.started_at, run.machine, ("python", "grpcio"), run.load_average_after
    )


def to_json(run: ReplicasRun, command: str) -> dict[str, Any]:
    return envelope(run, command).json(
        {
            "worker_args": list(run.configuration.device.worker_args),
            "scheduler_args": list(run.configuration.scheduler_args),
            "points": [_point_json(p) for p in run.points],
            "scaling": [{**asdict(s), "ratio": s.ratio} for s in scaling(run.points)],
            "target": {
                "per_replica": TARGET_PER_REPLICA,
                "ratio_at_least": TARGET_RATIO,
                "ratio": target_ratio(run.points),
                "met": target_met(run.points),
            },
        }
    )


def _point_json(p: Point) -> dict[str, Any]:
    f = p.figures
    derived = {
        "fraction_of_ideal": f.fraction_of_ideal,
        "scheduler_us_per_token": f.us_per_token(f.scheduler_cpu_s),
        "worker_us_per_token": f.us_per_token(f.worker_cpu_s),
        "loadgen_us_per_token": f.us_per_token(f.loadgen_cpu_s),
        "cpus_used": f.cpus_used,
        "cpus_by_side": dict(zip(("schedulers", "workers", "loadgen"), f.cpus_by_side, strict=True)),
        "box_bound": f.box_bound,
    }
    return {
        "replicas": p.replicas,
        "per_replica": p.per_replica,
        "concurrency": p.concurrency,
        "workload": asdict(p.workload),
        "figures": {**asdict(f), **derived},
    }


def to_markdown(run: ReplicasRun, command: str) -> str:
    return envelope(run, command).markdown(
        [
            *table(run.points),
            "",
            *scaling_table(run.points),
            "",
            *notes(run),
            *target_lines(run.points),
            *failure_lines(run.points),
        ]
    )


def table(points: Sequence[Point]) -> list[str]:
    cpus = points[0].figures.cpus if points else os.cpu_count()
    header = (
        "| replicas | per replica | concurrency | output tok/s | of ideal | TTFT p50 / p99 ms | ITL p50 ms "
        "| request split | device busy | scheduler µs/tok | worker µs/tok | loadgen µs/tok "
        f"| CPUs used (of {cpus}) | schedulers / workers / loadgen CPUs |"
    )
    return [header, "|" + "---:|" * 7 + "---|---|" + "---:|" * 5, *(_row(p) for p in points)]


def _row(p: Point) -> str:
    f = p.figures
    cells = [
        str(p.replicas),
        str(p.per_replica),
        str(p.concurrency),
        number(f.output_tokens_per_s, 0),
        number(f.fraction_of_ideal, 3),
        f"{number(f.ttft_p50_ms, 1)} / {number(f.ttft_p99_ms, 1)}",
        number(f.itl_p50_ms, 1),
        split(f.request_shares),
        " / ".join(number(busy, 3) for busy in f.device_busy) or NONE,
        number(f.us_per_token(f.scheduler_cpu_s), 1),
        number(f.us_per_token(f.worker_cpu_s), 1),
        number(f.us_per_token(f.loadgen_cpu_s), 1),
        number(f.cpus_used, 2) + (" †" if f.box_bound else ""),
        " / ".join(number(side, 2) for side in f.cpus_by_side),
    ]
    return "| " + " | ".join(cells) + " |"


def split(request_shares: Sequence[float]) -> str:
    return " / ".join(f"{share:.0%}" for share in request_shares) if request_shares else NONE


def scaling_table(points: Sequence[Point]) -> list[str]:
    rows = scaling(points)
    most = rows[0].replicas if rows else 2
    header = f"| per replica | 1 replica tok/s | {most} replicas tok/s | {most} / 1 |"
    body = [
        f"| {s.per_replica} | {number(s.one, 0)} | {number(s.many, 0)} | {times(s.ratio)} |" for s in rows
    ]
    return [header, "|---:|---:|---:|---:|", *body]


def notes(run: ReplicasRun) -> list[str]:
    p = run.plan
    return [
        f"- each point: {p.waves} x concurrency requests, {p.input_len}-token prompts, exactly "
        f"{p.output_len} new tokens (ignore_eos), a closed loop over {p.connections} loadgen channel(s) "
        "balancing round robin over every replica; warmup: concurrency x 8 tokens; ideal = "
        f"concurrency x 1000 / {p.step_ms:g} ms",
        f"- each replica: `{' '.join(run.configuration.device.worker_args)}` and a scheduler "
        f"`{' '.join(run.configuration.scheduler_args)}` (one frontend), fresh for each replica count",
        "- request split: each scheduler's Δ stepahead_requests_finished_total; device busy: each "
        "replica's worker; µs/tok: CPU time per token streamed to clients, every scheduler (core + "
        "frontend) together, every worker together, and the bench process (loadgen)",
        f"- CPUs used: CPU seconds of every process per wall second; † at {BOX_BOUND:.0%} of the "
        "machine's CPUs or more: the machine is the bound; then split by side (every scheduler's "
        "core and frontend, every worker, the load generator)",
    ]


def target_lines(points: Sequence[Point]) -> Iterator[str]:
    yield (
        f"- target: two replicas at least {TARGET_RATIO:g}x one at {TARGET_PER_REPLICA} per replica: "
        f"{times(target_ratio(points))}, {_verdict(target_met(points))}"
    )


def failure_lines(points: Sequence[Point]) -> Iterator[str]:
    """Figures cover completed requests only: a point with failures is flagged."""
    for p in points:
        if p.figures.failed:
            yield (
                f"- **{p.figures.failed} of {p.figures.failed + p.figures.completed} requests failed** "
                f"with {p.replicas} replica(s) at {p.per_replica} per replica"
            )


def _verdict(met: bool | None) -> str:
    return "not measured" if met is None else ("met" if met else "not met")


# ---- command line ----------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.replicas", description=__doc__)
    p.add_argument(
        "--quick", action="store_true", help=f"{QUICK.waves} waves per point instead of {FULL.waves}"
    )
    p.add_argument("--out", type=Path, default=RESULTS, help="results directory (default: bench/results)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    command = command_line("bench.replicas", argv)
    run = run_plan(QUICK if args.quick else FULL)
    publish(NAME, run.started_at, to_json(run, command), to_markdown(run, command), args.out)


if __name__ == "__main__":
    main()
