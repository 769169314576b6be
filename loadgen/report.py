"""The end-of-run summary: a table for people and a JSON file keyed like `vllm bench serve`'s."""

from __future__ import annotations

import json
import math
from pathlib import Path

from loadgen.benchmark import BenchmarkResult
from loadgen.stats import Distribution, Summary, inter_token_latencies, time_to_first_token

WIDTH = 50
LABEL_WIDTH = 40
LATENCY_SECTIONS = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)
STAT_NAMES = ("mean", "median", "std", "p90", "p99")


def format_summary(result: BenchmarkResult) -> str:
    lines = [" Serving Benchmark Result ".center(WIDTH, "=")]
    lines += _count_lines(result)
    lines += _throughput_lines(result.summary)
    for key, short, title in LATENCY_SECTIONS:
        lines.append(f" {title} ".center(WIDTH, "-"))
        lines += _latency_lines(getattr(result.summary, key), short)
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def _row(label: str, value: object) -> str:
    text = f"{value:.2f}" if isinstance(value, float) else str(value)
    return f"{label + ':':<{LABEL_WIDTH}}{text}"


def _count_lines(result: BenchmarkResult) -> list[str]:
    s, config = result.summary, result.config
    lines = [_row("Backend", _backend_text(result))]
    lines += [_row("Successful requests", s.completed), _row("Failed requests", s.failed)]
    lines += [_row(f"  {name}", count) for name, count in sorted(s.errors.items())]
    if result.interrupted:
        lines.append(_row("Interrupted", "yes (in-flight requests cancelled)"))
    if result.warmup_failed:
        lines.append(_row("Failed warmup requests", result.warmup_failed))
    if config.max_concurrency is not None:
        lines.append(_row("Maximum request concurrency", config.max_concurrency))
    lines.append(_row("Peak concurrent requests", s.peak_concurrency))
    return lines


def _backend_text(result: BenchmarkResult) -> str:
    backend = result.config.backend
    return backend if result.model is None else f"{backend} (model {result.model})"


def _throughput_lines(s: Summary) -> list[str]:
    lines = [
        _row("Benchmark duration (s)", s.duration_s),
        _row("Total input tokens", s.total_input_tokens),
        _row("Total generated tokens", s.total_output_tokens),
        _row("Request throughput (req/s)", s.request_throughput),
    ]
    if s.request_goodput is not None:
        lines.append(_row("Request goodput (req/s)", s.request_goodput))
    lines.append(_row("Output token throughput (tok/s)", s.output_throughput))
    lines.append(_row("Total token throughput (tok/s)", s.total_token_throughput))
    return lines


def _latency_lines(d: Distribution, short: str) -> list[str]:
    if d.count == 0:
        return [_row(f"{short} (ms)", "n/a (no samples)")]
    return [
        _row(f"Mean {short} (ms)", d.mean),
        _row(f"Median {short} (ms)", d.median),
        _row(f"P90 {short} (ms)", d.p90),
        _row(f"P99 {short} (ms)", d.p99),
    ]


def result_json(result: BenchmarkResult, detailed: bool = False) -> dict[str, object]:
    data = _header_json(result) | _summary_json(result.summary)
    if detailed:
        data |= _per_request_json(result)
    return data


def _header_json(result: BenchmarkResult) -> dict[str, object]:
    config = result.config
    rate = config.request_rate
    return {
        "date": result.started_at.strftime("%Y%m%d-%H%M%S"),
        "backend": config.backend,
        "server": config.target,
        "model": result.model,
        "num_prompts": config.num_prompts,
        "request_rate": rate if math.isfinite(rate) else "inf",
        "burstiness": config.burstiness,
        "max_concurrency": config.max_concurrency,
        "connections": config.connection_limit,
        "interrupted": result.interrupted,
    }


def _summary_json(s: Summary) -> dict[str, object]:
    data: dict[str, object] = {
        "duration": s.duration_s,
        "completed": s.completed,
        "failed": s.failed,
        "total_input_tokens": s.total_input_tokens,
        "total_output_tokens": s.total_output_tokens,
        "request_throughput": s.request_throughput,
    }
    if s.request_goodput is not None:
        data["request_goodput"] = s.request_goodput
    data |= {
        "output_throughput": s.output_throughput,
        "total_token_throughput": s.total_token_throughput,
        "peak_concurrency": s.peak_concurrency,
    }
    for key, _, _ in LATENCY_SECTIONS:
        data |= _distribution_json(key, getattr(s, key))
    return data | {"errors": dict(s.errors), "finish_reasons": dict(s.finish_reasons)}


def _distribution_json(key: str, d: Distribution) -> dict[str, object]:
    return {f"{stat}_{key}_ms": getattr(d, stat) for stat in STAT_NAMES}


def _per_request_json(result: BenchmarkResult) -> dict[str, object]:
    """Per request in issue order; a request without tokens has TTFT 0 and output length 0."""
    records = result.records
    return {
        "input_lens": [r.input_len for r in records],
        "output_lens": [r.output_len if r.ok else 0 for r in records],
        "ttfts": [(time_to_first_token(r) or 0.0) if r.ok else 0.0 for r in records],
        "itls": [inter_token_latencies(r) if r.ok else [] for r in records],
        "request_errors": [_error_text(r.error, r.error_detail) for r in records],
    }


def _error_text(status: str | None, detail: str) -> str:
    if status is None:
        return ""
    return f"{status}: {detail}" if detail else status


def write_result(path: Path, result: BenchmarkResult, detailed: bool = False) -> None:
    path.write_text(json.dumps(result_json(result, detailed)) + "\n", encoding="utf-8")
