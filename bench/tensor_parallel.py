"""python -m bench.tensor_parallel [--quick] [--out DIR]: `tiny` on one rank and on two
(`--tp 2`, gloo on the CPU), side by side, and what the all-reduce costs on its own.

Through the services: for each TP size a fresh worker and overlap scheduler over gRPC; at each
concurrency, loadgen's random dataset as a closed loop (exactly `output_len` new tokens a
request), after a warmup, between two scrapes of both /metrics endpoints. Per row: output tok/s
(loadgen), the worker's mean forward ms (its busy time per executed batch: the per-step device
time) and device busy (forward time over busy + idle). The ratios divide TP 2's figure by TP
1's at the same concurrency.

The collective alone: two gloo processes on 127.0.0.1, one thread each, all-reduce a float32
[tokens, hidden] tensor (tiny's hidden size, 256) `repeats` times after a warmup; the table has
the median. A tiny step runs two a layer (after o_proj and down_proj), eight a step.

Writes bench/results/<UTC date-time>-tensor-parallel.{json,md} and prints the tables.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import TCPStore

from bench.cells import number, times
from bench.configs import Configuration, Device, Workload, waves
from bench.envelope import Envelope, begin
from bench.figures import BUSY, IDLE, busy_fraction, mean_forward_ms, ratio
from bench.machine import Machine
from bench.promtext import total
from bench.run import measure, serving
from bench.save import RESULTS, command_line, publish
from worker_svc.loading import TINY_CONFIG

NAME = "tensor-parallel"
TITLE = "Tensor parallelism on the CPU: tiny on 1 and 2 ranks"
TP_SIZES = (1, 2)
LAYER_ALL_REDUCES = 2  # after o_proj and after down_proj


@dataclass(frozen=True)
class Plan:
    name: str
    concurrencies: tuple[int, ...]
    prompts_per_concurrency: int
    input_len: int = 128
    output_len: int = 128
    all_reduce_tokens: tuple[int, ...] = (1, 16, 64, 256)
    repeats: int = 400

    def workload(self, concurrency: int) -> Workload:
        return waves(self.prompts_per_concurrency, concurrency, self.input_len, self.output_len, 0.0)


FULL = Plan("full", (1, 16, 64), 4)
QUICK = Plan("quick", (16,), 2, output_len=32, repeats=100)


def device(tp: int) -> Device:
    return Device(f"tiny tp{tp}", ("--model", "tiny", "--tp", str(tp)))


@dataclass(frozen=True)
class Row:
    tp: int
    concurrency: int
    output_tokens_per_s: float
    mean_forward_ms: float | None
    device_busy_fraction: float | None
    completed: int
    failed: int


@dataclass(frozen=True)
class AllReduceRow:
    tokens: int
    median_us: float

    @property
    def per_layer_us(self) -> float:
        return LAYER_ALL_REDUCES * self.median_us

    @property
    def per_step_ms(self) -> float:
        return self.per_layer_us * TINY_CONFIG.num_layers / 1e3


# ---- the services ----------------------------------------------------------------------------


def serve_rows(plan: Plan, tp: int) -> list[Row]:
    rows = []
    with serving(Configuration(device(tp), "overlap", "grpc")) as endpoints:
        for concurrency in plan.concurrencies:
            measured = measure(endpoints, plan.workload(concurrency))
            s, worker = measured.summary, measured.worker
            busy = busy_fraction(total(worker, BUSY), total(worker, IDLE))
            row = Row(
                tp, concurrency, s.output_throughput, mean_forward_ms(worker), busy, s.completed, s.failed
            )
            print(f"tp {tp}, concurrency {concurrency}: {row}", file=sys.stderr, flush=True)
            rows.append(row)
    return rows


# ---- the collective alone --------------------------------------------------------------------


def _all_reduce_rank(rank: int, port: int, plan: Plan, results: Any) -> None:
    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", port, 2, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    medians = {}
    for tokens in plan.all_reduce_tokens:
        tensor = torch.randn(tokens, TINY_CONFIG.hidden_size)
        for _ in range(20):
            dist.all_reduce(tensor)
        samples = []
        for _ in range(plan.repeats):
            start = time.perf_counter()
            dist.all_reduce(tensor)
            samples.append(time.perf_counter() - start)
        medians[tokens] = statistics.median(samples) * 1e6
    if rank == 0:
        results.put(medians)
    dist.destroy_process_group()


def all_reduce_rows(plan: Plan) -> list[AllReduceRow]:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    procs = [context.Process(target=_all_reduce_rank, args=(r, store.port, plan, results)) for r in range(2)]
    for p in procs:
        p.start()
    medians = results.get(timeout=600)
    for p in procs:
        p.join(60)
    return [AllReduceRow(tokens, medians[tokens]) for tokens in plan.all_reduce_tokens]


# ---- reporting -------------------------------------------------------------------------------


def find(rows: Sequence[Row], tp: int, concurrency: int) -> Row | None:
    return next((r for r in rows if (r.tp, r.concurrency) == (tp, concurrency)), None)


def versus_tp1(rows: Sequence[Row], row: Row) -> tuple[float | None, float | None]:
    """TP N's output tok/s and mean forward ms over TP 1's at the same concurrency."""
    one = find(rows, 1, row.concurrency)
    if one is None:
        return None, None
    return (
        ratio(row.output_tokens_per_s, one.output_tokens_per_s),
        ratio(row.mean_forward_ms, one.mean_forward_ms),
    )


def envelope(plan: Plan, started_at: datetime, machine: Machine, command: str) -> Envelope:
    return Envelope.planned(TITLE, command, plan, started_at, machine, ("torch",))


def to_markdown(
    plan: Plan,
    started_at: datetime,
    machine: Machine,
    rows: Sequence[Row],
    reduces: Sequence[AllReduceRow],
    command: str,
) -> str:
    lines = [
        "| TP | concurrency | output tok/s | mean forward ms | device busy | tok/s vs TP 1 "
        "| forward ms vs TP 1 | failed |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        tok, fwd = versus_tp1(rows, r)
        cells = [
            str(r.tp),
            str(r.concurrency),
            number(r.output_tokens_per_s, 1),
            number(r.mean_forward_ms, 2),
            number(r.device_busy_fraction, 3),
            times(tok),
            times(fwd),
            str(r.failed),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        f"All-reduce alone (gloo, 2 processes, float32 [tokens, {TINY_CONFIG.hidden_size}], median of "
        f"{plan.repeats}):",
        "",
        "| tokens | one all-reduce µs | per layer (2) µs | per tiny step (8) ms |",
        "|---:|---:|---:|---:|",
    ]
    for a in reduces:
        lines.append(f"| {a.tokens} | {a.median_us:,.1f} | {a.per_layer_us:,.1f} | {a.per_step_ms:,.3f} |")
    lines += [
        "",
        f"- workload: loadgen's random dataset, {plan.input_len} prompt tokens, exactly {plan.output_len} "
        f"new tokens, {plan.prompts_per_concurrency} x concurrency requests as a closed loop, one gRPC "
        "connection; a fresh `--tp N` worker and overlap scheduler per TP size",
        "- on the CPU the ranks share the machine's cores with each other (one thread each at TP 2, "
        "the cores split between them), with the scheduler and with the load generator: TP buys "
        "memory (each rank holds half the heads and half the KV), not speed, here",
    ]
    return envelope(plan, started_at, machine, command).markdown(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.tensor_parallel")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    started_at, machine = begin()
    rows = [row for tp in TP_SIZES for row in serve_rows(plan, tp)]
    reduces = all_reduce_rows(plan)
    command = command_line("bench.tensor_parallel", argv)
    document = envelope(plan, started_at, machine, command).json(
        {
            "rows": [{**asdict(r), "versus_tp1": versus_tp1(rows, r)} for r in rows],
            "all_reduce": [
                {**asdict(a), "per_layer_us": a.per_layer_us, "per_step_ms": a.per_step_ms} for a in reduces
            ],
        }
    )
    publish(
        NAME, started_at, document, to_markdown(plan, started_at, machine, rows, reduces, command), args.out
    )


if __name__ == "__main__":
    main()
