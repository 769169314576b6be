"""python -m bench.frontends [--quick] [--baseline REF]: the scheduler with 0, 1 and 2 frontend
processes, side by side, on the `sim` device in overlap mode under closed-loop decode load; where
the CPU goes per generated token, how many messages the frontends stream, and whether the
machine's cores are the bound. With `--baseline REF`, the same points are run on the code of
commit REF too (a git worktree of it, `bench.baseline`), in turns with this checkout's, and the
report gives each figure's ratio to the baseline's.

Each (step time, frontend count, code) gets a fresh worker and scheduler, whose points run lowest
concurrency first, each after a warmup and between two scrapes of both /metrics endpoints
(`bench.run.measure`), over 1 and over 8 client connections (loadgen's `connections`; one
connection reaches one frontend process); `--client grpc-many` sends a connection's requests on
one GenerateMany call instead of a Generate call each (a baseline without it uses Generate). The
machine's speed is printed as the time of a pure Python loop (`bench.machine.loop_calibration`).
Writes bench/results/<UTC date-time>-frontends.{json,md} and prints the table.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from bench.baseline import Baseline, checkout
from bench.cells import NONE, number
from bench.configs import SIM_KV_SLOTS, Case, Configuration, Workload, sim, waves
from bench.envelope import Envelope, begin
from bench.figures import CPU, Figures, figures, ratio
from bench.machine import (
    Machine,
    add_wake_latency_argument,
    cpu_wake_latency,
    idle_policy,
    load_average,
    loop_calibration,
)
from bench.promtext import total
from bench.run import Endpoints, GrpcClient, Measurement, measure, serving
from bench.save import RESULTS, command_line, publish

TITLE = "Stepahead frontends benchmark"
FRONTEND_CPU = "stepahead_frontend_cpu_seconds_total"
GENERATED = "stepahead_generation_tokens_total"
MESSAGES = "stepahead_stream_messages_total"
FRONTEND_COUNTS = (0, 1, 2)
CONNECTION_COUNTS = (1, 8)  # client connections per run, whatever the frontend count
BOX_BOUND = 0.9  # all processes together at this fraction of the cores or more: the box is the bound

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Point:
    step_ms: float
    concurrency: int


POINTS = (Point(10, 8), Point(10, 64), Point(10, 128), Point(10, 256), Point(20, 256))


@dataclass(frozen=True)
class FrontendsPlan:
    """Every point at every frontend count: `waves` x concurrency requests of exactly
    `input_len` prompt and `output_len` new tokens (ignore_eos)."""

    name: str
    waves: int
    points: tuple[Point, ...] = POINTS
    frontend_counts: tuple[int, ...] = FRONTEND_COUNTS
    input_len: int = 16
    output_len: int = 128
    connection_counts: tuple[int, ...] = CONNECTION_COUNTS

    @property
    def step_times(self) -> tuple[float, ...]:
        return tuple(dict.fromkeys(p.step_ms for p in self.points))

    def concurrencies(self, step_ms: float) -> list[int]:
        return sorted(p.concurrency for p in self.points if p.step_ms == step_ms)

    def workload(self, concurrency: int) -> Workload:
        return waves(self.waves, concurrency, self.input_len, self.output_len, 0.0)


FULL = FrontendsPlan("full", waves=16)
QUICK = FrontendsPlan("quick", waves=2, frontend_counts=(1,))


# ---- CPU per token ---------------------------------------------------------------------------


@dataclass(frozen=True)
class CpuSeconds:
    """CPU seconds each side spent during one measured run."""

    core: float  # the scheduler's endpoint: the engine core's process (and frontends with 0)
    frontends: float  # every frontend process together
    worker: float
    loadgen: float  # the bench process

    @property
    def total(self) -> float:
        return self.core + self.frontends + self.worker + self.loadgen


@dataclass(frozen=True)
class CpuFigures:
    generated_tokens: int  # Δ stepahead_generation_tokens_total: tokens streamed to clients
    core_us_per_token: float | None
    frontends_us_per_token: float | None  # None with 0 frontends: that work is in the core's
    scheduler_us_per_token: float | None  # core + frontends
    worker_us_per_token: float | None
    loadgen_us_per_token: float | None
    cpus_used: float | None  # CPU seconds of all the processes per wall second of the run
    cpus: int  # os.cpu_count()
    frontend_shares: tuple[float, ...] = ()  # each frontend process's part of their CPU, largest first
    # Messages streamed to clients per second, per frontend (None: code that does not count them)
    messages_per_s_per_frontend: float | None = None

    @property
    def box_bound(self) -> bool:
        return self.cpus_used is not None and self.cpus_used >= BOX_BOUND * self.cpus


def cpu_seconds(measured: Measurement) -> CpuSeconds:
    return CpuSeconds(
        core=total(measured.scheduler, CPU),
        frontends=total(measured.scheduler, FRONTEND_CPU),
        worker=total(measured.worker, CPU),
        loadgen=measured.client_cpu_s,
    )


def us_per_token(seconds: float, tokens: float) -> float | None:
    return ratio(seconds * 1e6, tokens)


def cpu_figures(frontends: int, measured: Measurement, cpus: int | None = None) -> CpuFigures:
    s, tokens = cpu_seconds(measured), total(measured.scheduler, GENERATED)
    return CpuFigures(
        generated_tokens=round(tokens),
        core_us_per_token=us_per_token(s.core, tokens),
        frontends_us_per_token=None if frontends == 0 else us_per_token(s.frontends, tokens),
        scheduler_us_per_token=us_per_token(s.core + s.frontends, tokens),
        worker_us_per_token=us_per_token(s.worker, tokens),
        loadgen_us_per_token=us_per_token(s.loadgen, tokens),
        cpus_used=ratio(s.total, measured.summary.duration_s),
        cpus=cpus or os.cpu_count() or 1,
        frontend_shares=cpu_shares(measured.scheduler_children_cpu_s),
        messages_per_s_per_frontend=messages_per_s(measured, frontends),
    )


def messages_per_s(measured: Measurement, frontends: int) -> float | None:
    if not any(name == MESSAGES for name, _ in measured.scheduler):
        return None
    return ratio(total(measured.scheduler, MESSAGES), measured.summary.duration_s * max(frontends, 1))


# ---- how the frontend processes split their CPU ----------------------------------------------


def cpu_shares(used: Mapping[int, float]) -> tuple[float, ...]:
    """Each process's part of the CPU they used together, largest first."""
    spent = sum(used.values())
    return tuple(sorted((u / spent for u in used.values()), reverse=True)) if spent > 0 else ()


