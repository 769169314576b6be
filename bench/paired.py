"""python -m bench.paired --baseline REF: one served point of `bench.frontends`, this checkout's
code against another commit's, in paired turns, for a change too small for one run to show.

On a shared machine the CPU a token of the same code moves by a third or more between runs of
a few seconds (other tenants' work in the caches), so a single run of each code cannot resolve a
change of 5-15%. Here each turn starts a fresh worker and scheduler of each code, one after the
other, alternating which goes first, and measures the same point on both (sim device, overlap,
one frontend); each turn's ratio is taken within the turn, and the report gives every turn, the
medians of each code, and the median, range and sign count of the per-turn ratios: of the core's
and the frontends' CPU a token, and of the latencies a lightly loaded server must keep (time to
first token p50, inter-token latency p50 and p99). The host's pace still moves between a turn's
two sides (a run of each takes seconds), and it moves every process alike: where a change leaves
the frontends' code and work as they were, the core's ratio over the frontends' in the same turn
is the core's change at one pace, reported beside. The machine's loop calibration is printed
before and after. `--current-args` and `--baseline-args` give one side's scheduler more flags:
against `--baseline HEAD`, a flag's effect in the same turns. Writes
bench/results/<UTC date-time>-paired.{json,md} and prints the table.
"""

from __future__ import annotations

import argparse
import math
import shlex
import statistics
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, fields, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.baseline import Baseline, checkout
from bench.cells import number
from bench.configs import SIM_KV_SLOTS, Configuration, Workload, sim, waves
from bench.envelope import Envelope, begin
from bench.figures import ratio
from bench.frontends import CpuFigures, WorkerLink, cpu_figures
from bench.machine import Machine, load_average, loop_calibration
from bench.run import GrpcClient, measure, serving
from bench.save import RESULTS, command_line, publish
from scheduler_svc.process.cli import parse_args as parse_scheduler_args

CODES = ("current", "baseline")


@dataclass(frozen=True)
class PairedPlan:
    step_ms: float = 20.0
    concurrency: int = 256
    output_len: int = 128
    input_len: int = 16
    waves: int = 4  # of `concurrency` requests: waves x concurrency in all
    turns: int = 6
    connections: int = 1
    client: GrpcClient = "grpc-many"  # a baseline without GenerateMany is sent Generate calls
    # Finite: requests arrive as a Poisson process at this rate (a second), `concurrency` only a
    # cap, so that each arrives at any phase of a step; inf: a closed loop, where each arrives
    # just after one ends, at the same phase of a step each time.
    request_rate: float = math.inf
    # More scheduler flags for each side (after the point's own): the same code with and without
    # a flag is a baseline of HEAD with `current_args` set.
    current_args: tuple[str, ...] = ()
    baseline_args: tuple[str, ...] = ()
    # This checkout's scheduler reaches its worker over the framed socket, as `stepahead serve`
    # runs it; a baseline over its own best (`Baseline.worker_link`).

    def workload(self) -> Workload:
        closed = waves(self.waves, self.concurrency, self.input_len, self.output_len, 0.0)
        return replace(closed, request_rate=self.request_rate)


@dataclass(frozen=True)
class Side:
    """One code's figures in one turn."""

    core_us_per_token: float | None
    frontends_us_per_token: float | None
    ttft_p50_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    failed: int


@dataclass(frozen=True)
class Turn:
    first: str  # which code ran first
    current: Side
    baseline: Side

    def ratio(self, figure: str) -> float | None:
        return ratio(getattr(self.current, figure), getattr(self.baseline, figure))

    @property
    def core_over_frontends(self) -> float | None:
        """The core's ratio over the frontends': where a change leaves the frontends' code and
        work as they were, their ratio is the host's pace between the turn's two sides, and this
        is the core's ratio at one pace."""
        return ratio(self.ratio("core_us_per_token"), self.ratio("frontends_us_per_token"))


@dataclass(frozen=True)
class PairedRun:
    plan: PairedPlan
    baseline: str  # its commit
    started_at: datetime
    machine: Machine
    load_average_after: float
    loop_s: tuple[float, float]  # before and after
    turns: tuple[Turn, ...]


FIGURES = (("core_us_per_token", "core µs/token"), ("frontends_us_per_token", "frontends µs/token"))
# The latencies a lightly loaded server must not lose (`bench.frontends`' concurrency 8 target).
LATENCIES = (("ttft_p50_ms", "TTFT p50 ms"), ("itl_p50_ms", "ITL p50 ms"), ("itl_p99_ms", "ITL p99 ms"))

Measure = Callable[[PairedPlan, Path | None, GrpcClient, WorkerLink, tuple[str, ...]], Side]


