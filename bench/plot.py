"""The sweep as a PNG: output tokens/s and device busy fraction against concurrency, both modes."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

from bench.configs import MODES, Mode
from bench.harness import CaseResult

MODE_STYLE = {"serial": {"color": "#dd8452", "marker": "o"}, "overlap": {"color": "#4c72b0", "marker": "s"}}


def plot_sweep(points: Sequence[CaseResult], busy_target: float, path: Path) -> None:
    figure, (throughput, busy) = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode in MODES:
        concurrencies, results = _series(points, mode)
        throughput.plot(
            concurrencies, [r.figures.output_tokens_per_s for r in results], label=mode, **MODE_STYLE[mode]
        )
        busy.plot(
            concurrencies,
            [r.figures.device_busy_fraction or 0.0 for r in results],
            label=mode,
            **MODE_STYLE[mode],
        )
    _draw_ideal(throughput, points)
    busy.axhline(busy_target, color="#999999", linestyle=":", label=f"{busy_target:g}")
    concurrencies = sorted({p.case.workload.concurrency for p in points})
    _label(throughput, "output tokens/s (log scale)", concurrencies)
    _log_tokens_axis(throughput)
    _label(busy, "device busy fraction", concurrencies)
    busy.set_ylim(0, 1.02)
    figure.suptitle(_title(points))
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _series(points: Sequence[CaseResult], mode: Mode) -> tuple[list[int], list[CaseResult]]:
    chosen = sorted(
        (p for p in points if p.case.configuration.mode == mode), key=lambda p: p.case.workload.concurrency
    )
    return [p.case.workload.concurrency for p in chosen], chosen


def _draw_ideal(axes: Axes, points: Sequence[CaseResult]) -> None:
    ideal = sorted(
        {
            (p.case.workload.concurrency, bound)
            for p in points
            if (bound := p.case.configuration.device.ideal_tokens_per_s(p.case.workload.concurrency))
            is not None
        }
    )
    if ideal:
        axes.plot(*zip(*ideal, strict=True), color="#999999", linestyle="--", label="ideal")


def _label(axes: Axes, ylabel: str, concurrencies: list[int]) -> None:
    axes.set_xscale("log", base=2)
    axes.set_xticks(concurrencies, [str(c) for c in concurrencies])
    axes.xaxis.set_minor_locator(NullLocator())
    axes.set_xlabel("concurrency")
    axes.set_ylabel(ylabel)
    axes.grid(True, alpha=0.3)
    axes.legend()


def _log_tokens_axis(axes: Axes) -> None:
    """Log scale: equal ratios look equal at every concurrency, and the ideal is a straight line."""
    axes.set_yscale("log")
    axes.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    axes.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:,.0f}"))
    axes.yaxis.set_minor_locator(NullLocator())


def _title(points: Sequence[CaseResult]) -> str:
    if not points:
        return "sweep"
    device = points[0].case.configuration.device
    step = "" if device.sim_step_ms is None else f", device step {device.sim_step_ms:g} ms"
    return f"{device.name}{step}: serial vs overlap over gRPC"