# ---- running ---------------------------------------------------------------------------------


Code = Literal["current", "baseline"]
WorkerLink = Literal["socket", "grpc"]


@dataclass(frozen=True)
class PointResult:
    case: Case
    figures: Figures  # bench.figures: throughput, device, latency, CPU per step
    cpu: CpuFigures
    connections: int = 1
    code: Code = "current"
    client: GrpcClient = "grpc"  # loadgen's gRPC backend

    @property
    def point(self) -> tuple[float, int, int, int, bool]:
        """(step ms, concurrency, frontends, connections, baseline first): the table's order."""
        c = self.case.configuration
        step_ms = c.device.sim_step_ms or 0.0
        return (
            step_ms,
            self.case.workload.concurrency,
            c.frontends,
            self.connections,
            self.code == "current",
        )


@dataclass(frozen=True)
class FrontendsRun:
    plan: FrontendsPlan
    started_at: datetime  # UTC
    machine: Machine
    load_average_after: float
    results: tuple[PointResult, ...]  # by step time, concurrency, frontend count, connections, code
    loop_s: float | None = None  # the machine's loop calibration (`bench.machine.loop_calibration`)
    baseline: str | None = None  # the baseline's commit, when one ran
    kv_slots: int = SIM_KV_SLOTS  # the sim worker's KV pool
    wake_latency_us: int | None = None  # the CPUs' idle states held to this (None: the host's)


def to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_plan(
    plan: FrontendsPlan,
    progress: Progress = to_stderr,
    baseline: Baseline | None = None,
    link: WorkerLink = "socket",
    client: GrpcClient = "grpc",
    kv_slots: int = SIM_KV_SLOTS,
    wake_latency_us: int | None = None,
) -> FrontendsRun:
    """`link`: how this checkout's scheduler reaches its worker (a baseline uses its own best);
    `client`: loadgen's gRPC backend against this checkout (a baseline without GenerateMany is
    sent Generate calls); `kv_slots`: the sim worker's KV pool (small enough, it fills with cached
    prefixes as the points go on, and admissions and steps evict); `wake_latency_us`: every code
    runs with the CPUs kept out of idle states slower to leave (`bench.machine.cpu_wake_latency`)."""
    with cpu_wake_latency(wake_latency_us):
        return _run_plan(plan, progress, baseline, link, client, kv_slots, wake_latency_us)