def measure_side(
    plan: PairedPlan, code: Path | None, client: GrpcClient, link: WorkerLink, args: tuple[str, ...]
) -> Side:
    """A fresh worker and scheduler of the code at `code` (None: this checkout), its scheduler
    reaching its worker by `link` and given the flags `args` too, one point."""
    device = sim(plan.step_ms, SIM_KV_SLOTS)
    configuration = Configuration(device, "overlap", link, frontends=1, extra_args=args)
    with serving(configuration, code) as endpoints:
        measured = measure(endpoints, plan.workload(), plan.connections, client=client)
    cpu: CpuFigures = cpu_figures(1, measured)
    return Side(
        cpu.core_us_per_token,
        cpu.frontends_us_per_token,
        measured.summary.ttft.median,
        measured.summary.itl.median,
        measured.summary.itl.p99,
        measured.summary.failed,
    )


def run(
    plan: PairedPlan,
    baseline: Baseline,
    side: Measure = measure_side,
    progress: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> PairedRun:
    started_at, machine = begin()
    before = loop_calibration()
    progress(f"loop calibration: {before:.2f} s")
    baseline_client: GrpcClient = plan.client if baseline.serves_generate_many else "grpc"
    turns = []
    for t in range(plan.turns):
        first = CODES[t % 2]
        got: dict[str, Side] = {}
        for code in CODES if first == "current" else CODES[::-1]:
            if code == "current":
                got[code] = side(plan, None, plan.client, "socket", plan.current_args)
            else:
                got[code] = side(
                    plan, baseline.path, baseline_client, baseline.worker_link, plan.baseline_args
                )
        turn = Turn(first, got["current"], got["baseline"])
        turns.append(turn)
        progress(turn_line(t, turn))
    after = loop_calibration()
    return PairedRun(
        plan, baseline.commit, started_at, machine, load_average(), (before, after), tuple(turns)
    )


# ---- reporting -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Summary:
    """A figure over the turns: each code's median, and the per-turn ratios' median and range,
    with how many turns had the current code lower."""

    current: float | None
    baseline: float | None
    ratio_median: float | None
    ratio_min: float | None
    ratio_max: float | None
    lower: int
    turns: int


def summarize(turns: Sequence[Turn], figure: str) -> Summary:
    ratios = [r for t in turns if (r := t.ratio(figure)) is not None]
    return _summary(turns, figure, ratios)


def summarize_controlled(turns: Sequence[Turn]) -> Summary:
    """The core's per-turn ratios, each over the frontends' (`Turn.core_over_frontends`)."""
    ratios = [r for t in turns if (r := t.core_over_frontends) is not None]
    return _summary(turns, "core_us_per_token", ratios)


def _summary(turns: Sequence[Turn], figure: str, ratios: list[float]) -> Summary:
    current = [v for t in turns if (v := getattr(t.current, figure)) is not None]
    baseline = [v for t in turns if (v := getattr(t.baseline, figure)) is not None]
    return Summary(
        statistics.median(current) if current else None,
        statistics.median(baseline) if baseline else None,
        statistics.median(ratios) if ratios else None,
        min(ratios, default=None),
        max(ratios, default=None),
        sum(r < 1 for r in ratios),
        len(ratios),
    )


def turn_line(index: int, turn: Turn) -> str:
    figures = "; ".join(
        f"{label} {number(getattr(turn.baseline, f), 2)} -> {number(getattr(turn.current, f), 2)} "
        f"({number(turn.ratio(f), 2)}x)"
        for f, label in FIGURES
    )
    return f"turn {index + 1} ({turn.first} first): {figures}"


def envelope(run: PairedRun, command: str) -> Envelope:
    return Envelope(
        "Paired turns against a baseline",
        command,
        asdict(run.plan),
        None,
        run.started_at,
        run.machine,
        ("python",),
        load_after=run.load_average_after,
    )


def to_json(run: PairedRun, command: str) -> dict[str, Any]:
    return envelope(run, command).json(
        {
            "baseline": run.baseline,
            "loop_calibration_s": list(run.loop_s),
            "turns": [asdict(t) for t in run.turns],
            "summary": {f: asdict(summarize(run.turns, f)) for f, _ in (*FIGURES, *LATENCIES)},
            "core_over_frontends": asdict(summarize_controlled(run.turns)),
        }
    )


def to_markdown(run: PairedRun, command: str) -> str:
    p = run.plan
    header = "| turn | first | " + " | ".join(f"{label}: baseline, current, ratio" for _, label in FIGURES)
    header += "".join(f" | {label}: baseline, current" for _, label in LATENCIES)
    lines = [header + " |", "|---:|---|" + "---|" * (len(FIGURES) + len(LATENCIES))]
    for i, t in enumerate(run.turns):
        cells = [
            f"{number(getattr(t.baseline, f), 2)}, {number(getattr(t.current, f), 2)}, "
            f"{number(t.ratio(f), 2)}x"
            for f, _ in FIGURES
        ]
        cells += [f"{getattr(t.baseline, f):.1f}, {getattr(t.current, f):.1f}" for f, _ in LATENCIES]
        lines.append(f"| {i + 1} | {t.first} | " + " | ".join(cells) + " |")
    return envelope(run, command).markdown(
        [
            *lines,
            "",
            *summary_lines(run),
            f"- baseline: commit {run.baseline}; each turn a fresh worker and scheduler of each code, "
            "the first alternating",
            f"- the point: sim {p.step_ms:g} ms steps, overlap, one frontend, concurrency {p.concurrency}, "
            f"{p.waves} waves of {p.input_len}-token prompts and exactly {p.output_len} new tokens, over "
            f"{p.connections} connection(s), loadgen's {p.client} backend, "
            + (
                "a closed loop"
                if math.isinf(p.request_rate)
                else f"Poisson arrivals at {p.request_rate:g} a second"
            ),
            *(
                f"- the {code}'s scheduler also given `{' '.join(args)}`"
                for code, args in (("current code", p.current_args), ("baseline", p.baseline_args))
                if args
            ),
            f"- machine speed: a pure Python loop (`for i in range(10**7): s += i*i`) takes "
            f"{run.loop_s[0]:.2f} s before the turns, {run.loop_s[1]:.2f} s after",
        ]
    )


def summary_lines(run: PairedRun) -> Iterator[str]:
    shown = [(f, label, 2) for f, label in FIGURES] + [(f, label, 1) for f, label in LATENCIES]
    for f, label, places in shown:
        s = summarize(run.turns, f)
        yield (
            f"- {label}: medians {number(s.baseline, places)} -> {number(s.current, places)}; per-turn "
            f"ratio median {number(s.ratio_median, 2)}x (range {number(s.ratio_min, 2)}-"
            f"{number(s.ratio_max, 2)}), current lower in {s.lower} of {s.turns} turns"
        )
    c = summarize_controlled(run.turns)
    yield (
        f"- the core's ratio over the frontends' (a control for the host's pace where the change left "
        f"the frontends as they were): median {number(c.ratio_median, 2)}x (range "
        f"{number(c.ratio_min, 2)}-{number(c.ratio_max, 2)}), below 1 in {c.lower} of {c.turns} turns"
    )
    failed = sum(t.current.failed + t.baseline.failed for t in run.turns)
    if failed:
        yield f"- {failed} requests failed"


# ---- command line ----------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d = PairedPlan()
    p = argparse.ArgumentParser(prog="python -m bench.paired", description=__doc__)
    p.add_argument("--baseline", required=True, help="the commit to run beside this checkout")
    p.add_argument("--step-ms", type=float, default=d.step_ms, help="the sim's step time")
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--output-len", type=int, default=d.output_len, help="exact new tokens a request")
    p.add_argument("--waves", type=int, default=d.waves, help="of concurrency requests, per side and turn")
    p.add_argument("--turns", type=int, default=d.turns)
    p.add_argument("--connections", type=int, default=d.connections)
    p.add_argument("--client", choices=("grpc", "grpc-many"), default=d.client, help="loadgen's gRPC backend")
    p.add_argument(
        "--request-rate",
        type=positive_rate,
        default=d.request_rate,
        help="requests a second, arriving as a Poisson process (concurrency a cap); default: a closed loop",
    )
    for side in ("current", "baseline"):
        p.add_argument(
            f"--{side}-args",
            type=scheduler_flags,
            default=(),
            metavar="FLAGS",
            help=f"more scheduler flags for the {side} code's side, as one shell-quoted string "
            f'(e.g. --{side}-args="--no-prefix-cache"); with --baseline HEAD, a flag against none',
        )
    p.add_argument("--out", type=Path, default=RESULTS, help="results directory (default: bench/results)")
    args = p.parse_args(argv)
    try:  # this checkout's scheduler must take them (a baseline's own flags are its to refuse)
        parse_scheduler_args(list(args.current_args))
    except SystemExit:
        p.error(f"--current-args: the scheduler refuses {' '.join(args.current_args)!r}")
    return args


def scheduler_flags(text: str) -> tuple[str, ...]:
    try:
        return tuple(shlex.split(text))
    except ValueError as exc:  # an unclosed quote
        raise argparse.ArgumentTypeError(str(exc)) from exc


def positive_rate(text: str) -> float:
    rate = float(text)
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"must be above 0 requests a second (got {text})")
    return rate


def plan_of(args: argparse.Namespace) -> PairedPlan:
    """The plan the command line asks for (its options are the plan's fields, less `input_len`)."""
    return PairedPlan(**{f.name: getattr(args, f.name) for f in fields(PairedPlan) if hasattr(args, f.name)})


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(plan_of(args), checkout(args.baseline))
    command = command_line("bench.paired", argv)
    publish("paired", result.started_at, to_json(result, command), to_markdown(result, command), args.out)


if __name__ == "__main__":
    main()
