"""A run's ratios, its JSON document and its markdown tables."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from bench.cells import NONE, number
from bench.configs import Case, Device, Mode, Transport
from bench.envelope import Envelope
from bench.figures import ratio
from bench.harness import CaseResult, RunResult


@dataclass(frozen=True)
class Ratios:
    device: str
    overlap_over_serial_tokens_per_s: float | None  # both over gRPC
    grpc_over_in_process_tokens_per_s: float | None  # both overlap
    overlap_over_serial_ttft_p50: float | None  # both over gRPC
    late_pick_overlap_over_serial_ttft_p50: float | None  # overlap with --late-pick


def find(
    results: Iterable[CaseResult], device: str, mode: Mode, transport: Transport, late_pick: bool = False
) -> CaseResult | None:
    for result in results:
        c = result.case.configuration
        if (c.device.name, c.mode, c.transport) == (device, mode, transport) and (
            mode == "serial" or c.late_pick == late_pick
        ):
            return result
    return None


def device_ratios(results: Sequence[CaseResult], device: str) -> Ratios:
    serial = find(results, device, "serial", "grpc")
    overlap = find(results, device, "overlap", "grpc")
    in_process = find(results, device, "overlap", "in-process")
    late = find(results, device, "overlap", "grpc", late_pick=True)
    return Ratios(
        device=device,
        overlap_over_serial_tokens_per_s=ratio(_tokens_per_s(overlap), _tokens_per_s(serial)),
        grpc_over_in_process_tokens_per_s=ratio(_tokens_per_s(overlap), _tokens_per_s(in_process)),
        overlap_over_serial_ttft_p50=ratio(_ttft_p50(overlap), _ttft_p50(serial)),
        late_pick_overlap_over_serial_ttft_p50=ratio(_ttft_p50(late), _ttft_p50(serial)),
    )


def _tokens_per_s(result: CaseResult | None) -> float | None:
    return None if result is None else result.figures.output_tokens_per_s


def _ttft_p50(result: CaseResult | None) -> float | None:
    return None if result is None else result.figures.ttft_p50_ms


def devices(results: Iterable[CaseResult]) -> list[Device]:
    """Each device once, in order of first appearance."""
    seen: dict[str, Device] = {}
    for result in results:
        seen.setdefault(result.case.configuration.device.name, result.case.configuration.device)
    return list(seen.values())


def all_ratios(run: RunResult) -> list[Ratios]:
    return [device_ratios(run.cases, device.name) for device in devices(run.cases)]


def largest_busy_concurrency(points: Iterable[CaseResult], mode: Mode, target: float) -> int | None:
    """The largest swept concurrency at which `mode` kept the device busy at least `target` of the time."""
    busy = [
        p.case.workload.concurrency
        for p in points
        if p.case.configuration.mode == mode
        and p.figures.device_busy_fraction is not None
        and p.figures.device_busy_fraction >= target
    ]
    return max(busy, default=None)


# ---- JSON -----------------------------------------------------------------------------------


def envelope(run: RunResult, command: str) -> Envelope:
    """The frame: the JSON names the plan only (its cases are the configurations)."""
    name = run.plan.name
    return Envelope(
        "Stepahead benchmark",
        command,
        name,
        name,
        run.started_at,
        run.machine,
        load_after=run.load_average_after,
    )


def to_json(run: RunResult, command: str) -> dict[str, Any]:
    sweep = run.plan.sweep
    return envelope(run, command).json(
        {
            "configurations": [_case_json(r) for r in run.cases],
            "ratios": [asdict(r) for r in all_ratios(run)],
            "poisson_arrivals": {
                "configurations": [_case_json(r) for r in run.arrivals],
                "ratios": asdict(device_ratios(run.arrivals, run.arrivals[0].case.configuration.device.name))
                if run.arrivals
                else None,
            },
            "sweep": {
                "device": None if sweep is None else _device_json(sweep.device),
                "busy_target": run.plan.busy_target,
                "overlap_largest_busy_concurrency": largest_busy_concurrency(
                    run.sweep, "overlap", run.plan.busy_target
                ),
                "overlap_over_serial_tokens_per_s": {
                    str(concurrency): sweep_ratio(run.sweep, concurrency)
                    for concurrency in concurrencies(run.sweep)
                },
                "points": [_case_json(r) for r in run.sweep],
            },
        }
    )


def concurrencies(points: Iterable[CaseResult]) -> list[int]:
    return sorted({p.case.workload.concurrency for p in points})


def sweep_ratio(points: Sequence[CaseResult], concurrency: int) -> float | None:
    """Overlap / serial output tokens/s at one swept concurrency."""
    return ratio(
        _tokens_per_s(_at(points, "overlap", concurrency)), _tokens_per_s(_at(points, "serial", concurrency))
    )


def _device_json(device: Device) -> dict[str, Any]:
    return {"name": device.name, "worker_args": list(device.worker_args), "sim_step_ms": device.sim_step_ms}


def _case_json(result: CaseResult) -> dict[str, Any]:
    c, w = result.case.configuration, result.case.workload
    return {
        "name": c.name,
        "device": _device_json(c.device),
        "mode": c.mode,
        "transport": c.transport,
        "late_pick": c.late_pick,
        "frontends": c.frontends,
        "shares_process": c.shares_process,
        "workload": {**asdict(w), "input_bounds": w.input_bounds, "output_bounds": w.output_bounds},
        "figures": asdict(result.figures),
    }


# ---- markdown -------------------------------------------------------------------------------


def to_markdown(run: RunResult, command: str, sweep_image: str | None) -> str:
    lines = [
        *configurations_table(run.cases),
        "",
        *workload_lines(run.cases),
        "",
        *ratios_table(all_ratios(run)),
    ]
    if run.sweep:
        lines += ["", *sweep_section(run, sweep_image)]
    if run.arrivals:
        lines += ["", *arrivals_section(run.arrivals)]
    failures = failure_lines((*run.cases, *run.sweep))
    if failures:
        lines += ["", *failures]
    return envelope(run, command).markdown(lines)


def failure_lines(results: Iterable[CaseResult]) -> list[str]:
    """Figures cover completed requests only: a run with failures is flagged."""
    return [
        f"**{r.figures.failed} of {r.figures.failed + r.figures.completed} requests failed** in "
        f"{r.case.configuration.name} at concurrency {r.case.workload.concurrency}."
        for r in results
        if r.figures.failed
    ]


def configurations_table(results: Sequence[CaseResult]) -> list[str]:
    header = (
        "| configuration | output tok/s | of ideal | device busy | step ms | forward ms | gap p50 / mean ms "
        "| TTFT p50 / p99 ms | ITL p50 / p99 ms | scheduler CPU ms/step | worker CPU ms/step "
        "| client CPU ms/step |"
    )
    rows = [_configuration_row(r) for r in results]
    lines = [header, "|---|" + "---:|" * 11, *rows]
    if any(r.case.configuration.shares_process for r in results):
        lines += ["", "\\* one process: the scheduler's CPU time includes the worker engine's threads."]
    return lines


def _configuration_row(result: CaseResult) -> str:
    f, shared = result.figures, result.case.configuration.shares_process
    scheduler_cpu = number(f.scheduler_cpu_ms_per_step, 2) + (" \\*" if shared else "")
    cells = [
        result.case.configuration.name,
        number(f.output_tokens_per_s, 0),
        number(f.fraction_of_ideal, 3),
        number(f.device_busy_fraction, 3),
        number(f.step_ms, 2),
        number(f.mean_forward_ms, 2),
        f"{number(f.median_device_gap_ms, 2)} / {number(f.mean_device_gap_ms, 2)}",
        f"{number(f.ttft_p50_ms, 1)} / {number(f.ttft_p99_ms, 1)}",
        f"{number(f.itl_p50_ms, 1)} / {number(f.itl_p99_ms, 1)}",
        scheduler_cpu,
        number(f.worker_cpu_ms_per_step, 2) if not shared else "in scheduler",
        number(f.client_cpu_ms_per_step, 2),
    ]
    return "| " + " | ".join(cells) + " |"


def workload_lines(results: Sequence[CaseResult]) -> list[str]:
    described: dict[str, str] = {}
    for result in results:
        device = result.case.configuration.device
        described.setdefault(device.name, f"- {device.name}: {describe_workload(result.case)}")
    return list(described.values())


def describe_workload(case: Case) -> str:
    w, device = case.workload, case.configuration.device
    (input_low, input_high), (output_low, output_high) = w.input_bounds, w.output_bounds
    step = f", device step {device.sim_step_ms:g} ms" if device.sim_step_ms is not None else ""
    ideal = device.ideal_tokens_per_s(w.concurrency)
    ideal_text = "" if ideal is None else f"; ideal {ideal:,.0f} tok/s (concurrency / step time)"
    return (
        f"{w.num_prompts} requests, concurrency {w.concurrency}, input {input_low}-{input_high}, "
        f"output {output_low}-{output_high} tokens (ignore_eos){step}; warmup {w.warmup_prompts} x "
        f"{w.warmup_output_len} tokens{ideal_text}"
    )


def ratios_table(ratios: Sequence[Ratios]) -> list[str]:
    lines = [
        "| device | overlap / serial tok/s | gRPC / in-process tok/s (overlap) | overlap / serial TTFT p50 "
        "| late-pick overlap / serial TTFT p50 |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in ratios:
        cells = (
            number(r.overlap_over_serial_tokens_per_s, 3),
            number(r.grpc_over_in_process_tokens_per_s, 3),
            number(r.overlap_over_serial_ttft_p50, 3),
            number(r.late_pick_overlap_over_serial_ttft_p50, 3),
        )
        lines.append(f"| {r.device} | " + " | ".join(cells) + " |")
    return lines


def arrivals_section(results: Sequence[CaseResult]) -> list[str]:
    w = results[0].case.workload
    (output_low, output_high) = w.output_bounds
    lines = [
        f"Time to first token under Poisson arrivals ({w.request_rate:g} requests/s, {w.num_prompts} "
        f"requests, output {output_low}-{output_high} tokens):",
        "",
        "| configuration | output tok/s | device busy | TTFT p50 / p99 ms | ITL p50 / p99 ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in results:
        f = r.figures
        cells = (
            r.case.configuration.name,
            number(f.output_tokens_per_s, 0),
            number(f.device_busy_fraction, 3),
            f"{number(f.ttft_p50_ms, 1)} / {number(f.ttft_p99_ms, 1)}",
            f"{number(f.itl_p50_ms, 1)} / {number(f.itl_p99_ms, 1)}",
        )
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def sweep_section(run: RunResult, sweep_image: str | None) -> list[str]:
    target = run.plan.busy_target
    largest = largest_busy_concurrency(run.sweep, "overlap", target)
    lines = [
        f"Sweep ({describe_sweep(run)}):",
        "",
        *sweep_table(run.sweep),
        "",
        f"Largest concurrency at which overlap keeps the device >= {target:g} busy: "
        f"{NONE if largest is None else largest}.",
    ]
    if sweep_image is not None:
        lines += ["", f"![sweep]({sweep_image})"]
    return lines


def describe_sweep(run: RunResult) -> str:
    sweep = run.plan.sweep
    if sweep is None or not run.sweep:
        return ""
    (input_low, input_high) = run.sweep[0].case.workload.input_bounds
    (output_low, output_high) = run.sweep[0].case.workload.output_bounds
    step = "" if sweep.device.sim_step_ms is None else f", device step {sweep.device.sim_step_ms:g} ms"
    return (
        f"{sweep.device.name}{step}, serial and overlap over gRPC, "
        f"{sweep.prompts_per_concurrency} x concurrency requests, input {input_low}-{input_high}, "
        f"output {output_low}-{output_high}"
    )


def sweep_table(points: Sequence[CaseResult]) -> list[str]:
    lines = [
        "| concurrency | ideal tok/s | serial tok/s | overlap tok/s | overlap / serial "
        "| serial busy | overlap busy |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    return lines + [_sweep_row(points, concurrency) for concurrency in concurrencies(points)]


def _sweep_row(points: Sequence[CaseResult], concurrency: int) -> str:
    serial, overlap = _at(points, "serial", concurrency), _at(points, "overlap", concurrency)
    device = next(p for p in points if p.case.workload.concurrency == concurrency).case.configuration.device
    cells = (
        str(concurrency),
        number(device.ideal_tokens_per_s(concurrency), 0),
        number(_tokens_per_s(serial), 0),
        number(_tokens_per_s(overlap), 0),
        number(sweep_ratio(points, concurrency), 3),
        number(None if serial is None else serial.figures.device_busy_fraction, 3),
        number(None if overlap is None else overlap.figures.device_busy_fraction, 3),
    )
    return "| " + " | ".join(cells) + " |"


def _at(points: Iterable[CaseResult], mode: Mode, concurrency: int) -> CaseResult | None:
    for p in points:
        if p.case.configuration.mode == mode and p.case.workload.concurrency == concurrency:
            return p
    return None