def _run_plan(
    plan: FrontendsPlan,
    progress: Progress,
    baseline: Baseline | None,
    link: WorkerLink,
    client: GrpcClient,
    kv_slots: int,
    wake_latency_us: int | None,
) -> FrontendsRun:
    started_at, machine = begin()
    loop_s = loop_calibration()
    progress(f"loop calibration: {loop_s:.2f} s")
    codes: list[tuple[Code, Path | None, WorkerLink, GrpcClient]] = [("current", None, link, client)]
    if baseline is not None:
        baseline_client: GrpcClient = client if baseline.serves_generate_many else "grpc"
        codes.insert(0, ("baseline", baseline.path, baseline.worker_link, baseline_client))
    results = [
        result
        for step_ms in plan.step_times
        for frontends in plan.frontend_counts
        for code, path, code_link, code_client in codes
        for result in run_pair(
            plan,
            Configuration(sim(step_ms, kv_slots), "overlap", code_link, frontends=frontends),
            progress,
            code,
            path,
            code_client,
        )
    ]
    ordered = tuple(sorted(results, key=lambda r: r.point))
    commit = None if baseline is None else baseline.commit
    return FrontendsRun(
        plan, started_at, machine, load_average(), ordered, loop_s, commit, kv_slots, wake_latency_us
    )


def run_pair(
    plan: FrontendsPlan,
    configuration: Configuration,
    progress: Progress,
    code: Code = "current",
    path: Path | None = None,
    client: GrpcClient = "grpc",
) -> list[PointResult]:
    """One worker and scheduler (of `code`, from `path`) for every concurrency and connection
    count at this step time, lowest first."""
    step_ms = configuration.device.sim_step_ms or 0.0
    with serving(configuration, path) as endpoints:
        return [
            run_point(plan, configuration, endpoints, c, connections, progress, code, client)
            for c in plan.concurrencies(step_ms)
            for connections in plan.connection_counts
        ]


def run_point(
    plan: FrontendsPlan,
    configuration: Configuration,
    endpoints: Endpoints,
    concurrency: int,
    connections: int,
    progress: Progress,
    code: Code = "current",
    client: GrpcClient = "grpc",
) -> PointResult:
    case = Case(configuration, plan.workload(concurrency))
    measured = measure(endpoints, case.workload, connections, client=client)
    cpu = cpu_figures(configuration.frontends, measured)
    result = PointResult(case, figures(case, measured), cpu, connections, code, client)
    progress(progress_line(result))
    return result


def progress_line(r: PointResult) -> str:
    step_ms, concurrency, frontends, connections, _ = r.point
    return (
        f"{r.code} ({r.client}): step {step_ms:g} ms, concurrency {concurrency:>3}, frontends {frontends}, "
        f"connections {connections}: {r.figures.output_tokens_per_s:8,.0f} tok/s, busy "
        f"{number(r.figures.device_busy_fraction, 3)}, scheduler {number(r.cpu.scheduler_us_per_token, 1)} "
        f"µs/token, CPUs used {number(r.cpu.cpus_used, 2)}, {r.figures.failed} failed"
    )


# ---- reporting -------------------------------------------------------------------------------


def envelope(run: FrontendsRun, command: str) -> Envelope:
    return Envelope.planned(
        TITLE, command, run.plan, run.started_at, run.machine, ("python",), run.load_average_after
    )


def to_json(run: FrontendsRun, command: str) -> dict[str, Any]:
    points = [_point_json(r) for r in run.results]
    extra = {
        "loop_calibration_s": run.loop_s,
        "baseline_commit": run.baseline,
        "kv_slots": run.kv_slots,
        "cpu_wake_latency_us": run.wake_latency_us,
        "points": points,
    }
    return envelope(run, command).json(extra)


def _point_json(r: PointResult) -> dict[str, Any]:
    step_ms, concurrency, frontends, connections, _ = r.point
    w = r.case.workload
    return {
        "name": r.case.configuration.name,
        "code": r.code,
        "client": r.client,
        "step_ms": step_ms,
        "concurrency": concurrency,
        "frontends": frontends,
        "connections": connections,
        "worker_args": list(r.case.configuration.device.worker_args),
        "scheduler_args": list(r.case.configuration.scheduler_args),
        "workload": {**asdict(w), "input_bounds": w.input_bounds, "output_bounds": w.output_bounds},
        "figures": asdict(r.figures),
        "cpu": {**asdict(r.cpu), "box_bound": r.cpu.box_bound},
    }


