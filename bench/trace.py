"""Record a short load in each mode and draw serial and overlap one above the other.

    python -m bench.trace [--out traces] [--png docs/images/timeline.png]

Writes, per mode, the scheduler's and the worker's Chrome trace files, a merged
`<mode>.json` (both processes on one clock; open it in Perfetto), and one PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import pathlib
from dataclasses import dataclass
from typing import Any

import grpc
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.patches import Rectangle

from stepahead.processes import serving_pair
from stepahead.v1 import generation_pb2 as pb
from stepahead.v1 import generation_pb2_grpc

WORKER_ARGS = ["--model", "sim", "--sim-step-ms", "8", "--sim-token-us", "0"]
PHASE_COLORS = {"pick": "#4c72b0", "launch": "#55a868", "wait": "#dddddd", "process": "#dd8452"}
LANES = ("scheduler", "device", "copy")
WINDOW_STEPS = 6


@dataclass(frozen=True)
class Span:
    lane: str
    name: str
    start_ms: float
    end_ms: float


async def load(address: str) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        sampling = pb.SamplingParams(max_new_tokens=40, ignore_eos=True)

        async def one(i: int) -> None:
            async for _ in stub.Generate(pb.GenerateRequest(text=f"trace {i}", sampling=sampling)):
                pass

        await asyncio.gather(*(one(i) for i in range(32)))


def record(mode: str, out: pathlib.Path) -> pathlib.Path:
    scheduler_file, worker_file = out / f"scheduler-{mode}.json", out / f"worker-{mode}.json"
    with serving_pair(
        [*WORKER_ARGS, "--trace-file", str(worker_file)],
        ["--mode", mode, "--trace-file", str(scheduler_file)],
    ) as (_, scheduler):
        asyncio.run(load(scheduler.address))
    merged = out / f"{mode}.json"
    merged.write_text(json.dumps(merge(scheduler_file, worker_file)))
    return merged


def merge(scheduler_file: pathlib.Path, worker_file: pathlib.Path) -> list[dict[str, Any]]:
    """Both files' events, the worker's shifted onto the scheduler's clock."""
    scheduler_events = json.loads(scheduler_file.read_text())
    offsets = [e["args"]["seconds"] for e in scheduler_events if e["name"] == "worker_clock_offset"]
    shift_us = offsets[-1] * 1e6 if offsets else 0.0
    worker_events = json.loads(worker_file.read_text())
    for event in worker_events:
        if "ts" in event:
            event["ts"] -= shift_us
    return list(scheduler_events) + list(worker_events)


def steady_window(events: list[dict[str, Any]]) -> list[Span]:
    """A few consecutive steps from the middle of the run, in ms from their start."""
    forwards = sorted(
        (e for e in events if e["ph"] == "X" and e["name"].startswith("forward ")), key=lambda e: e["ts"]
    )
    middle = forwards[len(forwards) // 2 : len(forwards) // 2 + WINDOW_STEPS]
    t0, t1 = middle[0]["ts"] - 2000, middle[-1]["ts"] + middle[-1]["dur"]
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    return [
        Span(lanes[(e["pid"], e["tid"])], e["name"], (e["ts"] - t0) / 1e3, (e["ts"] + e["dur"] - t0) / 1e3)
        for e in events
        if e["ph"] == "X" and e["ts"] < t1 and e["ts"] + e["dur"] > t0
    ]


def draw(ax: Axes, spans: list[Span], title: str) -> None:
    rows = {lane: i for i, lane in enumerate(reversed(LANES))}
    for s in spans:
        kind = s.name.split()[0]
        color = PHASE_COLORS.get(kind, "#8172b3" if s.lane == "device" else "#937860")
        ax.barh(
            rows[s.lane],
            s.end_ms - s.start_ms,
            left=s.start_ms,
            height=0.6,
            color=color,
            edgecolor="black",
            linewidth=0.3,
        )
        if s.lane == "device" or kind == "process":
            ax.text((s.start_ms + s.end_ms) / 2, rows[s.lane], s.name, ha="center", va="center", fontsize=6)
    _shade_device_idle(ax, spans, rows["device"])
    ax.set_yticks(list(rows.values()), [f"{lane}" for lane in rows])
    ax.set_title(title, fontsize=9, loc="left")


def _shade_device_idle(ax: Axes, spans: list[Span], row: int) -> None:
    forwards = sorted((s for s in spans if s.lane == "device"), key=lambda s: s.start_ms)
    for before, after in itertools.pairwise(forwards):
        if after.start_ms > before.end_ms:
            ax.barh(
                row,
                after.start_ms - before.end_ms,
                left=before.end_ms,
                height=0.6,
                color="#ff000040",
                hatch="///",
                edgecolor="red",
                linewidth=0,
            )


def plot(serial: pathlib.Path, overlap: pathlib.Path, png: pathlib.Path) -> None:
    fig, axes = plt.subplots(2, 1, figsize=(11, 4.2), sharex=True)
    for ax, path, title in (
        (axes[0], serial, "serial: process k, then pick and launch k+1"),
        (axes[1], overlap, "overlap: launch k, then process k-1 while the device runs k"),
    ):
        draw(ax, steady_window(json.loads(path.read_text())), title)
    axes[1].set_xlabel("ms (sim device, 8 ms per step; hatched red: device idle while requests wait)")
    handles = [Rectangle((0, 0), 1, 1, color=c) for c in PHASE_COLORS.values()]
    fig.legend(handles, list(PHASE_COLORS), loc="upper right", fontsize=7, ncols=4)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=140)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.trace")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("traces"))
    p.add_argument("--png", type=pathlib.Path, default=pathlib.Path("docs/images/timeline.png"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    merged = {mode: record(mode, args.out) for mode in ("serial", "overlap")}
    plot(merged["serial"], merged["overlap"], args.png)
    print(
        f"traces in {args.out}/ (open serial.json / overlap.json in https://ui.perfetto.dev); "
        f"picture: {args.png}"
    )


if __name__ == "__main__":
    main()
