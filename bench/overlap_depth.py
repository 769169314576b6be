"""python -m bench.overlap_depth [--quick] [--out DIR]: how deep the overlap loop must run to
keep the device busy across a slow worker link, side by side in one run.

Sim, 10 ms step, concurrency 64. For each one-way link delay d (ms) and each `--overlap-depth`
(1, 2, 3, auto): a fresh sim worker, `python -m bench.link_delay` in front of it when d > 0
(at d = 0 the scheduler connects directly), an overlap scheduler at that depth, then loadgen's
random dataset as a closed loop (exactly `output_len` new tokens a request) after a warmup,
between two scrapes of both /metrics endpoints. Per point: device busy (the worker's forward
time over busy + idle), output tok/s (loadgen), the mean link round trip the scheduler measured,
the depth in effect at the end (`stepahead_overlap_depth`), and the tokens sampled after a
finish (dropped, never streamed).

From the arithmetic: depth D idles once 2d + the scheduler's CPU per step > D x step.

Writes bench/results/<UTC date-time>-overlap-depth.{json,md,png} and prints the table.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench import link_delay
from bench.cells import number
from bench.configs import SIM_KV_SLOTS, Workload, waves
from bench.envelope import Envelope, begin
from bench.figures import BUSY, IDLE, busy_fraction, ratio
from bench.machine import Machine
from bench.promtext import Samples, scrape, total
from bench.run import Endpoints, measure
from bench.save import RESULTS, command_line, publish, stamp_of
from stepahead.processes import Service, spawn_scheduler, spawn_worker, wait_serving

NAME = "overlap-depth"
TITLE = "Overlap depth across a slow worker link"
DEPTHS = ("1", "2", "3", "auto")
STEP_MS = 10.0
BUSY_TARGET, BUSY_TARGET_DELAY_MS = 0.95, 5.0  # auto at d = 5 ms
RTT_SUM, RTT_COUNT = "stepahead_worker_link_rtt_seconds_sum", "stepahead_worker_link_rtt_seconds_count"


@dataclass(frozen=True)
class Plan:
    name: str
    delays_ms: tuple[float, ...] = (0.0, 1.0, 2.0, 5.0)
    concurrency: int = 64
    waves: int = 4
    input_len: int = 16
    output_len: int = 128

    @property
    def workload(self) -> Workload:
        return waves(self.waves, self.concurrency, self.input_len, self.output_len, 0.0)


FULL = Plan("full")
QUICK = Plan("quick", delays_ms=(0.0, 5.0), waves=1, output_len=64)


@dataclass(frozen=True)
class Point:
    delay_ms: float
    depth: str  # as given to --overlap-depth
    device_busy: float | None
    output_tokens_per_s: float
    link_rtt_ms: float | None  # the scheduler's mean over the run
    depth_in_effect: int  # at the end of the run
    dropped_tokens: int
    completed: int
    failed: int


# ---- running ---------------------------------------------------------------------------------


@contextlib.contextmanager
def serving(delay_ms: float, depth: str) -> Iterator[Endpoints]:
    worker_args = ["--model", "sim", "--sim-step-ms", f"{STEP_MS:g}", "--sim-token-us", "0"]
    worker = spawn_worker([*worker_args, "--kv-slots", str(SIM_KV_SLOTS)])
    scheduler: Service | None = None
    try:
        wait_serving(worker.address)
        with link_delay.running(worker.address, delay_ms) as address:
            scheduler = spawn_scheduler(address, ["--mode", "overlap", "--overlap-depth", depth])
            wait_serving(scheduler.address)
            yield Endpoints(scheduler.address, scheduler.metrics_url, worker.metrics_url, scheduler.proc.pid)
    finally:
        for service in (scheduler, worker):
            if service is not None and service.proc.poll() is None:
                service.stop()


def run_point(plan: Plan, delay_ms: float, depth: str) -> Point:
    with serving(delay_ms, depth) as endpoints:
        measured = measure(endpoints, plan.workload)
        depth_now = round(total(scrape(endpoints.scheduler_metrics), "stepahead_overlap_depth"))
    s, scheduler, worker = measured.summary, measured.scheduler, measured.worker
    return Point(
        delay_ms,
        depth,
        busy_fraction(total(worker, BUSY), total(worker, IDLE)),
        s.output_throughput,
        _mean_rtt_ms(scheduler),
        depth_now,
        round(total(scheduler, "stepahead_dropped_inflight_tokens_total")),
        s.completed,
        s.failed,
    )


def _mean_rtt_ms(scheduler: Samples) -> float | None:
    mean = ratio(total(scheduler, RTT_SUM), total(scheduler, RTT_COUNT))
    return None if mean is None else mean * 1e3


def run_plan(plan: Plan) -> list[Point]:
    points = []
    for delay_ms in plan.delays_ms:
        for depth in DEPTHS:
            points.append(run_point(plan, delay_ms, depth))
            print(progress_line(points[-1]), file=sys.stderr, flush=True)
    return points


def progress_line(p: Point) -> str:
    return (
        f"d = {p.delay_ms:g} ms, depth {p.depth}: busy {number(p.device_busy, 3)}, "
        f"{p.output_tokens_per_s:,.0f} tok/s, rtt {number(p.link_rtt_ms, 2)} ms, "
        f"in effect {p.depth_in_effect}"
    )


# ---- reporting -------------------------------------------------------------------------------


def find(points: Sequence[Point], delay_ms: float, depth: str) -> Point | None:
    return next((p for p in points if (p.delay_ms, p.depth) == (delay_ms, depth)), None)


def target_busy(points: Sequence[Point]) -> float | None:
    point = find(points, BUSY_TARGET_DELAY_MS, "auto")
    return None if point is None else point.device_busy


def auto_at_zero(points: Sequence[Point]) -> float | None:
    """Auto's tok/s over depth 1's at d = 0: what auto costs on a fast link."""
    auto, one = find(points, 0.0, "auto"), find(points, 0.0, "1")
    return None if auto is None or one is None else ratio(auto.output_tokens_per_s, one.output_tokens_per_s)


def table(points: Sequence[Point]) -> list[str]:
    delays = sorted({p.delay_ms for p in points})
    header = (
        "| one-way delay | "
        + " | ".join(f"depth {d}: busy, tok/s" for d in DEPTHS)
        + " | link RTT ms | auto's depth |"
    )
    lines = [header, "|---:|" + "---:|" * (len(DEPTHS) + 2)]
    for delay in delays:
        cells = [f"{delay:g} ms"]
        for depth in DEPTHS:
            p = find(points, delay, depth)
            cells.append("" if p is None else f"{number(p.device_busy, 3)}, {p.output_tokens_per_s:,.0f}")
        auto = find(points, delay, "auto")
        cells.append("" if auto is None else number(auto.link_rtt_ms, 2))
        cells.append("" if auto is None else str(auto.depth_in_effect))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def envelope(plan: Plan, started_at: datetime, machine: Machine, command: str) -> Envelope:
    return Envelope.planned(TITLE, command, plan, started_at, machine, ("python",))


def to_markdown(
    plan: Plan, started_at: datetime, machine: Machine, points: Sequence[Point], command: str
) -> str:
    busy, cost = target_busy(points), auto_at_zero(points)
    met = None if busy is None else busy >= BUSY_TARGET
    lines = [
        *table(points),
        "",
        f"- sim, {STEP_MS:g} ms step, concurrency {plan.concurrency}, {plan.waves} x {plan.concurrency} "
        f"requests of {plan.input_len} prompt and exactly {plan.output_len} new tokens, a closed loop "
        "over one gRPC connection; per point a fresh worker, `bench.link_delay` in front of it when "
        "d > 0, and an overlap scheduler at that `--overlap-depth`",
        "- busy: the worker's forward time over busy + idle; link RTT: the scheduler's mean "
        "`stepahead_worker_link_rtt_seconds` at depth auto; auto's depth: `stepahead_overlap_depth` at "
        "the end",
        f"- target: depth auto keeps busy >= {BUSY_TARGET} at d = {BUSY_TARGET_DELAY_MS:g} ms: "
        f"{number(busy, 3)}, {'met' if met else 'not met' if met is not None else 'not measured'}",
        f"- depth auto at d = 0 over depth 1, output tok/s: {number(cost, 3)}",
    ]
    failed = [p for p in points if p.failed]
    lines += [f"- {p.failed} requests failed at d = {p.delay_ms:g} ms, depth {p.depth}" for p in failed]
    return envelope(plan, started_at, machine, command).markdown(lines)


def plot(points: Sequence[Point], path: Path) -> None:
    figure, (busy_axis, tok_axis) = plt.subplots(1, 2, figsize=(11, 4.2))
    for depth in DEPTHS:
        series = sorted((p for p in points if p.depth == depth), key=lambda p: p.delay_ms)
        delays = [p.delay_ms for p in series]
        busy_axis.plot(delays, [p.device_busy or 0.0 for p in series], marker="o", label=f"depth {depth}")
        tok_axis.plot(delays, [p.output_tokens_per_s for p in series], marker="o", label=f"depth {depth}")
    busy_axis.axhline(BUSY_TARGET, color="#999999", linestyle=":", label=f"{BUSY_TARGET:g}")
    busy_axis.set_ylim(0, 1.02)
    for axis, label in ((busy_axis, "device busy fraction"), (tok_axis, "output tokens/s")):
        axis.set_xlabel("one-way link delay (ms)")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
        axis.legend()
    figure.suptitle(f"sim, {STEP_MS:g} ms step, concurrency 64: overlap depth vs link delay")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.overlap_depth")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    started_at, machine = begin()
    points = run_plan(plan)
    command = command_line("bench.overlap_depth", argv)
    args.out.mkdir(parents=True, exist_ok=True)
    image = args.out / f"{stamp_of(started_at)}-{NAME}.png"
    plot(points, image)
    document = envelope(plan, started_at, machine, command).json(
        {
            "points": [asdict(p) for p in points],
            "target": {
                "busy_at_least": BUSY_TARGET,
                "delay_ms": BUSY_TARGET_DELAY_MS,
                "busy": target_busy(points),
            },
            "auto_over_depth_1_at_d0": auto_at_zero(points),
            "image": image.name,
        }
    )
    publish(NAME, started_at, document, to_markdown(plan, started_at, machine, points, command), args.out)


if __name__ == "__main__":
    main()