def to_markdown(run: FrontendsRun, command: str) -> str:
    return envelope(run, command).markdown(
        [*table(run.results), "", *ratio_table(run.results), *notes(run), *failure_lines(run.results)]
    )


def table(results: Sequence[PointResult]) -> list[str]:
    cpus = results[0].cpu.cpus if results else os.cpu_count()
    header = (
        "| code | step ms | concurrency | frontends | connections | output tok/s | of ideal | device busy "
        "| TTFT p50 ms | ITL p50 / p99 ms | core µs/tok | frontends µs/tok | scheduler µs/tok "
        f"| worker µs/tok | loadgen µs/tok | msg/s a frontend | CPUs used (of {cpus}) | frontend CPU split |"
    )
    return [header, "|---|" + "---:|" * 16 + "---|", *(_row(r) for r in results)]


def _row(r: PointResult) -> str:
    step_ms, concurrency, frontends, connections, _ = r.point
    f, c = r.figures, r.cpu
    cells = [
        r.code if r.client == "grpc" else f"{r.code}, {r.client}",
        f"{step_ms:g}",
        str(concurrency),
        str(frontends),
        str(connections),
        number(f.output_tokens_per_s, 0),
        number(f.fraction_of_ideal, 3),
        number(f.device_busy_fraction, 3),
        number(f.ttft_p50_ms, 1),
        f"{number(f.itl_p50_ms, 1)} / {number(f.itl_p99_ms, 1)}",
        number(c.core_us_per_token, 1),
        "in core" if frontends == 0 else number(c.frontends_us_per_token, 1),
        number(c.scheduler_us_per_token, 1),
        number(c.worker_us_per_token, 1),
        number(c.loadgen_us_per_token, 1),
        number(c.messages_per_s_per_frontend, 0),
        number(c.cpus_used, 2) + (" †" if c.box_bound else ""),
        split(c.frontend_shares, frontends),
    ]
    return "| " + " | ".join(cells) + " |"


