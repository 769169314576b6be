"""Start a configuration's processes, drive them with `loadgen`, and take metric and CPU deltas."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from bench.configs import Configuration, Workload
from bench.promtext import Labels, delta, scrape, total
from loadgen import BenchmarkConfig, Summary, run_benchmark
from loadgen.backend import Constrained, GrpcBackendName, SamplingFeatures
from stepahead import event_loop
from stepahead.processes import Service, serving_pair, spawn_scheduler_in_process, wait_serving

# A hang guard, not an expectation: the last release reaches the worker milliseconds after the
# last token, and a scrape takes at most a few seconds (see bench/promtext.py) on a slow machine.
SETTLE_TIMEOUT_S = 120.0
NO_FEATURES = SamplingFeatures()
NO_CONSTRAINT = Constrained()
GrpcClient = GrpcBackendName
PROC = Path("/proc")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def run_loadgen(config: BenchmarkConfig) -> Summary:
    return event_loop.run(run_benchmark(config)).summary


@dataclass(frozen=True)
class Endpoints:
    address: str  # the scheduler's Generation API
    scheduler_metrics: str
    worker_metrics: str  # served by the scheduler's process when the worker runs in it
    scheduler_pid: int | None = None  # the scheduler's (engine core's) process


@dataclass(frozen=True)
class Measurement:
    """One measured run: loadgen's summary and what each process counted during it."""

    summary: Summary
    scheduler: dict[tuple[str, Labels], float]  # scrape deltas
    worker: dict[tuple[str, Labels], float]
    client_cpu_s: float  # CPU time of this process (the load generator) during the run
    # CPU seconds of each child process of the scheduler's (its frontends) during the run
    scheduler_children_cpu_s: dict[int, float] = field(default_factory=dict)


@contextmanager
def serving(configuration: Configuration, code: Path | None = None) -> Iterator[Endpoints]:
    """Fresh processes for the configuration, SERVING; stopped on exit. `code`: run from that
    source tree (a baseline's checkout) instead of this one (not in-process)."""
    worker_args = list(configuration.device.worker_args)
    scheduler_args = list(configuration.scheduler_args)
    if configuration.transport != "in-process":
        link = configuration.transport
        with serving_pair(worker_args, scheduler_args, code=code, link=link) as (worker, scheduler):
            yield Endpoints(scheduler.address, scheduler.metrics_url, worker.metrics_url, scheduler.proc.pid)
        return
    with _in_process(worker_args, scheduler_args) as scheduler:
        urls = scheduler.metrics_urls
        yield Endpoints(scheduler.address, urls["scheduler"], urls["worker"], scheduler.proc.pid)


@contextmanager
def _in_process(worker_args: list[str], scheduler_args: list[str]) -> Iterator[Service]:
    scheduler = spawn_scheduler_in_process(worker_args, scheduler_args)
    try:
        wait_serving(scheduler.address)
        yield scheduler
    finally:
        if scheduler.proc.poll() is None:
            scheduler.stop()


def measure(
    endpoints: Endpoints,
    workload: Workload,
    connections: int = 1,
    features: SamplingFeatures = NO_FEATURES,
    constrained: Constrained = NO_CONSTRAINT,
    client: GrpcClient = "grpc",
) -> Measurement:
    """Warm up, then one measured run between two scrapes of each process; both runs are
    loadgen's, over `connections` client connections (one reaches a single frontend, which is
    all the scheduler runs by default), every request asking for the sampling `features`, the
    `constrained` ones held to a JSON Schema; `client`: loadgen's gRPC backend (a Generate call
    a request, or one GenerateMany call a connection)."""
    warmup = _warmup_config(endpoints.address, workload, connections, features, constrained)
    run_loadgen(dataclasses.replace(warmup, backend=client))
    settle(endpoints)
    scheduler_before, worker_before = scrape(endpoints.scheduler_metrics), scrape(endpoints.worker_metrics)
    children_before = _scheduler_children_cpu_s(endpoints)
    cpu_before = time.process_time()
    measured = _measured_config(endpoints.address, workload, connections, features, constrained)
    summary = run_loadgen(dataclasses.replace(measured, backend=client))
    client_cpu_s = time.process_time() - cpu_before
    children_used = cpu_used(children_before, _scheduler_children_cpu_s(endpoints))
    settle(endpoints)
    return Measurement(
        summary,
        delta(scheduler_before, scrape(endpoints.scheduler_metrics)),
        delta(worker_before, scrape(endpoints.worker_metrics)),
        client_cpu_s,
        children_used,
    )


def _measured_config(
    address: str, workload: Workload, connections: int, features: SamplingFeatures, constrained: Constrained
) -> BenchmarkConfig:
    return BenchmarkConfig(
        server=address,
        dataset=workload.dataset,
        num_prompts=workload.num_prompts,
        max_concurrency=workload.concurrency,
        connections=connections,
        request_rate=workload.request_rate,
        seed=workload.seed,
        ignore_eos=True,
        features=features,
        constrained=constrained,
    )


def _warmup_config(
    address: str, workload: Workload, connections: int, features: SamplingFeatures, constrained: Constrained
) -> BenchmarkConfig:
    """Short requests at the measured concurrency: connections, first forwards, full batches."""
    return BenchmarkConfig(
        server=address,
        dataset=workload.warmup_dataset,
        num_prompts=workload.warmup_prompts,
        max_concurrency=workload.concurrency,
        connections=connections,
        seed=workload.seed + 1,
        ignore_eos=True,
        features=features,
        constrained=constrained,
    )


def children_cpu_s(pid: int, proc: Path = PROC) -> dict[int, float]:
    """User + system CPU seconds of each live child of `pid`, from /proc/<child>/stat."""
    found = {}
    for stat in proc.glob("[0-9]*/stat"):
        try:
            # NOTE: the command name (field 2) may hold spaces; every field after its ")" is plain.
            after_name = stat.read_text().rpartition(")")[2].split()
        except OSError:  # the process ended while we looked
            continue
        if int(after_name[1]) == pid:  # ppid; utime and stime are fields 14 and 15
            found[int(stat.parent.name)] = (int(after_name[11]) + int(after_name[12])) / CLOCK_TICKS
    return found


def cpu_used(before: dict[int, float], after: dict[int, float]) -> dict[int, float]:
    """CPU seconds each process used between the two readings; those missing from either are left out."""
    return {pid: after[pid] - before[pid] for pid in after if pid in before}


def _scheduler_children_cpu_s(endpoints: Endpoints) -> dict[int, float]:
    return {} if endpoints.scheduler_pid is None else children_cpu_s(endpoints.scheduler_pid)


def settle(endpoints: Endpoints) -> None:
    """Waits until the scheduler holds no request and the worker no request slot, so the scrapes
    bracket whole runs: the last release reaches the worker one (row-less) launch after the last
    token is streamed."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while time.monotonic() < deadline:
        running = total(scrape(endpoints.scheduler_metrics), "stepahead_requests_running")
        live_slots = total(scrape(endpoints.worker_metrics), "stepahead_live_request_slots")
        if running == 0 and live_slots == 0:
            return
        time.sleep(0.02)
    raise TimeoutError(f"{endpoints.address}: requests still live {SETTLE_TIMEOUT_S}s after the run")