def ratio_table(results: Sequence[PointResult]) -> list[str]:
    """Each point's figures over the baseline's at the same point (none without a baseline)."""
    baseline = {r.point[:4]: r for r in results if r.code == "baseline"}
    pairs = [(r, baseline[r.point[:4]]) for r in results if r.code == "current" and r.point[:4] in baseline]
    if not pairs:
        return []
    header = (
        "| step ms | concurrency | frontends | connections | scheduler µs/tok | core µs/tok "
        "| device busy | TTFT p50 | ITL p50 | ITL p99 |"
    )
    rows = [header, "|" + "---:|" * 10]
    for new, old in pairs:
        step_ms, concurrency, frontends, connections, _ = new.point
        cells = [
            f"{step_ms:g}",
            str(concurrency),
            str(frontends),
            str(connections),
            _times(new.cpu.scheduler_us_per_token, old.cpu.scheduler_us_per_token),
            _times(new.cpu.core_us_per_token, old.cpu.core_us_per_token),
            _times(new.figures.device_busy_fraction, old.figures.device_busy_fraction),
            _times(new.figures.ttft_p50_ms, old.figures.ttft_p50_ms),
            _times(new.figures.itl_p50_ms, old.figures.itl_p50_ms),
            _times(new.figures.itl_p99_ms, old.figures.itl_p99_ms),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return ["Current over baseline, point by point:", "", *rows, ""]


def _times(new: float | None, old: float | None) -> str:
    r = ratio(new, old)
    return NONE if r is None else f"{r:.2f}x"


def split(shares: Sequence[float], frontends: int) -> str:
    if frontends < 2:
        return NONE
    return " / ".join(f"{share:.0%}" for share in shares) if shares else NONE


def notes(run: FrontendsRun) -> list[str]:
    p = run.plan
    connections = " or ".join(map(str, p.connection_counts))
    calibration = NONE if run.loop_s is None else f"{run.loop_s:.2f} s"
    links = {r.code: r.case.configuration.transport for r in run.results}
    baseline = [] if run.baseline is None else [f"- baseline: commit {run.baseline}, run the same way"]
    links_line = ", ".join(f"{code} over {link}" for code, link in sorted(links.items(), reverse=True))
    clients = {r.code: r.client for r in run.results}
    clients_line = ", ".join(f"{code} {client}" for code, client in sorted(clients.items(), reverse=True))
    return [
        f"- machine speed: a pure Python loop (`for i in range(10**7): s += i*i`) takes {calibration}",
        f"- idle CPUs: {idle_policy(run.wake_latency_us, run.machine.get('cpuidle'))}",
        *baseline,
        f"- the scheduler's link to the worker: {links_line} (socket: the worker's framed --link-socket, "
        "as `stepahead serve` runs it)",
        f"- loadgen's client: {clients_line} (grpc: a Generate call a request; grpc-many: one "
        "GenerateMany call a connection, carrying its requests)",
        f"- each point: {p.waves} x concurrency requests, {p.input_len}-token prompts, exactly "
        f"{p.output_len} new tokens (ignore_eos), a closed loop over {connections} client connections; "
        f"warmup: concurrency x 8 tokens; overlap mode; ideal = concurrency x 1000 / step ms",
        f"- the sim worker's KV pool: {run.kv_slots:,} slots"
        + (
            " (the default: room for every point's cached prefixes)"
            if run.kv_slots == SIM_KV_SLOTS
            else " (it fills with cached prefixes as the points go on; then the prefix cache evicts)"
        ),
        "- msg/s a frontend: messages streamed to clients per second (gRPC responses, server-sent "
        "events), per frontend process (the core's own with 0)",
        "- µs/tok: CPU time per token streamed to clients (Δ stepahead_generation_tokens_total); core: "
        "the engine core's process (with 0 frontends it serves the clients too); scheduler: core + "
        "frontends; loadgen: the bench process",
        f"- CPUs used: CPU seconds of core, frontends, worker and loadgen per wall second; † at "
        f"{BOX_BOUND:.0%} of the machine's CPUs or more: the machine is the bound",
        "- frontend CPU split: each frontend process's part of the frontends' CPU (from /proc); the "
        "kernel spreads connections, not requests, over the processes sharing the port",
    ]


def failure_lines(results: Sequence[PointResult]) -> Iterator[str]:
    """Figures cover completed requests only: a point with failures is flagged."""
    for r in results:
        if r.figures.failed:
            step_ms, concurrency, frontends, connections, _ = r.point
            yield ""
            yield (
                f"**{r.figures.failed} of {r.figures.failed + r.figures.completed} requests failed** at "
                f"step {step_ms:g} ms, concurrency {concurrency}, frontends {frontends}, connections "
                f"{connections} ({r.code})."
            )


# ---- command line ----------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.frontends", description=__doc__)
    p.add_argument(
        "--quick", action="store_true", help=f"{QUICK.waves} waves per point instead of {FULL.waves}"
    )
    p.add_argument("--out", type=Path, default=RESULTS, help="results directory (default: bench/results)")
    p.add_argument(
        "--baseline",
        metavar="REF",
        help="also run every point on the code of this commit (a git worktree of it), side by side",
    )
    p.add_argument(
        "--worker-link",
        choices=("socket", "grpc"),
        default="socket",
        help="this checkout's link to the worker (default socket, as stepahead serve runs it; a "
        "baseline uses its socket where it has one)",
    )
    p.add_argument(
        "--client",
        choices=("grpc", "grpc-many"),
        default="grpc",
        help="loadgen's gRPC backend: a Generate call a request (default), or one GenerateMany call a "
        "connection (a baseline without GenerateMany is sent Generate calls)",
    )
    p.add_argument(
        "--kv-slots",
        type=int,
        default=SIM_KV_SLOTS,
        help=f"the sim worker's KV pool (default {SIM_KV_SLOTS:,}); a smaller one fills "
        "with cached prefixes, as a long-running server's does, and the prefix cache evicts",
    )
    add_wake_latency_argument(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    command = command_line("bench.frontends", argv)
    baseline = None if args.baseline is None else checkout(args.baseline)
    plan = QUICK if args.quick else FULL
    run = run_plan(
        plan,
        baseline=baseline,
        link=args.worker_link,
        client=args.client,
        kv_slots=args.kv_slots,
        wake_latency_us=args.cpu_wake_latency_us,
    )
    publish("frontends", run.started_at, to_json(run, command), to_markdown(run, command), args.out)


if __name__ == "__main__":
    main()
