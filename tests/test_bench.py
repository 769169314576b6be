"""The benchmark harness: metric arithmetic, ratios, rendering, and one small run end to end."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import fields, replace
from datetime import UTC, datetime
from pathlib import Path

import pytest

from bench import (
    core_cpu,
    engine_decode,
    frontends,
    link_delay,
    load_memory,
    machine,
    overlap_depth,
    paired,
    prefix_cache,
    sampling_cost,
    smollm2_serving,
    speculative,
    structured,
    tensor_parallel,
)
from bench import run as bench_run
from bench.baseline import Baseline
from bench.configs import (
    SIM_KV_SLOTS,
    Case,
    Configuration,
    Mode,
    Plan,
    Sweep,
    Transport,
    Workload,
    side_by_side,
    sim,
)
from bench.figures import Figures, busy_fraction, figures, ratio
from bench.frontends import MESSAGES, Code, PointResult, cpu_figures, cpu_shares, ratio_table
from bench.frontends import QUICK as QUICK_FRONTENDS
from bench.frontends import table as frontends_table
from bench.harness import CaseResult, RunResult, run_plan
from bench.machine import REPO, Machine
from bench.promtext import delta, histogram_buckets, histogram_quantile, parse, total
from bench.report import device_ratios, largest_busy_concurrency, to_json, to_markdown
from bench.run import CLOCK_TICKS, Endpoints, GrpcClient, Measurement, children_cpu_s, cpu_used, measure
from bench.save import finite, save
from loadgen import BenchmarkConfig, Summary
from loadgen.stats import Distribution
from scheduler_svc.contract import FinishReason
from scheduler_svc.engine.policy import SchedulingPolicy
from scheduler_svc.engine.request import Request
from tests.live import wait_until
from worker_svc.grammar import GrammarError, MatcherTable, grammar_tokenizer
from worker_svc.loading import BYTE_TOKENIZER

INF = math.inf
BUCKETS = [(0.1, 2.0), (0.5, 6.0), (1.0, 8.0), (INF, 10.0)]  # 2 in (0, .1], 4 in (.1, .5], 2, 2 above 1


# ---- histogram quantile -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("q", "expected"),
    [
        (0.1, 0.05),  # rank 1 of 2 in the first bucket, which starts at 0
        (0.2, 0.1),  # rank 2: the first bucket's upper bound
        (0.5, 0.4),  # rank 5: 0.1 + (0.5 - 0.1) * (5 - 2) / 4
        (0.8, 1.0),  # rank 8: the top of (0.5, 1.0]
        (0.9, 1.0),  # rank 9 falls in +Inf: the last finite bound
        (1.0, 1.0),
    ],
)
def test_histogram_quantile_interpolates_like_promql(q: float, expected: float) -> None:
    assert histogram_quantile(q, BUCKETS) == pytest.approx(expected)


def test_histogram_quantile_with_everything_in_the_inf_bucket_is_the_last_finite_bound() -> None:
    assert histogram_quantile(0.5, [(0.1, 0.0), (1.0, 0.0), (INF, 3.0)]) == 1.0


def test_histogram_quantile_of_a_non_positive_first_bound_is_that_bound() -> None:
    assert histogram_quantile(0.5, [(0.0, 3.0), (1.0, 4.0), (INF, 4.0)]) == 0.0


@pytest.mark.parametrize(
    "buckets",
    [
        [(0.1, 0.0), (1.0, 0.0), (INF, 0.0)],  # an empty delta: no observation
        [],
        [(INF, 5.0)],  # a single bucket
        [(0.1, 1.0), (1.0, 2.0)],  # no +Inf bucket
    ],
)
def test_histogram_quantile_is_none_where_promql_gives_nan(buckets: list[tuple[float, float]]) -> None:
    assert histogram_quantile(0.5, buckets) is None


@pytest.mark.parametrize("q", [0.0, -0.1, 1.5])
def test_histogram_quantile_rejects_a_quantile_outside_0_1(q: float) -> None:
    with pytest.raises(ValueError, match="quantile"):
        histogram_quantile(q, BUCKETS)


# ---- scrapes and deltas -----------------------------------------------------------------------

WORKER_BEFORE = """\
# TYPE stepahead_device_busy_seconds counter
stepahead_device_busy_seconds_total{device="cpu",model="sim"} 1.5
# TYPE stepahead_device_idle_seconds counter
stepahead_device_idle_seconds_total{device="cpu",model="sim"} 0.5
# TYPE stepahead_device_gap_seconds histogram
stepahead_device_gap_seconds_bucket{device="cpu",le="0.001",model="sim"} 4.0
stepahead_device_gap_seconds_bucket{device="cpu",le="0.01",model="sim"} 5.0
stepahead_device_gap_seconds_bucket{device="cpu",le="+Inf",model="sim"} 6.0
stepahead_device_gap_seconds_count{device="cpu",model="sim"} 6.0
stepahead_device_gap_seconds_sum{device="cpu",model="sim"} 0.2
# TYPE stepahead_batches counter
stepahead_batches_total{device="cpu",forward_mode="decode",model="sim"} 90.0
stepahead_batches_total{device="cpu",forward_mode="mixed",model="sim"} 10.0
# TYPE process_cpu_seconds counter
process_cpu_seconds_total{device="cpu",model="sim"} 10.0
"""

WORKER_AFTER = """\
# TYPE stepahead_device_busy_seconds counter
stepahead_device_busy_seconds_total{device="cpu",model="sim"} 4.5
# TYPE stepahead_device_idle_seconds counter
stepahead_device_idle_seconds_total{device="cpu",model="sim"} 1.5
# TYPE stepahead_device_gap_seconds histogram
stepahead_device_gap_seconds_bucket{device="cpu",le="0.001",model="sim"} 4.0
stepahead_device_gap_seconds_bucket{device="cpu",le="0.01",model="sim"} 9.0
stepahead_device_gap_seconds_bucket{device="cpu",le="+Inf",model="sim"} 10.0
stepahead_device_gap_seconds_count{device="cpu",model="sim"} 10.0
stepahead_device_gap_seconds_sum{device="cpu",model="sim"} 0.3
# TYPE stepahead_batches counter
stepahead_batches_total{device="cpu",forward_mode="decode",model="sim"} 270.0
stepahead_batches_total{device="cpu",forward_mode="mixed",model="sim"} 30.0
# TYPE process_cpu_seconds counter
process_cpu_seconds_total{device="cpu",model="sim"} 10.6
"""

SCHEDULER_BEFORE = """\
# TYPE stepahead_step_phase_seconds histogram
stepahead_step_phase_seconds_count{mode="overlap",phase="launch"} 100.0
stepahead_step_phase_seconds_count{mode="overlap",phase="pick"} 101.0
stepahead_step_phase_seconds_sum{mode="overlap",phase="launch"} 0.1
stepahead_step_phase_seconds_sum{mode="overlap",phase="pick"} 0.2
# TYPE process_cpu_seconds counter
process_cpu_seconds_total{mode="overlap"} 3.0
"""

SCHEDULER_AFTER = """\
# TYPE stepahead_step_phase_seconds histogram
stepahead_step_phase_seconds_count{mode="overlap",phase="launch"} 300.0
stepahead_step_phase_seconds_count{mode="overlap",phase="pick"} 305.0
stepahead_step_phase_seconds_count{mode="overlap",phase="process"} 299.0
stepahead_step_phase_seconds_sum{mode="overlap",phase="launch"} 0.3
stepahead_step_phase_seconds_sum{mode="overlap",phase="pick"} 0.6
stepahead_step_phase_seconds_sum{mode="overlap",phase="process"} 0.5
# TYPE process_cpu_seconds counter
process_cpu_seconds_total{mode="overlap"} 4.0
"""


def test_delta_subtracts_each_series_and_counts_a_new_one_from_zero() -> None:
    change = delta(parse(SCHEDULER_BEFORE), parse(SCHEDULER_AFTER))
    assert total(change, "stepahead_step_phase_seconds_count", phase="launch") == 200
    assert total(change, "stepahead_step_phase_seconds_count", phase="process") == 299
    assert total(change, "process_cpu_seconds_total") == pytest.approx(1.0)


def test_total_sums_the_series_a_selector_matches_and_is_zero_for_none() -> None:
    after = parse(SCHEDULER_AFTER)
    assert total(after, "stepahead_step_phase_seconds_count") == 904
    assert total(after, "stepahead_step_phase_seconds_sum", phase="pick") == pytest.approx(0.6)
    assert total(after, "stepahead_step_phase_seconds_count", mode="overlap", phase="pick") == 305
    assert total(after, "stepahead_step_phase_seconds_count", phase="wait") == 0
    assert total(after, "no_such_metric") == 0


def test_histogram_buckets_of_a_delta_and_its_median() -> None:
    change = delta(parse(WORKER_BEFORE), parse(WORKER_AFTER))
    buckets = histogram_buckets(change, "stepahead_device_gap_seconds")
    assert buckets == [(0.001, 0.0), (0.01, pytest.approx(4.0)), (INF, pytest.approx(4.0))]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.001 + 0.009 * 2 / 4)


def test_histogram_buckets_add_up_series_bucket_by_bucket() -> None:
    text = """\
# TYPE h histogram
h_bucket{le="1.0",phase="a"} 1.0
h_bucket{le="+Inf",phase="a"} 2.0
h_bucket{le="1.0",phase="b"} 3.0
h_bucket{le="+Inf",phase="b"} 3.0
"""
    assert histogram_buckets(parse(text), "h") == [(1.0, 4.0), (INF, 5.0)]
    assert histogram_buckets(parse(text), "h", phase="b") == [(1.0, 3.0), (INF, 3.0)]


def test_busy_fraction() -> None:
    assert busy_fraction(3.0, 1.0) == 0.75
    assert busy_fraction(2.0, 0.0) == 1.0
    assert busy_fraction(0.0, 0.0) is None


def test_ratio_is_none_when_a_side_is_missing_or_the_denominator_zero() -> None:
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(None, 2.0) is None
    assert ratio(3.0, None) is None
    assert ratio(3.0, 0.0) is None


# ---- figures, ratios, rendering from fixed results --------------------------------------------

SIM = sim(10.0)
WORKLOAD = Workload(64, 16, 48, 192, 1 / 3, warmup_prompts=16)


def summary(output_throughput: float, ttft_p50_ms: float = 20.0) -> Summary:
    return Summary(
        completed=64,
        failed=0,
        duration_s=10.0,
        total_input_tokens=3072,
        total_output_tokens=round(output_throughput * 10),
        request_throughput=6.4,
        request_goodput=None,
        output_throughput=output_throughput,
        total_token_throughput=output_throughput + 307.2,
        peak_concurrency=16,
        ttft=Distribution(64, ttft_p50_ms, ttft_p50_ms, 1.0, ttft_p50_ms * 2, ttft_p50_ms * 3),
        tpot=Distribution(64, 11.0, 11.0, 0.5, 12.0, 13.0),
        itl=Distribution(12000, 11.0, 10.5, 0.5, 12.0, 14.0),
        e2el=Distribution(64, 2000.0, 2000.0, 10.0, 2100.0, 2200.0),
        errors={},
        finish_reasons={"LENGTH": 64},
    )


def measurement(output_throughput: float = 1200.0, client_cpu_s: float = 0.4) -> Measurement:
    return Measurement(
        summary(output_throughput),
        delta(parse(SCHEDULER_BEFORE), parse(SCHEDULER_AFTER)),
        delta(parse(WORKER_BEFORE), parse(WORKER_AFTER)),
        client_cpu_s,
    )


def test_figures_of_a_grpc_run() -> None:
    f = figures(Case(Configuration(SIM, "overlap", "grpc"), WORKLOAD), measurement())
    assert f.output_tokens_per_s == 1200
    assert f.ideal_tokens_per_s == pytest.approx(1600)  # 16 requests / 10 ms
    assert f.fraction_of_ideal == pytest.approx(0.75)
    assert f.device_busy_fraction == pytest.approx(3.0 / 4.0)
    assert f.median_device_gap_ms == pytest.approx(5.5)
    assert f.mean_device_gap_ms == pytest.approx(100 / 4)  # 0.1 s over 4 gaps
    assert f.mean_forward_ms == pytest.approx(3000 / 200)  # 3 s busy over 200 batches
    assert f.step_ms == pytest.approx(10_000 / 200)
    assert f.scheduler_phase_ms == pytest.approx({"pick": 2.0, "launch": 1.0, "wait": 0.0, "process": 2.5})
    assert f.steps == 200
    assert f.scheduler_cpu_ms_per_step == pytest.approx(1000 / 200)
    assert f.worker_cpu_ms_per_step == pytest.approx(600 / 200)
    assert f.client_cpu_ms_per_step == pytest.approx(400 / 200)
    assert f.tokens_per_step == pytest.approx(12000 / 200)
    assert (f.ttft_p50_ms, f.ttft_p99_ms, f.itl_p50_ms, f.itl_p99_ms) == (20.0, 60.0, 10.5, 14.0)


def test_figures_in_process_leave_the_worker_cpu_to_the_scheduler_column() -> None:
    f = figures(Case(Configuration(SIM, "overlap", "in-process"), WORKLOAD), measurement())
    assert f.worker_cpu_ms_per_step is None
    assert f.scheduler_cpu_ms_per_step == pytest.approx(5.0)


def result(mode: Mode, transport: Transport, tokens_per_s: float, ttft_p50_ms: float = 20.0) -> CaseResult:
    configuration = Configuration(SIM, mode, transport)
    case = Case(configuration, WORKLOAD)
    measured = replace(measurement(tokens_per_s), summary=summary(tokens_per_s, ttft_p50_ms))
    return CaseResult(case, figures(case, measured))


CASES = (
    result("serial", "grpc", 1000.0, ttft_p50_ms=20.0),
    result("overlap", "grpc", 1200.0, ttft_p50_ms=25.0),
    result("overlap", "in-process", 1500.0, ttft_p50_ms=22.0),
)


def test_ratios_of_a_device() -> None:
    r = device_ratios(CASES, "sim")
    assert r.overlap_over_serial_tokens_per_s == pytest.approx(1.2)
    assert r.grpc_over_in_process_tokens_per_s == pytest.approx(0.8)
    assert r.overlap_over_serial_ttft_p50 == pytest.approx(1.25)


def test_ratios_missing_a_configuration_are_none() -> None:
    r = device_ratios(CASES[:2], "sim")
    assert r.grpc_over_in_process_tokens_per_s is None
    assert device_ratios(CASES, "tiny").overlap_over_serial_tokens_per_s is None


def sweep_point(mode: Mode, concurrency: int, busy: float) -> CaseResult:
    workload = replace(WORKLOAD, concurrency=concurrency, num_prompts=4 * concurrency)
    base = result(mode, "grpc", 100.0 * concurrency)
    return CaseResult(
        Case(base.case.configuration, workload), replace(base.figures, device_busy_fraction=busy)
    )


SWEEP = (
    sweep_point("serial", 8, 0.8),
    sweep_point("serial", 64, 0.7),
    sweep_point("overlap", 8, 0.99),
    sweep_point("overlap", 64, 0.96),
    sweep_point("overlap", 128, 0.9),
)


def test_largest_busy_concurrency() -> None:
    assert largest_busy_concurrency(SWEEP, "overlap", 0.95) == 64
    assert largest_busy_concurrency(SWEEP, "serial", 0.95) is None
    assert largest_busy_concurrency(SWEEP, "serial", 0.7) == 64


def fixed_run() -> RunResult:
    plan = Plan("fixed", tuple(r.case for r in CASES), Sweep(SIM, (8, 64, 128), 4, 48, 192, 1 / 3))
    machine: Machine = {
        "nproc": 2,
        "cpu_model": "Test CPU",
        "python": "3.11.7",
        "torch": "2.13.0",
        "git_commit": "abc",
        "load_average_1m": 0.25,
    }
    return RunResult(plan, datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC), machine, 0.5, CASES, SWEEP)


def test_markdown_tables_of_a_fixed_result() -> None:
    text = to_markdown(fixed_run(), "python -m bench", "sweep.png")
    lines = text.splitlines()
    assert lines[0] == "# Stepahead benchmark, 2025-01-02 03:04 UTC"
    assert lines[2].endswith(
        "on 2 CPUs (Test CPU), Python 3.11.7, torch 2.13.0, commit abc; "
        "1-minute load average 0.25 before, 0.5 after."
    )
    assert (
        "| sim serial grpc | 1,000 | 0.625 | 0.750 | 50.00 | 15.00 | 5.50 / 25.00 | 20.0 / 60.0 "
        "| 10.5 / 14.0 | 5.00 | 3.00 | 2.00 |" in lines
    )
    assert (
        "| sim overlap in-process | 1,500 | 0.938 | 0.750 | 50.00 | 15.00 | 5.50 / 25.00 | 22.0 / 66.0 "
        "| 10.5 / 14.0 | 5.00 \\* | in scheduler | 2.00 |" in lines
    )
    assert "\\* one process: the scheduler's CPU time includes the worker engine's threads." in lines
    assert (
        "- sim: 64 requests, concurrency 16, input 32-64, output 128-256 tokens (ignore_eos), device step "
        "10 ms; warmup 16 x 8 tokens; ideal 1,600 tok/s (concurrency / step time)" in lines
    )
    assert "| sim | 1.200 | 0.800 | 1.250 | — |" in lines  # no late-pick configuration in this run
    assert "| 8 | 800 | 800 | 800 | 1.000 | 0.800 | 0.990 |" in lines
    assert "| 128 | 12,800 | — | 12,800 | — | — | 0.900 |" in lines
    assert "Largest concurrency at which overlap keeps the device >= 0.95 busy: 64." in lines
    assert lines[-1] == "![sweep](sweep.png)"
    assert "failed" not in text


def test_markdown_flags_failed_requests() -> None:
    run = fixed_run()
    failing = replace(run.cases[0], figures=replace(run.cases[0].figures, failed=3, completed=61))
    text = to_markdown(replace(run, cases=(failing, *run.cases[1:])), "python -m bench", None)
    assert text.splitlines()[-1] == "**3 of 64 requests failed** in sim serial grpc at concurrency 16."


def test_json_of_a_fixed_result_has_every_figure() -> None:
    document = json.loads(json.dumps(finite(to_json(fixed_run(), "python -m bench")), allow_nan=False))
    names = {f.name for f in fields(Figures)}
    assert [c["name"] for c in document["configurations"]] == [
        "sim serial grpc",
        "sim overlap grpc",
        "sim overlap in-process",
    ]
    assert all(set(c["figures"]) == names for c in document["configurations"] + document["sweep"]["points"])
    assert document["ratios"][0]["overlap_over_serial_tokens_per_s"] == pytest.approx(1.2)
    assert document["sweep"]["overlap_largest_busy_concurrency"] == 64
    assert document["sweep"]["overlap_over_serial_tokens_per_s"] == {"8": 1.0, "64": 1.0, "128": None}
    assert document["configurations"][0]["workload"]["output_bounds"] == [128, 256]


def test_finite_replaces_nan_and_infinity_by_none() -> None:
    assert finite({"a": [1.0, math.nan], "b": (math.inf, "x"), "c": 2}) == {
        "a": [1.0, None],
        "b": [None, "x"],
        "c": 2,
    }


# ---- end to end ------------------------------------------------------------------------------

SMOKE_DEVICE = sim(2.0)
SMOKE_WORKLOAD = Workload(8, 4, 16, 8, 0.0, warmup_prompts=2, warmup_output_len=2)
SMOKE = Plan(
    "smoke",
    (
        Case(Configuration(SMOKE_DEVICE, "serial", "grpc"), SMOKE_WORKLOAD),
        Case(Configuration(SMOKE_DEVICE, "overlap", "in-process"), SMOKE_WORKLOAD),
    ),
    Sweep(SMOKE_DEVICE, (4,), 2, 16, 8, 0.0),
)


def run_smoke(out: Path) -> None:
    """The smoke plan, saved under `out`. No time limit of its own: it takes about 20 s on a
    machine of this kind (longer on a slow or starved one), and pytest-timeout's per-test limit
    (pyproject.toml, 1800 s: far above, a hang guard) stops it if it hangs."""
    save(run_plan(SMOKE, progress=lambda _: None), "test", out, out / "docs.png")


def check_sane(configuration: dict[str, object]) -> None:
    f = configuration["figures"]
    assert isinstance(f, dict)
    name = configuration["name"]
    assert f["completed"] == 8 and f["failed"] == 0 and f["output_tokens"] == 64, name
    assert f["output_tokens_per_s"] > 0 and f["steps"] > 0, name
    assert 0 < f["device_busy_fraction"] <= 1, name
    assert 0 < f["fraction_of_ideal"] <= 1 and f["ideal_tokens_per_s"] == 4 * 1000 / 2, name
    assert f["median_device_gap_ms"] >= 0 and f["mean_device_gap_ms"] >= 0, name
    assert f["mean_forward_ms"] >= 2 and f["step_ms"] > 0, name  # the sim sleeps 2 ms a step
    assert set(f["scheduler_phase_ms"]) == {"pick", "launch", "wait", "process"}, name
    assert 0 < f["ttft_p50_ms"] <= f["ttft_p99_ms"] and 0 < f["itl_p50_ms"] <= f["itl_p99_ms"], name
    assert all(ms > 0 for ms in f["scheduler_phase_ms"].values()), name  # timed at microseconds
    # The scheduler's CPU is its process_cpu_seconds_total: whole clock ticks (10 ms), of which a
    # short run on a fast machine may take none; the load generator's is process_time's (ns).
    ticks = f["scheduler_cpu_ms_per_step"] * f["steps"] / 1e3 * CLOCK_TICKS
    assert ticks >= 0 and ticks == pytest.approx(round(ticks), abs=1e-6), name
    assert f["client_cpu_ms_per_step"] > 0, name
    in_process = configuration["transport"] == "in-process"
    assert (f["worker_cpu_ms_per_step"] is None) == in_process, name
    assert 0 < f["tokens_per_step"] <= 4, name


def test_smoke_run_end_to_end_on_sim(tmp_path: Path) -> None:
    run_smoke(tmp_path)
    stamped = [p for p in tmp_path.glob("*.json") if p.name != "latest.json"]
    assert len(stamped) == 1
    document = json.loads(stamped[0].read_text())
    assert document == json.loads((tmp_path / "latest.json").read_text())
    assert [c["name"] for c in document["configurations"]] == ["sim serial grpc", "sim overlap in-process"]
    assert [(p["mode"], p["workload"]["concurrency"]) for p in document["sweep"]["points"]] == [
        ("serial", 4),
        ("overlap", 4),
    ]
    for configuration in document["configurations"] + document["sweep"]["points"]:
        check_sane(configuration)
    assert set(document["machine"]) >= {
        "nproc",
        "cpu_model",
        "python",
        "torch",
        "git_commit",
        "load_average_1m",
    }
    assert document["load_average_1m_after"] >= 0
    assert document["machine"]["nproc"] >= 1
    assert document["ratios"][0]["overlap_over_serial_tokens_per_s"] is None  # no overlap over gRPC here
    assert document["ratios"][0]["overlap_over_serial_ttft_p50"] is None
    markdown = stamped[0].with_suffix(".md").read_text()
    assert markdown == (tmp_path / "latest.md").read_text()
    assert "| sim overlap in-process |" in markdown
    assert (tmp_path / f"{stamped[0].stem}-sweep.png").stat().st_size > 0
    assert (tmp_path / "docs.png").read_bytes() == (tmp_path / f"{stamped[0].stem}-sweep.png").read_bytes()


def test_side_by_side_includes_a_late_pick_overlap_and_tells_it_apart() -> None:
    cases = side_by_side(SIM, WORKLOAD)
    names = [c.configuration.name for c in cases]
    assert names == [
        "sim serial grpc",
        "sim overlap grpc",
        "sim overlap in-process",
        "sim overlap grpc, late pick",
    ]
    assert cases[1].configuration.scheduler_args == ("--mode", "overlap", "--no-late-pick")
    assert cases[3].configuration.scheduler_args == ("--mode", "overlap", "--late-pick")


# ---- frontends: CPU per token from metric deltas ----------------------------------------------

FRONTENDS_SCHEDULER_BEFORE = """\
# TYPE process_cpu_seconds counter
process_cpu_seconds_total{mode="overlap"} 2.0
# TYPE stepahead_frontend_cpu_seconds counter
stepahead_frontend_cpu_seconds_total{mode="overlap"} 1.0
# TYPE stepahead_generation_tokens counter
stepahead_generation_tokens_total{mode="overlap"} 500.0
"""

FRONTENDS_SCHEDULER_AFTER = """\
# TYPE process_cpu_seconds counter
process_cpu_seconds_total{mode="overlap"} 2.5
# TYPE stepahead_frontend_cpu_seconds counter
stepahead_frontend_cpu_seconds_total{mode="overlap"} 1.3
# TYPE stepahead_generation_tokens counter
stepahead_generation_tokens_total{mode="overlap"} 10500.0
"""


def frontends_measurement(
    duration_s: float = 10.0, children_cpu: dict[int, float] | None = None
) -> Measurement:
    """Over the run: core 0.5 s, frontends 0.3 s, worker 0.6 s, loadgen 0.2 s; 10,000 tokens."""
    return Measurement(
        replace(summary(1000.0), duration_s=duration_s),
        delta(parse(FRONTENDS_SCHEDULER_BEFORE), parse(FRONTENDS_SCHEDULER_AFTER)),
        delta(parse(WORKER_BEFORE), parse(WORKER_AFTER)),
        0.2,
        children_cpu or {},
    )


def test_cpu_figures_per_generated_token() -> None:
    c = cpu_figures(2, frontends_measurement(children_cpu={21: 0.12, 22: 0.18}), cpus=2)
    assert c.generated_tokens == 10_000
    assert c.core_us_per_token == pytest.approx(50.0)
    assert c.frontends_us_per_token == pytest.approx(30.0)
    assert c.scheduler_us_per_token == pytest.approx(80.0)
    assert c.worker_us_per_token == pytest.approx(60.0)
    assert c.loadgen_us_per_token == pytest.approx(20.0)
    assert c.cpus_used == pytest.approx(1.6 / 10.0)
    assert not c.box_bound
    assert c.frontend_shares == pytest.approx((0.6, 0.4))


def test_cpu_figures_with_the_frontend_in_the_core_and_a_saturated_box() -> None:
    c = cpu_figures(0, frontends_measurement(duration_s=0.8), cpus=2)
    assert c.frontends_us_per_token is None
    assert c.scheduler_us_per_token == pytest.approx(80.0)  # the metric's frontends, if any, still add up
    assert c.cpus_used == pytest.approx(2.0)
    assert c.box_bound


def test_cpu_figures_without_tokens_are_none() -> None:
    idle = Measurement(summary(0.0), {}, {}, 0.0)
    c = cpu_figures(1, idle, cpus=2)
    assert c.generated_tokens == 0
    assert (c.core_us_per_token, c.scheduler_us_per_token, c.loadgen_us_per_token) == (None, None, None)


def test_frontend_cpu_shares_from_proc(tmp_path: Path) -> None:
    def stat(pid: int, name: str, ppid: int, utime: int, stime: int) -> None:
        (tmp_path / str(pid)).mkdir()
        fields = ["S", str(ppid), *["0"] * 9, str(utime), str(stime), "0", "0"]
        (tmp_path / str(pid) / "stat").write_text(f"{pid} ({name}) {' '.join(fields)}\n")

    stat(11, "python -m x (frontend)", 7, 300, 100)
    stat(12, "python", 7, 50, 50)
    stat(13, "other", 8, 999, 999)
    before = children_cpu_s(7, tmp_path)
    assert before == {11: 400 / CLOCK_TICKS, 12: 100 / CLOCK_TICKS}
    after = {11: before[11] + 3.0, 12: before[12] + 1.0, 14: 5.0}  # 14 started meanwhile: not counted
    used = cpu_used(before, after)
    assert used == pytest.approx({11: 3.0, 12: 1.0})
    assert cpu_shares(used) == pytest.approx((0.75, 0.25))
    assert cpu_shares(cpu_used(before, before)) == () and cpu_shares({}) == ()


BUSY_CHILD = "while True: pass"


def test_measure_drives_both_runs_over_the_given_connections_and_reads_the_children_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    configs: list[BenchmarkConfig] = []

    def fake_loadgen(config: BenchmarkConfig) -> Summary:
        """While the busy child runs: until it has been charged another clock tick, so that its
        CPU time moves between the readings around the run, however the machine shares its CPUs."""
        configs.append(config)
        if child.poll() is None:
            ran = children_cpu_s(os.getpid())[child.pid]
            wait_until(lambda: children_cpu_s(os.getpid())[child.pid] > ran, "the busy child charged a tick")
        return summary(1000.0)

    monkeypatch.setattr(bench_run, "run_loadgen", fake_loadgen)
    monkeypatch.setattr(bench_run, "scrape", lambda url: {})
    child = subprocess.Popen([sys.executable, "-c", BUSY_CHILD])
    try:
        endpoints = Endpoints("127.0.0.1:1", "scheduler", "worker", scheduler_pid=os.getpid())
        measured = measure(endpoints, WORKLOAD, QUICK_FRONTENDS.connection_counts[-1])
    finally:
        child.kill()
        child.wait()
    assert [c.connections for c in configs] == [QUICK_FRONTENDS.connection_counts[-1]] * 2 == [8, 8]
    assert [c.num_prompts for c in configs] == [WORKLOAD.warmup_prompts, WORKLOAD.num_prompts]
    assert measured.summary == summary(1000.0)
    assert measured.scheduler_children_cpu_s[child.pid] > 0
    measure(Endpoints("127.0.0.1:1", "scheduler", "worker"), WORKLOAD)
    assert configs[-1].connections == 1  # the main plans' single frontend


def test_configuration_frontends_flag_only_when_not_the_default() -> None:
    assert Configuration(SIM, "overlap", "grpc").scheduler_args == ("--mode", "overlap", "--no-late-pick")
    zero = Configuration(SIM, "overlap", "grpc", frontends=0)
    assert zero.scheduler_args == ("--mode", "overlap", "--no-late-pick", "--frontends", "0")
    assert zero.name == "sim overlap grpc, frontends 0"


def test_frontends_table_row() -> None:
    case = Case(Configuration(SIM, "overlap", "grpc", frontends=0), QUICK_FRONTENDS.workload(16))
    measured = frontends_measurement(duration_s=0.8)
    result = PointResult(case, figures(case, measured), cpu_figures(0, measured, cpus=2))
    assert case.workload.num_prompts == 2 * 16 and case.workload.output_bounds == (128, 128)
    assert frontends_table([result])[2] == (
        "| current | 10 | 16 | 0 | 1 | 1,000 | 0.625 | 0.750 | 20.0 | 10.5 / 14.0 | 50.0 | in core | 80.0 "
        "| 60.0 | 20.0 | — | 2.00 † | — |"
    )


def test_frontends_messages_per_frontend_and_the_ratios_to_a_baseline() -> None:
    """Messages per second per frontend come from the frontends' counter (none from code that
    lacks it); each current point is set over the baseline's at the same point."""
    case = Case(Configuration(SIM, "overlap", "grpc", frontends=2), QUICK_FRONTENDS.workload(16))
    old = frontends_measurement()
    core_cpu = next(key for key in old.scheduler if key[0] == "process_cpu_seconds_total")
    scheduler = {**old.scheduler, (MESSAGES, frozenset({("mode", "overlap")})): 6000.0, core_cpu: 0.25}
    new = replace(old, scheduler=scheduler)
    assert cpu_figures(2, old).messages_per_s_per_frontend is None
    assert cpu_figures(2, new).messages_per_s_per_frontend == pytest.approx(300.0)
    runs: list[tuple[Measurement, Code]] = [(old, "baseline"), (new, "current")]
    results = [PointResult(case, figures(case, m), cpu_figures(2, m), 8, code) for m, code in runs]
    ratios = ratio_table(sorted(results, key=lambda r: r.point))
    assert ratios[4] == "| 10 | 16 | 2 | 8 | 0.69x | 0.50x | 1.00x | 1.00x | 1.00x | 1.00x |"
    assert ratio_table(results[1:]) == []


# ---- the worker's memory while it loads a model -------------------------------------------------


def test_load_memory_gives_a_peak_and_a_time_per_quantization(tmp_path: Path) -> None:
    small = ["--layers", "1", "--hidden", "64", "--intermediate", "128", "--vocab", "300"]
    load_memory.main([*small, "--out", str(tmp_path)])
    document = json.loads((tmp_path / "latest-load-memory.json").read_text())
    assert [(r["code"], r["quantization"]) for r in document["rows"]] == [
        ("this", "none"),
        ("this", "int8"),
        ("this", "int4"),
    ]
    assert all(
        r["peak_mib"] >= r["after_mib"] > r["model_mib"] > 0 and r["seconds"] > 0 for r in document["rows"]
    )
    assert document["parameters"] > 0 and document["file_mib"] > 0


def test_load_memory_of_a_tied_model_holds_its_8_bit_table_once(tmp_path: Path) -> None:
    """`--tied`: the embeddings are the head's Q8 blocks (`TiedInt8Embedding`); an untied model of
    the same sizes holds a second 8-bit table (a byte a weight) beside its head's."""
    vocab, hidden = 2048, 64
    small = ["--layers", "1", "--hidden", str(hidden), "--intermediate", "128", "--vocab", str(vocab)]
    held = {}
    for tied in (False, True):
        out = tmp_path / str(tied)
        load_memory.main([*small, "--modes", "int8", *(["--tied"] if tied else []), "--out", str(out)])
        document = json.loads((out / "latest-load-memory.json").read_text())
        assert document["tied"] is tied
        held[tied] = document["rows"][0]["model_mib"]
    assert held[False] - held[True] >= vocab * hidden / 2**20


# ---- engine core CPU per step ------------------------------------------------------------------


def test_core_cpu_gives_a_row_per_batch_size_and_path_with_positive_figures() -> None:
    """A small batch is run both ways, a row at a time (the policy's default) and a column at a
    time; larger ones a column at a time; then some again, each step after a sleep; then with
    requests that end and arrive."""
    run = core_cpu.run(core_cpu.CoreCpuConfig(steps=4, warmup_steps=1))
    assert [(r.batch_size, r.path) for r in run.rows] == [
        (4, "rows"),
        (4, "columns"),
        (16, "rows"),
        (16, "columns"),
        (64, "columns"),
        (128, "columns"),
        (256, "columns"),
        (512, "columns"),
        (4, "rows"),
        (64, "columns"),
        (256, "columns"),
        (256, "columns"),
        (256, "columns"),
    ]
    assert [r.idle_ms for r in run.rows] == [0.0] * 8 + [core_cpu.IDLE_MS[0]] * 3 + [0.0] * 2
    assert [r.output_len for r in run.rows] == [0] * 11 + list(core_cpu.TURNOVER_OUTPUTS)
    for r in run.rows:
        assert r.steps == 4 and r.us_per_step > 0 and r.us_per_step_mean > 0 and r.us_per_token > 0
        assert all(r.phase_us[p] > 0 for p in core_cpu.PHASES if p != "arrive" or r.output_len)
        assert r.launch_bytes > 0 and r.outputs_bytes > 0
        if not r.output_len:
            assert r.tokens_per_step == r.batch_size and r.phase_us["arrive"] == 0
    document = json.loads(json.dumps(finite(core_cpu.to_json(run, "test")), allow_nan=False))
    assert document["target"]["batch_size"] == 256 and document["target"]["met"] in (True, False)
    assert "| 256 | columns | 0 |" in core_cpu.to_markdown(run, "test")


def test_core_cpu_runs_each_idle_time_each_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """Idle rows come per idle time and batch size, each step after the idle time passed the
    config's way; `spin` passes it awake, `sleep` asleep."""
    args = core_cpu.parse_args(
        ["--batch-sizes", "4", "--idle-ms", "0.5,1", "--idle-batch-sizes", "4,64", "--idle", "spin"]
    )
    assert (args.idle_ms, args.idle_batch_sizes, args.idle) == ((0.5, 1.0), (4, 64), "spin")
    idled: list[tuple[str, float]] = []
    monkeypatch.setattr(core_cpu, "idle", lambda way, ms: idled.append((way, ms)))
    config = core_cpu.CoreCpuConfig(
        (4,), 3, 1, idle_batch_sizes=(4, 64), idle_ms=(0.5, 1.0), idle="spin", turnover_outputs=()
    )
    run = core_cpu.run(config)
    assert [(r.batch_size, r.idle_ms) for r in run.rows[2:]] == [(4, 0.5), (64, 0.5), (4, 1.0), (64, 1.0)]
    assert idled == [("spin", 0.5)] * 6 + [("spin", 1.0)] * 6  # before each measured step
    assert "spinning on the clock before each step" in core_cpu.to_markdown(run, "test")
    calibrated = dataclasses.replace(run, loop_s=(0.91, 1.02))
    assert "takes 0.91 s before the rows, 1.02 s after" in core_cpu.to_markdown(calibrated, "test")
    assert core_cpu.to_json(calibrated, "test")["loop_calibration_s"] == [0.91, 1.02]
    monkeypatch.undo()
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    core_cpu.idle("spin", 1.0)
    core_cpu.idle("sleep", 2.0)
    assert slept == [0.002]


def open_files() -> set[str]:
    """What this process has open."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor is gone
            found.add(os.readlink(f"/proc/self/fd/{fd}"))
    return found


def test_cpu_wake_latency_holds_the_request_for_the_block_and_reports_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The PM QoS request is written (a native int) and held open for the block only; without a
    value nothing is opened; where it cannot be opened the run stops naming the flag."""
    qos = tmp_path / "cpu_dma_latency"
    qos.write_bytes(b"")
    monkeypatch.setattr(machine, "CPU_DMA_LATENCY", qos)
    with machine.cpu_wake_latency(0):
        assert qos.read_bytes() == (0).to_bytes(4, sys.byteorder)
        assert str(qos) in open_files()  # held open: the request lasts while its file is open
    assert str(qos) not in open_files()  # dropped when the block ends
    qos.unlink()
    with machine.cpu_wake_latency(None):
        assert not qos.exists()
    with pytest.raises(SystemExit, match="--cpu-wake-latency-us: cannot open"), machine.cpu_wake_latency(5):
        pass
    assert core_cpu.parse_args(["--cpu-wake-latency-us", "0"]).cpu_wake_latency_us == 0
    assert frontends.parse_args([]).cpu_wake_latency_us is None
    assert machine.idle_policy(None, "haltpoll") == "the host's policy (cpuidle driver haltpoll)"
    assert "within 0 µs for the whole run" in machine.idle_policy(0, None)
    run = core_cpu.run(
        core_cpu.CoreCpuConfig((4,), 2, 1, idle_batch_sizes=(), turnover_outputs=(), wake_latency_us=0)
    )
    assert "- idle CPUs: held to states woken from within 0 µs" in core_cpu.to_markdown(run, "test")
    assert core_cpu.to_json(run, "test")["cpu_wake_latency_us"] == 0


def test_core_cpu_turnover_rows_end_and_start_requests_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each request of a turnover row generates exactly its output and ends; as many arrive,
    through the frontend link's wire form, under the arrive phase: about batch / output_len a
    step, every step. A request's turnover is its row's cost over the steady row's."""
    args = core_cpu.parse_args(["--turnover-outputs", "8,4", "--turnover-batch-sizes", "32"])
    assert (args.turnover_outputs, args.turnover_batch_sizes) == ((8, 4), (32,))
    added: list[int] = []
    ended: list[tuple[int, int]] = []
    real_add, real_end = SchedulingPolicy.add_request, SchedulingPolicy._end

    def add(self: SchedulingPolicy, req: Request) -> None:
        added.append(req.params.max_new_tokens)
        real_add(self, req)

    def end(self: SchedulingPolicy, req: Request, reason: FinishReason) -> None:
        ended.append((len(req.output_ids), int(reason)))
        real_end(self, req, reason)

    monkeypatch.setattr(SchedulingPolicy, "add_request", add)
    monkeypatch.setattr(SchedulingPolicy, "_end", end)
    config = core_cpu.CoreCpuConfig(
        (64,), 20, 2, idle_batch_sizes=(), turnover_outputs=(8, 4), turnover_batch_sizes=(64,)
    )
    run = core_cpu.run(config)
    steady, *turnover = run.rows
    assert [r.output_len for r in run.rows] == [0, 8, 4]
    assert set(added) == {core_cpu.NEVER, 8, 4}
    assert ended and all(reason == int(FinishReason.LENGTH) and n in (8, 4) for n, reason in ended)
    for row in turnover:
        # a request lives output_len steps and one more for the result the core is behind by
        assert row.arrivals_per_step == pytest.approx(64 / (row.output_len + 1), rel=0.25)
        assert row.phase_us["arrive"] > 0 and row.tokens_per_step > 32
        assert core_cpu.per_request_us(run, row) is not None
    assert core_cpu.per_request_us(run, steady) is None
    text = core_cpu.to_markdown(run, "test")
    assert "a request's turnover at batch 64, 4-token outputs" in text and "| 64 | columns | 0 | 4 |" in text
    document = core_cpu.to_json(run, "test")
    assert [t["output_len"] for t in document["turnover_us_per_request"]] == [8, 4]


def test_paired_turns_alternate_the_first_code_and_take_each_ratio_within_its_turn() -> None:
    """Each turn measures both codes, the first alternating; the summary's ratios are per turn
    (a machine that slows between turns moves both sides of a turn alike), with each code's
    median, the ratios' range and how many turns the current code was lower in."""
    calls: list[str] = []
    speeds = iter([1.0, 1.0, 2.0, 2.0, 1.5, 1.5, 1.0, 1.0])  # the machine's pace, per measurement

    def side(
        plan: paired.PairedPlan, code: Path | None, client: GrpcClient, link: str, args: tuple[str, ...]
    ) -> paired.Side:
        calls.append("current" if code is None else "baseline")
        assert link == "socket" and client == "grpc-many"  # this checkout's: both serve them
        assert args == ()
        pace = next(speeds)
        core = (1.8 if code is None else 2.0) * pace
        return paired.Side(core, 4.0 * pace, 60.0, 10.0 * pace, (10.5 if code is None else 10.0) * pace, 0)

    plan = paired.PairedPlan(turns=4)
    run = paired.run(plan, Baseline("f" * 40, REPO), side, progress=lambda line: None)
    assert calls == ["current", "baseline", "baseline", "current"] * 2
    assert [t.first for t in run.turns] == ["current", "baseline"] * 2
    core = paired.summarize(run.turns, "core_us_per_token")
    assert core.ratio_median == pytest.approx(0.9) and core.ratio_min == pytest.approx(0.9)
    assert (core.lower, core.turns) == (4, 4)
    assert core.current == pytest.approx(1.8 * 1.25) and core.baseline == pytest.approx(2.0 * 1.25)
    text = paired.to_markdown(run, "test")
    assert "core µs/token: medians 2.50 -> 2.25; per-turn ratio median 0.90x" in text
    assert "current lower in 4 of 4 turns" in text and "frontends µs/token" in text
    # the latencies a lightly loaded server must keep: each turn's, and their per-turn ratios
    row = "| 1 | current | 2.00, 1.80, 0.90x | 4.00, 4.00, 1.00x | 60.0, 60.0 | 10.0, 10.0 | 10.0, 10.5 |"
    itl = "- ITL p99 ms: medians 12.5 -> 13.1; per-turn ratio median 1.05x (range 1.05-1.05), current lower"
    assert row in text and itl + " in 0 of 4 turns" in text
    # the frontends' code the same on both sides: their ratio is the pace, here 1 within each turn
    controlled = paired.summarize_controlled(run.turns)
    assert controlled.ratio_median == pytest.approx(0.9) and controlled.lower == 4
    paced = paired.Turn(
        "current", paired.Side(1.9, 4.4, 60.0, 10.0, 11.0, 0), paired.Side(2.0, 4.0, 60.0, 10.0, 11.0, 0)
    )
    assert paced.ratio("core_us_per_token") == pytest.approx(0.95)
    assert paced.core_over_frontends == pytest.approx(0.95 / 1.1)  # the current side ran 10% slower
    document = json.loads(json.dumps(finite(paired.to_json(run, "test")), allow_nan=False))
    assert document["summary"]["core_us_per_token"]["lower"] == 4 and len(document["turns"]) == 4
    assert document["summary"]["itl_p99_ms"]["ratio_median"] == pytest.approx(1.05)
    args = paired.parse_args(["--baseline", "abc", "--output-len", "16", "--waves", "12", "--turns", "3"])
    assert (args.baseline, args.output_len, args.waves, args.turns, args.client) == (
        "abc",
        16,
        12,
        3,
        "grpc-many",
    )
    assert paired.plan_of(args).workload().closed_loop and "a closed loop" in text
    poisson = paired.plan_of(paired.parse_args(["--baseline", "abc", "--request-rate", "4", "--waves", "2"]))
    assert (poisson.workload().request_rate, poisson.workload().num_prompts) == (4.0, 2 * poisson.concurrency)
    with pytest.raises(SystemExit):
        paired.parse_args(["--baseline", "abc", "--request-rate", "0"])  # no request would ever come
    assert "scheduler also given" not in text


def test_paired_turns_give_each_side_its_own_scheduler_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """`--current-args` / `--baseline-args`: more scheduler flags for one side (the same code with
    and without a flag, against `--baseline HEAD`), reaching that side's scheduler command line and
    named in the report; flags this checkout's scheduler refuses stop the run before any turn."""
    args = paired.parse_args(
        ["--baseline", "HEAD", "--current-args=--no-prefix-cache --max-running 64", "--turns", "2"]
    )
    plan = paired.plan_of(args)
    assert (plan.current_args, plan.baseline_args) == (("--no-prefix-cache", "--max-running", "64"), ())
    given: dict[str, tuple[str, ...]] = {}

    def side(
        plan: paired.PairedPlan, code: Path | None, client: GrpcClient, link: str, args: tuple[str, ...]
    ) -> paired.Side:
        given["current" if code is None else "baseline"] = args
        return paired.Side(2.0, 4.0, 60.0, 10.0, 10.0, 0)

    run = paired.run(plan, Baseline("f" * 40, REPO), side, progress=lambda line: None)
    assert given == {"current": ("--no-prefix-cache", "--max-running", "64"), "baseline": ()}
    text = paired.to_markdown(run, "test")
    assert "- the current code's scheduler also given `--no-prefix-cache --max-running 64`" in text
    assert "baseline's scheduler also given" not in text
    # what measure_side starts: the point's own flags, then the side's
    configuration = Configuration(sim(20.0), "overlap", "socket", frontends=1, extra_args=plan.current_args)
    assert configuration.scheduler_args == (
        "--mode", "overlap", "--no-late-pick", "--no-prefix-cache", "--max-running", "64"
    )  # fmt: skip
    assert configuration.name.endswith(", --no-prefix-cache --max-running 64")
    both = paired.plan_of(paired.parse_args(["--baseline", "abc", "--baseline-args", "--max-running '8'"]))
    assert both.baseline_args == ("--max-running", "8")
    for bad in ("--no-such-flag", "--max-waiting 0", '"unclosed'):
        with pytest.raises(SystemExit):
            paired.parse_args(["--baseline", "abc", f"--current-args={bad}"])
    assert "--current-args" in capsys.readouterr().err


def test_link_cost_measures_a_real_stream_per_batch_size() -> None:
    from bench.link_cost import measure

    row = asyncio.run(measure(rows=64, messages=20))
    assert (row.rows, row.messages) == (64, 20)
    assert row.cpu_us_per_step > 0 and row.bytes_per_step > 64  # a handle, a token and a finish per row


# ---- smollm2 through the services: tables, ratios, best thread count ---------------------------


def smollm2_point(
    threads: int, mode: Mode, concurrency: int, tokens_per_s: float, ttft_p50_ms: float
) -> smollm2_serving.PointResult:
    point = next(p for p in smollm2_serving.FULL.points if p.concurrency == concurrency)
    configuration = Configuration(smollm2_serving.smollm2(threads), mode, "grpc")
    case = Case(configuration, smollm2_serving.FULL.workload(point))
    measured = replace(measurement(tokens_per_s), summary=summary(tokens_per_s, ttft_p50_ms))
    return smollm2_serving.point_result(threads, case, measured)


SMOLLM2_RESULTS = (
    smollm2_point(1, "serial", 1, 20.0, 200.0),
    smollm2_point(1, "overlap", 1, 22.0, 180.0),
    smollm2_point(2, "serial", 1, 18.0, 160.0),
    smollm2_point(2, "overlap", 1, 24.0, 240.0),
    smollm2_point(1, "serial", 16, 60.0, 2000.0),
    smollm2_point(1, "overlap", 16, 66.0, 1800.0),
    smollm2_point(2, "overlap", 16, 50.0, 2100.0),  # no serial at (2, 16)
)


def test_smollm2_plans_send_exact_lengths_to_a_smollm2_worker_per_thread_count() -> None:
    device = smollm2_serving.smollm2(2)
    assert device.worker_args == ("--model", "smollm2", "--threads", "2", "--kv-slots", "4096")
    assert device.sim_step_ms is None and device.ideal_tokens_per_s(16) is None
    full, quick = smollm2_serving.FULL, smollm2_serving.QUICK
    assert [(w.concurrency, w.num_prompts) for w in map(full.workload, full.points)] == [(1, 6), (16, 48)]
    assert [(w.concurrency, w.num_prompts) for w in map(quick.workload, quick.points)] == [(1, 2), (16, 16)]
    w = full.workload(full.points[1])
    assert (w.input_bounds, w.output_bounds) == ((64, 64), (64, 64))
    assert w.warmup_prompts == 16 and w.closed_loop
    assert quick.workload(quick.points[0]).output_bounds == (16, 16)
    assert full.thread_counts == quick.thread_counts == (1, 2)


def test_smollm2_overlap_over_serial_at_the_same_threads_and_concurrency() -> None:
    r = smollm2_serving.overlap_over_serial(SMOLLM2_RESULTS, 2, 1)
    assert (r.tokens_per_s, r.ttft_p50) == pytest.approx((24.0 / 18.0, 1.5))
    missing = smollm2_serving.overlap_over_serial(SMOLLM2_RESULTS, 2, 16)
    assert (missing.tokens_per_s, missing.ttft_p50) == (None, None)
    pairs = [(r.threads, r.concurrency) for r in smollm2_serving.all_ratios(SMOLLM2_RESULTS)]
    assert pairs == [(1, 1), (1, 16), (2, 1), (2, 16)]


def test_smollm2_best_threads_is_the_fastest_overlap_row_at_each_concurrency() -> None:
    best = smollm2_serving.best_threads(SMOLLM2_RESULTS)
    assert {c: r.threads for c, r in best.items()} == {1: 2, 16: 1}
    tie = (smollm2_point(2, "overlap", 1, 22.0, 1.0), smollm2_point(1, "overlap", 1, 22.0, 1.0))
    assert smollm2_serving.best_threads(tie)[1].threads == 1  # the fewer threads on a tie
    assert smollm2_serving.best_threads(SMOLLM2_RESULTS[:1]) == {}  # serial rows never count


def test_smollm2_table_puts_serial_before_overlap_with_the_ratios_on_overlap_rows() -> None:
    lines = smollm2_serving.table(SMOLLM2_RESULTS)
    assert lines[0].startswith("| threads | mode | concurrency | output tok/s | TTFT p50 ms | TTFT p99 ms |")
    assert len(lines) == 2 + len(SMOLLM2_RESULTS)
    assert lines[2:6] == [
        "| 1 | serial | 1 | 20.0 | 200 | 600 | 11.0 | 10.5 | 0.750 |  |  |",
        "| 1 | overlap | 1 | 22.0 | 180 | 540 | 11.0 | 10.5 | 0.750 | 1.10x | 0.90x |",
        "| 1 | serial | 16 | 60.0 | 2,000 | 6,000 | 11.0 | 10.5 | 0.750 |  |  |",
        "| 1 | overlap | 16 | 66.0 | 1,800 | 5,400 | 11.0 | 10.5 | 0.750 | 1.10x | 0.90x |",
    ]
    assert lines[-1] == "| 2 | overlap | 16 | 50.0 | 2,100 | 6,300 | 11.0 | 10.5 | 0.750 | — | — |"


def test_smollm2_report_names_the_best_threads_and_is_strict_json() -> None:
    run = smollm2_serving.Smollm2Run(
        smollm2_serving.QUICK, datetime(2026, 1, 2, 3, 4, tzinfo=UTC), {"nproc": 2}, 1.5, SMOLLM2_RESULTS
    )
    markdown = smollm2_serving.to_markdown(run, "python -m bench.smollm2_serving")
    assert "- best overlap tok/s at concurrency 1: 2 threads, 24.0 tok/s (vs 22.0 with 1)" in markdown
    assert "- best overlap tok/s at concurrency 16: 1 thread, 66.0 tok/s (vs 50.0 with 2)" in markdown
    assert "failed" not in markdown
    broken = replace(SMOLLM2_RESULTS[0], figures=replace(SMOLLM2_RESULTS[0].figures, failed=2))
    assert list(smollm2_serving.failure_lines([broken, *SMOLLM2_RESULTS[1:]])) == [
        "",
        "**2 of 66 requests failed** at threads 1, serial, concurrency 1.",
    ]
    document = json.loads(json.dumps(finite(smollm2_serving.to_json(run, "cmd")), allow_nan=False))
    assert document["best_overlap_threads"] == {"1": 2, "16": 1}
    assert document["points"][0]["worker_args"][:4] == ["--model", "smollm2", "--threads", "1"]
    assert document["overlap_over_serial"][3] == {
        "threads": 2,
        "concurrency": 16,
        "tokens_per_s": None,
        "ttft_p50": None,
    }


# ---- sampling features: model cost and services ------------------------------------------------


def test_sampling_cost_decodes_each_feature_set_on_tiny_and_compares_it_with_none() -> None:
    plan = sampling_cost.EnginePlan(("tiny",), (2,), steps=2, repeats=1, feature_sets=("none", "all"))
    backend = engine_decode.load_model("tiny")
    rows = engine_decode.measure_model(backend, "tiny", plan, sampling_cost.Features(plan.feature_sets))
    assert [(r.model, r.batch, r.features, len(r.runs)) for r in rows] == [
        ("tiny", 2, "none", 1),
        ("tiny", 2, "all", 1),
    ]
    for r in rows:
        assert r.runs[0].tokens == 4 and r.device_ms > 0 and r.tokens_per_s > 0
    none, every = rows
    vs = sampling_cost.versus_none(rows, every)
    assert vs.device_ms == pytest.approx(every.device_ms / none.device_ms)
    assert vs.tokens_per_s == pytest.approx(every.tokens_per_s / none.tokens_per_s)
    assert vs.overhead_percent == pytest.approx((every.device_ms / none.device_ms - 1) * 100)
    assert sampling_cost.versus_none(rows, none) == sampling_cost.VersusNone(1.0, 1.0)
    assert sampling_cost.versus_none(rows[1:], every) == sampling_cost.VersusNone(None, None)
    p = sampling_cost.processing("all", 32, backend)
    assert p is not None and p.stop_ids == backend.eos_token_ids and p.top_logprobs == 5
    assert len({token for token, _ in p.logit_bias}) == 50
    assert all(token < backend.vocab_size and abs(bias) <= 1 for token, bias in p.logit_bias)


def decode_row(model: str, batch: int, features: str, *device_ms: float) -> sampling_cost.EngineRow:
    """Runs of batch x 10 tokens, each taking 10 steps of its device time."""
    runs = tuple(engine_decode.DecodeRun(ms, ms * 10 / 1e3, batch * 10) for ms in device_ms)
    return sampling_cost.EngineRow(model, batch, features, runs)


def serving_row(features: str, busy: float, tokens_per_s: float) -> sampling_cost.ServingRow:
    case = Case(sampling_cost.serving_configuration(), sampling_cost.FULL.serving.workload)
    f = replace(figures(case, measurement(tokens_per_s)), device_busy_fraction=busy)
    return sampling_cost.ServingRow(features, 0, f)


def sampling_cost_run() -> sampling_cost.SamplingCostRun:
    engine = (
        decode_row("smollm2", 64, "none", 110.0, 100.0),
        decode_row("smollm2", 64, "penalties", 104.0),
        decode_row("smollm2", 64, "logprobs", 103.0),
        decode_row("smollm2", 64, "all", 108.0, 120.0),
    )
    serving = (serving_row("none", 0.995, 6000.0), serving_row("all", 0.985, 5900.0))
    started_at = datetime(2026, 1, 2, 3, 4, tzinfo=UTC)
    machine: Machine = {"nproc": 2}
    return sampling_cost.SamplingCostRun(
        sampling_cost.FULL, started_at, machine, 2, (0.5, 1.0, 1.5), engine, serving
    )


def test_sampling_cost_markdown_of_hand_made_results() -> None:
    run = sampling_cost_run()
    markdown = sampling_cost.to_markdown(run, "python -m bench.sampling_cost")
    lines = markdown.splitlines()
    assert lines[0] == "# Sampling features: their cost on the model and the services, 2026-01-02 03:04 UTC"
    assert (
        "2 torch threads; 1-minute load average 0.5 before, 1.0 after part A, 1.5 after part B." in lines[2]
    )
    engine_header = lines.index(sampling_cost.engine_table([])[0])
    assert lines[engine_header + 2 : engine_header + 6] == [
        "| smollm2 | 64 | none | 100.00 | 1.000x | 640.0 | 1.000x |",  # the best of two runs
        "| smollm2 | 64 | penalties | 104.00 | 1.040x | 615.4 | 0.962x |",
        "| smollm2 | 64 | logprobs | 103.00 | 1.030x | 621.4 | 0.971x |",
        "| smollm2 | 64 | all | 108.00 | 1.080x | 592.6 | 0.926x |",
    ]
    assert (
        "- forward overhead on smollm2 at batch 64: penalties +4.0%, logprobs +3.0%, all +8.0%; target "
        "penalties + logprobs <= 10% (checked on `all`, which holds both): met"
    ) in lines
    serving_header = next(i for i, line in enumerate(lines) if line.startswith("| features | run |"))
    assert lines[serving_header + 2 :][:2] == [
        "| none | 0 | 6,000.0 | 0.938 | 0.995 | 15.00 | 25.000 | 300.0 | 64 | 0 |",
        "| all | 0 | 5,900.0 | 0.922 | 0.985 | 15.00 | 25.000 | 295.0 | 64 | 0 |",
    ]
    assert "- target: device busy >= 0.98 with all features: least 0.985, met" in lines
    assert "requests failed" not in markdown
    document = json.loads(json.dumps(finite(sampling_cost.to_json(run, "cmd")), allow_nan=False))
    assert document["targets"]["engine"]["met"] is True
    assert document["targets"]["engine"]["overhead_percent"]["all"] == pytest.approx(8.0)
    assert document["targets"]["serving"] == {
        "busy_at_least": 0.98,
        "least_busy_with_all": 0.985,
        "met": True,
    }
    assert document["engine"][0]["device_ms_per_step"] == 100.0 and len(document["engine"][0]["runs"]) == 2
    assert document["serving"]["features"]["all"]["logprobs"] == 5


def test_sampling_cost_targets_are_unmeasured_without_their_rows_and_missed_below_them() -> None:
    run = replace(
        sampling_cost_run(),
        engine=(decode_row("tiny", 16, "none", 1.0), decode_row("tiny", 16, "all", 2.0)),
        serving=(serving_row("all", 0.97, 5000.0),),
    )
    markdown = sampling_cost.to_markdown(run, "cmd")
    assert "- target (penalties + logprobs <= 10%): not measured, no smollm2 rows at batch 64" in markdown
    assert "- target: device busy >= 0.98 with all features: least 0.970, not met" in markdown
    assert sampling_cost.engine_target_met(run.engine) is None


# ---- structured outputs: grammar masks on the model and the services --------------------------


def test_structured_decodes_tiny_with_every_row_held_and_no_grammar_finishing() -> None:
    plan = engine_decode.EnginePlan(("tiny",), (2,), steps=3, repeats=1)
    rows = engine_decode.measure_model(engine_decode.load_model("tiny"), "tiny", plan, structured.HELD)
    assert [(r.model, r.batch, r.rows, r.constrained_rows) for r in rows] == [
        ("tiny", 2, "none", 0),
        ("tiny", 2, "all", 2),
    ]
    plain, held = (r.runs[0].grammar for r in rows)
    assert (plain.masked_rows, plain.mask_steps, plain.wait_s, plain.steps) == (0, 0, 0.0, 3)
    assert rows[0].mask_ms_per_step is None and rows[0].wait_ms_per_step == 0.0
    assert (held.masked_rows, held.mask_steps, held.steps) == (6, 3, 3)  # decode steps alone
    assert held.mask_s > 0 and rows[1].mask_us_per_row == pytest.approx(held.mask_s * 1e6 / 6)
    mask_ms = rows[1].mask_ms_per_step
    assert mask_ms is not None
    assert structured.versus_plain(rows, rows[1]).mask_share == pytest.approx(mask_ms / rows[0].device_ms)


def test_structured_schema_holds_every_request_past_its_length() -> None:
    matchers = MatcherTable(grammar_tokenizer(BYTE_TOKENIZER, 258, (257,)), 258)
    shortest = structured.shortest_output().encode()
    matchers.start(0, structured.CONSTRAINT)
    assert [matchers.advance(0, byte) for byte in shortest] == [False] * (len(shortest) - 1) + [True]
    matchers.start(1, structured.CONSTRAINT)  # a record short: the array may not close
    with pytest.raises(GrammarError):
        for byte in structured.shortest_output(structured.MIN_ITEMS - 1).encode():
            matchers.advance(1, byte)
    longest_run = max(structured.SERVED_OUTPUT_LEN, structured.FULL.engine.steps + 1)
    assert len(shortest) > longest_run  # on a byte tokenizer, a byte is a token
    assert structured.constrained_requests(0.25, 256) == 64
    assert structured.constrained_requests(0.0, 256) == 0


def serving_run(
    device: str, mode: Mode, fraction: float, tokens_per_s: float, busy: float, repeat: int = 0
) -> structured.ServingRow:
    """A run of 64 requests of 10 tokens, 40 steps, every held request masked on each token (50 us a
    row), the forward waiting 0.1 ms a step."""
    case = Case(Configuration(SIM, mode, "grpc"), WORKLOAD)
    f = replace(figures(case, measurement(tokens_per_s)), device_busy_fraction=busy, output_tokens=640)
    held = structured.constrained_requests(fraction, 64)
    grammar = structured.Grammar(held * 10 * 50e-6, 40 if held else 0, held * 10, 0.004 if held else 0.0, 40)
    return structured.ServingRow(device, 64, mode, fraction, repeat, held, 10, f, grammar, {"LENGTH": 64})


def engine_run(
    model: str, batch: int, rows: structured.Rows, device_ms: float, mask_ms: float
) -> structured.EngineRow:
    """One run of 10 decode steps."""
    held = batch if rows == "all" else 0
    grammar = structured.Grammar(mask_ms * 10 / 1e3, 10 if held else 0, held * 10, mask_ms * 10 / 1e3, 10)
    run = structured.GrammarRun(device_ms, device_ms * 10 / 1e3, batch * 10, grammar)
    return structured.EngineRow(model, batch, rows, (run,))


def structured_run() -> structured.StructuredRun:
    engine = (engine_run("smollm2", 16, "none", 100.0, 0.0), engine_run("smollm2", 16, "all", 104.0, 2.0))
    serving = (
        serving_run("sim", "overlap", 0.0, 6000.0, 0.999),
        serving_run("sim", "overlap", 0.25, 5800.0, 0.990),
        serving_run("sim", "overlap", 0.0, 5900.0, 0.998, repeat=1),
        serving_run("sim", "overlap", 0.25, 5500.0, 0.970, repeat=1),
    )
    started_at = datetime(2026, 1, 2, 3, 4, tzinfo=UTC)
    machine: Machine = {"nproc": 2}
    return structured.StructuredRun(structured.FULL, started_at, machine, 2, (0.5, 1.0, 1.5), engine, serving)


def test_structured_report_of_hand_made_results() -> None:
    run = structured_run()
    markdown = structured.to_markdown(run, "python -m bench.structured")
    lines = markdown.splitlines()
    assert (
        lines[0] == "# Structured outputs: grammar masks on the model and the services, 2026-01-02 03:04 UTC"
    )
    engine_header = lines.index(structured.engine_table([])[0])
    assert lines[engine_header + 2 : engine_header + 4] == [
        "| smollm2 | 16 | 0 | 100.00 | 1.000x | 160.0 | 1.000x | — | — | — | 0.000 |",
        "| smollm2 | 16 | 16 | 104.00 | 1.040x | 153.8 | 0.962x | 2.000 | 125.0 | 2.0% | 2.000 |",
    ]
    assert (
        "- target (mask time per step < 10% of a plain decode step) on smollm2 at batch 16: 2.0%, met"
        in lines
    )
    serving_header = lines.index(structured.serving_table([])[0])
    held = "50.0 | 0.200 | 0.100 | yes |"  # mask us/row, ms/masked step, wait ms/step, to length
    assert lines[serving_header + 2 : serving_header + 6] == [
        "| sim | 64 | overlap | 0% | 0 | 6,000.0 | 1.000x | 0.999 | 300.0 | 15.00 | — | — | 0.000 | yes |",
        f"| sim | 64 | overlap | 25% | 0 | 5,800.0 | 0.967x | 0.990 | 290.0 | 15.00 | {held}",
        "| sim | 64 | overlap | 0% | 1 | 5,900.0 | 1.000x | 0.998 | 295.0 | 15.00 | — | — | 0.000 | yes |",
        f"| sim | 64 | overlap | 25% | 1 | 5,500.0 | 0.932x | 0.970 | 275.0 | 15.00 | {held}",
    ]
    assert (
        "- target (sim, overlap, 25% constrained, the best run of each fraction): tok/s >= 0.95 of 0%'s: "
        "0.967x, met; device busy >= 0.98: 0.990, met"
    ) in lines
    assert "**" not in markdown  # no failure, every request to length, every held token masked
    document = json.loads(json.dumps(finite(structured.to_json(run, "cmd")), allow_nan=False))
    assert document["targets"]["engine"]["met"] is True
    assert (
        document["targets"]["serving"]["kept_met"] is True and document["targets"]["serving"]["busy"] == 0.99
    )
    assert document["serving"][1]["grammar"]["mask_us_per_row"] == pytest.approx(50.0)


def test_structured_report_flags_runs_not_like_for_like_and_missed_targets() -> None:
    short = serving_run("sim", "overlap", 0.25, 5000.0, 0.95)
    short = replace(
        short, finish_reasons={"LENGTH": 60, "STOP": 4}, grammar=replace(short.grammar, masked_rows=150)
    )
    run = replace(
        structured_run(), engine=(), serving=(serving_run("sim", "overlap", 0.0, 6000.0, 0.999), short)
    )
    markdown = structured.to_markdown(run, "cmd")
    unmeasured = "not measured, no smollm2 rows at batch 16"
    assert f"- target (mask time per step < 10% of a plain decode step): {unmeasured}" in markdown
    assert "tok/s >= 0.95 of 0%'s: 0.833x, not met; device busy >= 0.98: 0.950, not met" in markdown
    assert "**not every request ran to length** in sim overlap, 25% constrained" in markdown
    assert "**150 rows drawn under a mask, not 160**, in sim overlap, 25% constrained" in markdown
    assert structured.engine_target_met(run.engine) is None


# ---- prefix cache: a shared system prompt, cache on and off -----------------------------------


PREFIX_SCHEDULER_BEFORE = """\
# TYPE stepahead_prompt_tokens counter
stepahead_prompt_tokens_total{mode="overlap"} 1000.0
# TYPE stepahead_prefix_cache_hit_tokens counter
stepahead_prefix_cache_hit_tokens_total{mode="overlap"} 900.0
"""

PREFIX_SCHEDULER_AFTER = """\
# TYPE stepahead_prompt_tokens counter
stepahead_prompt_tokens_total{mode="overlap"} 68584.0
# TYPE stepahead_prefix_cache_hit_tokens counter
stepahead_prefix_cache_hit_tokens_total{mode="overlap"} 66436.0
# TYPE stepahead_prefix_cache_evicted_slots counter
stepahead_prefix_cache_evicted_slots_total{mode="overlap"} 12.0
"""

PREFIX_WORKER_AFTER = """\
# TYPE stepahead_batch_tokens counter
stepahead_batch_tokens_total{device="cpu",forward_mode="prefill",model="sim"} 2148.0
stepahead_batch_tokens_total{device="cpu",forward_mode="decode",model="sim"} 4032.0
"""


def test_prefix_cache_figures_from_the_scrape_deltas() -> None:
    worker = parse(WORKER_AFTER + PREFIX_WORKER_AFTER)
    measured = Measurement(
        summary(4000.0, ttft_p50_ms=30.0),
        delta(parse(PREFIX_SCHEDULER_BEFORE), parse(PREFIX_SCHEDULER_AFTER)),
        delta(parse(WORKER_BEFORE), worker),
        0.5,
    )
    f = prefix_cache.cache_figures(measured)
    assert (f.prompt_tokens, f.cache_hit_tokens, f.evicted_slots, f.worker_tokens) == (67584, 65536, 12, 6180)
    assert f.prefill_tokens == 2048 and f.prefill_tokens_per_request == 32.0  # 64 completed
    assert f.hit_ratio == pytest.approx(65536 / 67584)
    assert f.device_busy_fraction == pytest.approx(3.0 / 4.0) and f.mean_forward_ms == pytest.approx(15.0)
    assert (f.ttft_p50_ms, f.ttft_p99_ms, f.output_tokens_per_s) == (30.0, 90.0, 4000.0)


def test_prefix_cache_configuration_turns_the_cache_off_with_a_flag() -> None:
    on = prefix_cache.CacheConfiguration(prefix_cache.sim(), "overlap", "grpc")
    off = replace(on, prefix_cache=False)
    assert on.scheduler_args == ("--mode", "overlap", "--no-late-pick")
    assert off.scheduler_args == ("--mode", "overlap", "--no-late-pick", "--no-prefix-cache")
    assert (on.name, off.name) == ("sim overlap grpc, prefix cache on", "sim overlap grpc, prefix cache off")
    assert "--sim-token-us" in on.device.worker_args and "20" in on.device.worker_args
    dataset = prefix_cache.FULL.dataset()
    assert (dataset.prefix_len, dataset.suffix_len, dataset.num_prefixes, dataset.output_len) == (
        1024,
        32,
        1,
        64,
    )
    assert [(m.device.name, m.concurrency) for m in prefix_cache.FULL.models] == [("tiny", 64), ("sim", 64)]


def cache_row(
    model: str, on: bool, ttft_p50_ms: float, prefill: int, tokens_per_s: float, busy: float | None
) -> prefix_cache.Row:
    device = prefix_cache.tiny() if model == "tiny" else prefix_cache.sim()
    configuration = prefix_cache.CacheConfiguration(device, "overlap", "grpc", prefix_cache=on)
    figures = prefix_cache.CacheFigures(
        ttft_p50_ms=ttft_p50_ms,
        ttft_p99_ms=ttft_p50_ms * 2,
        output_tokens_per_s=tokens_per_s,
        prompt_tokens=100 * 1056,
        cache_hit_tokens=100 * 1056 - prefill,
        evicted_slots=0,
        worker_tokens=prefill + 100 * 63,
        device_busy_fraction=busy,
        mean_forward_ms=12.5,
        completed=100,
        failed=0,
        duration_s=2.0,
    )
    return prefix_cache.Row(configuration, 100, 64, 0, figures)


def prefix_cache_run(*rows: prefix_cache.Row) -> prefix_cache.PrefixCacheRun:
    started_at = datetime(2026, 1, 2, 3, 4, tzinfo=UTC)
    machine: Machine = {"nproc": 2, "load_average_1m": 0.4}
    return prefix_cache.PrefixCacheRun(
        prefix_cache.FULL, started_at, machine, {"tiny": 1.5, "sim": 1.2}, rows
    )


PREFIX_ROWS = (
    cache_row("tiny", True, 300.0, 3200, 1400.0, 0.99),
    cache_row("tiny", False, 6000.0, 105600, 350.0, 0.995),
    cache_row("sim", True, 60.0, 3200, 5000.0, 0.99),
    cache_row("sim", False, 1500.0, 105600, 1250.0, 0.9),
)


def test_prefix_cache_on_over_off_ratios() -> None:
    tiny = prefix_cache.on_over_off(PREFIX_ROWS, "tiny")
    assert tiny.ttft_p50 == pytest.approx(0.05) and tiny.ttft_p50_times_lower == pytest.approx(20.0)
    assert tiny.prefill_tokens == pytest.approx(3200 / 105600)
    assert tiny.output_tokens_per_s == pytest.approx(4.0)
    assert tiny.device_busy == pytest.approx(0.99 / 0.995)
    sim = prefix_cache.on_over_off(PREFIX_ROWS, "sim")
    assert sim.ttft_p50 == pytest.approx(0.04) and sim.device_busy == pytest.approx(1.1)
    assert [r.model for r in prefix_cache.all_ratios(PREFIX_ROWS)] == ["tiny", "sim"]
    assert prefix_cache.on_over_off(PREFIX_ROWS[:1], "tiny") == prefix_cache.OnOverOff(
        "tiny", None, None, None, None
    )
    no_busy = replace(PREFIX_ROWS[3], figures=replace(PREFIX_ROWS[3].figures, device_busy_fraction=None))
    assert prefix_cache.on_over_off((PREFIX_ROWS[2], no_busy), "sim").device_busy is None
    assert prefix_cache.ttft_target_met(PREFIX_ROWS) is True and prefix_cache.busy_target_met(PREFIX_ROWS)
    slow = replace(PREFIX_ROWS[0], figures=replace(PREFIX_ROWS[0].figures, ttft_p50_ms=2500.0))
    assert prefix_cache.ttft_target_met((slow, *PREFIX_ROWS[1:])) is False  # 2.4x lower
    assert prefix_cache.ttft_target_met(PREFIX_ROWS[2:]) is None


def test_prefix_cache_markdown_of_hand_made_results() -> None:
    markdown = prefix_cache.to_markdown(prefix_cache_run(*PREFIX_ROWS), "python -m bench.prefix_cache")
    lines = markdown.splitlines()
    assert lines[0] == "# Prefix cache: a shared system prompt, cache on and off, 2026-01-02 03:04 UTC"
    assert "1-minute load average 0.4 before, 1.5 after tiny, 1.2 after sim." in lines[2]
    header = lines.index(prefix_cache.table([])[0])
    assert lines[header + 2 : header + 6] == [
        "| tiny | on | 64 | 300.0 | 600.0 | 3,200 | 32.0 | 0.970 | 9,500 | 1,400.0 | 0.990 | 12.50 | 0 |",
        "| tiny | off | 64 | 6,000.0 | 12,000.0 | 105,600 | 1,056.0 | 0.000 | 111,900 | 350.0 | 0.995 "
        "| 12.50 | 0 |",
        "| sim | on | 64 | 60.0 | 120.0 | 3,200 | 32.0 | 0.970 | 9,500 | 5,000.0 | 0.990 | 12.50 | 0 |",
        "| sim | off | 64 | 1,500.0 | 3,000.0 | 105,600 | 1,056.0 | 0.000 | 111,900 | 1,250.0 | 0.900 "
        "| 12.50 | 0 |",
    ]
    ratios = lines.index(prefix_cache.ratio_table([])[0])
    assert lines[ratios + 2 : ratios + 4] == [
        "| tiny | 0.050x | 0.030x | 4.000x | 0.995x |",
        "| sim | 0.040x | 0.030x | 4.000x | 1.100x |",
    ]
    assert "- target: TTFT p50 at least 3x lower with the cache on tiny: 20.0x lower, met" in lines
    assert "- target: device busy >= 0.98 with the cache on sim at concurrency 64: 0.990, met" in lines
    assert "requests failed" not in markdown and "`--model tiny --kv-slots 81920`" in markdown


def test_prefix_cache_report_flags_failures_and_unmeasured_targets_and_is_strict_json() -> None:
    broken = replace(PREFIX_ROWS[2], warmup_failed=1, figures=replace(PREFIX_ROWS[2].figures, failed=3))
    run = prefix_cache_run(broken, PREFIX_ROWS[3])
    markdown = prefix_cache.to_markdown(run, "cmd")
    assert "- **3 of 103 requests failed** (1 of the warmup's) on sim with the prefix cache on" in markdown
    assert "- target: TTFT p50 at least 3x lower with the cache on tiny: —, not measured" in markdown
    document = json.loads(json.dumps(finite(prefix_cache.to_json(run, "cmd")), allow_nan=False))
    assert document["targets"]["ttft"]["met"] is None and document["targets"]["device_busy"]["met"] is True
    assert document["rows"][0]["figures"]["prefill_tokens"] == 3200
    assert document["rows"][1]["scheduler_args"][-1] == "--no-prefix-cache"
    assert document["on_over_off"][0]["ttft_p50_times_lower"] == pytest.approx(25.0)
    assert document["dataset"]["prefix_len"] == 1024


def test_prefix_cache_smallest_real_run_reuses_the_warmed_prefix_only_with_the_cache() -> None:
    plan = prefix_cache.Plan(
        "test",
        (prefix_cache.ModelPlan(prefix_cache.sim(2.0), 8, 4),),
        64,
        8,
        output_len=4,
        warmup_output_len=2,
    )
    on, off = prefix_cache.run_plan(plan, progress=lambda _: None).rows
    assert (on.prefix_cache, off.prefix_cache) == (True, False)
    for row in (on, off):
        f = row.figures
        assert (f.completed, f.failed, row.warmup_failed, f.prompt_tokens) == (8, 0, 0, 8 * 72)
        assert f.output_tokens_per_s > 0 and f.ttft_p50_ms > 0 and f.device_busy_fraction is not None
        assert f.worker_tokens == f.prefill_tokens + 8 * 3  # the last token of each is never fed back
    assert on.figures.cache_hit_tokens >= 8 * 64 and on.figures.prefill_tokens <= 8 * 8
    assert (off.figures.cache_hit_tokens, off.figures.prefill_tokens) == (0, 8 * 72)


def test_tensor_parallel_report_divides_by_tp1_at_the_same_concurrency() -> None:
    rows = [
        tensor_parallel.Row(1, 16, 2000.0, 8.0, 0.99, 64, 0),
        tensor_parallel.Row(2, 16, 1000.0, 16.0, 0.93, 64, 0),
        tensor_parallel.Row(2, 64, 2400.0, 24.0, 0.95, 256, 0),
    ]
    assert tensor_parallel.versus_tp1(rows, rows[1]) == (0.5, 2.0)
    assert tensor_parallel.versus_tp1(rows, rows[2]) == (None, None)  # no TP 1 row at 64
    reduces = [tensor_parallel.AllReduceRow(16, 300.0)]
    assert reduces[0].per_layer_us == 600.0 and reduces[0].per_step_ms == 2.4  # 2 a layer, 4 layers
    markdown = tensor_parallel.to_markdown(
        tensor_parallel.QUICK, datetime(2026, 1, 1, tzinfo=UTC), {"nproc": 2}, rows, reduces, "cmd"
    )
    assert "| 2 | 16 | 1,000.0 | 16.00 | 0.930 | 0.500x | 2.000x | 0 |" in markdown
    assert "| 16 | 300.0 | 600.0 | 2.400 |" in markdown


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(1024):
        writer.write(data)
        await writer.drain()
    writer.close()


@pytest.mark.anyio
async def test_the_link_delay_proxy_delays_each_direction_and_keeps_the_bytes_in_order() -> None:
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    proxy = link_delay.LinkDelay("127.0.0.1", server.sockets[0].getsockname()[1], delay_s=0.02)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", await proxy.start())
        start = time.monotonic()
        payload = bytes(range(256)) * 40
        writer.write(payload)
        got = await reader.readexactly(len(payload))
        assert got == payload
        assert time.monotonic() - start >= 0.04  # 20 ms each way
        writer.close()
    finally:
        await proxy.close()
        server.close()


def test_overlap_depth_report_finds_the_target_and_the_cost_at_zero_delay() -> None:
    def point(delay: float, depth: str, busy: float, tok: float) -> overlap_depth.Point:
        return overlap_depth.Point(
            delay, depth, busy, tok, 2 * delay + 0.5, 2 if depth == "auto" else 1, 3, 64, 0
        )

    points = [point(0.0, "1", 1.0, 6000.0), point(0.0, "auto", 1.0, 6060.0), point(5.0, "auto", 0.96, 5900.0)]
    assert overlap_depth.target_busy(points) == 0.96
    assert overlap_depth.auto_at_zero(points) == pytest.approx(1.01)
    markdown = overlap_depth.to_markdown(
        overlap_depth.QUICK, datetime(2026, 1, 1, tzinfo=UTC), {"nproc": 2}, points, "cmd"
    )
    assert "| 5 ms |  |  |  | 0.960, 5,900 | 10.50 | 2 |" in markdown
    assert "at d = 5 ms: 0.960, met" in markdown


def test_frontend_stalls_smoke_run_prints_both_rows(capsys: pytest.CaptureFixture[str]) -> None:
    """The stalls benchmark runs end to end (small sizes); its figures are the benchmark's, not
    asserted here."""
    from bench import frontend_stalls

    frontend_stalls.main(["--quick", "--repeats", "1"])
    printed = capsys.readouterr().out
    assert printed.startswith("machine: ")
    rows = [line for line in printed.splitlines() if line.startswith(("| tokenize", "| build"))]
    assert len(rows) == 2 and all(line.endswith("x |") for line in rows)


def test_tool_masks_smoke_run_writes_every_state(tmp_path: Path) -> None:
    """The tool-calling cost benchmark runs end to end (few repeats); its figures are the
    benchmark's: here only that each state and step was measured."""
    from bench import tool_masks

    tool_masks.main(["--quick", "--out", str(tmp_path)])
    document = json.loads((tmp_path / "latest-tool_masks.json").read_text())
    assert list(document["mask_us_per_row"]) == [name for name, *_ in tool_masks.states()]
    assert list(document["frontend_us_per_token"]) == ["detokenize + stop strings", "CallStream"]
    assert all(
        v > 0 for part in ("mask_us_per_row", "frontend_us_per_token") for v in document[part].values()
    )


def _stand_in_stream(events: int, seen: list[bytes]) -> tuple[socket.socket, threading.Thread]:
    """A server on 127.0.0.1 that reads one request into `seen` and answers `events` events and
    [DONE], one send each."""
    server = socket.create_server(("127.0.0.1", 0))

    def answer() -> None:
        conn, _ = server.accept()
        with conn:
            request = b""
            while b"\r\n\r\n" not in request or not request.endswith(b"}"):
                request += conn.recv(1 << 16)
            seen.append(request)
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n")
            for i in range(events):
                conn.sendall(b'data: {"choices": [{"text": "%d"}]}\n\n' % i)
            conn.sendall(b"data: [DONE]\n\n")

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    return server, thread


def test_model_speed_times_a_stream_read_off_a_socket() -> None:
    from bench import model_speed

    seen: list[bytes] = []
    server, thread = _stand_in_stream(5, seen)
    with server:
        ms = model_speed.socket_stream_ms(server.getsockname()[1], 5, model="m")
        thread.join(timeout=30)
    head, body = seen[0].split(b"\r\n\r\n", 1)
    assert head.startswith(b"POST /v1/completions HTTP/1.1")
    sent = json.loads(body)
    assert (sent["model"], sent["max_tokens"], sent["stream"], sent["ignore_eos"]) == ("m", 5, True, True)
    assert math.isfinite(ms) and ms >= 0
    # More events than tokens asked for: not the stream the figure assumes.
    server, thread = _stand_in_stream(6, seen)
    with server, pytest.raises(RuntimeError, match="6 events for 5 tokens"):
        model_speed.socket_stream_ms(server.getsockname()[1], 5, model="m")
    thread.join(timeout=30)


def test_model_speed_reads_llama_bench_as_it_is_run(tmp_path: Path) -> None:
    from bench import model_speed

    # A stand-in llama-bench: checks the command line it is given, prints its JSON report.
    fake = tmp_path / "llama-bench"
    fake.write_text(
        "#!/usr/bin/env python3\n"
        "import json, sys\n"
        "a = sys.argv[1:]\n"
        "flag = lambda f: a[a.index(f) + 1]\n"
        "assert (flag('-t'), flag('-n'), flag('-p')) == ('2', '32', '0')\n"
        "assert flag('-m').endswith('.gguf') and flag('-o') == 'json'\n"
        "print(json.dumps([{'n_prompt': 0, 'n_gen': 32, 'avg_ts': 104.25, 'stddev_ts': 1.5}]))\n"
    )
    fake.chmod(0o755)
    assert model_speed.llama_bench_tok_s(fake, tmp_path / "m.gguf", 2, 32) == 104.25
    assert set(model_speed.MODES) == {"float32", "bfloat16", "int8", "int4", "int8-torch", "int4-torch"}
    # int4 on Stepahead's kernels (float32 activations), int4-torch on torch's (bfloat16)
    assert model_speed.MODES["int4"] == ("float32", "int4")
    assert model_speed.MODES["int4-torch"] == ("bfloat16", "int4")


def test_rpc_floor_finds_a_cost_per_call_and_per_message() -> None:
    from bench.rpc_floor import measure

    floor = measure(calls=500, concurrency=16, messages=8)
    assert floor.per_call_us > 0 and floor.per_message_us > 0, floor


def test_speculative_runs_each_kind_and_concurrency_with_and_without_drafts() -> None:
    """bench.speculative on smollm2, as small as it goes: the same tokens both ways (greedy),
    drafts only with speculation, and a row per kind and concurrency with the ratio."""
    plan = speculative.Plan("test", (1,), 1, 32, min_requests=2, rounds=2)  # a JSON field copied
    points = speculative.run(plan, threads=1)
    assert len(points) == 2 * len(speculative.KINDS)
    for kind in speculative.KINDS:
        off, on = (next(p for p in points if (p.kind, p.speculative) == (kind, s)) for s in (False, True))
        assert off.tokens == on.tokens > 0
        assert len(off.round_tok_s) == len(on.round_tok_s) == 2
        assert off.draft_tokens == 0 and on.draft_tokens > 0
    copy = next(p for p in points if (p.kind, p.speculative) == ("copy", True))
    assert copy.accepted > 0, "copying a passage accepts drafts"
    structured = next(p for p in points if (p.kind, p.speculative) == ("json", True))
    assert structured.accepted > 0, "extracting a passage's fields under a schema accepts drafts"
    table = speculative.markdown(points, "python -m bench.speculative", 2.0)
    assert table.count("\n| copy | 1 |") == 1 and table.count("\n| free | 1 |") == 1
    assert table.count("x | ") == len(speculative.KINDS) and ", " in table.split("| copy | 1 |")[1]


def test_frontends_kv_slots_reach_the_sim_worker_and_the_report() -> None:
    assert frontends.parse_args([]).kv_slots == SIM_KV_SLOTS
    args = frontends.parse_args(["--kv-slots", "60000"])
    device = sim(20.0, args.kv_slots)
    assert device.worker_args[device.worker_args.index("--kv-slots") + 1] == "60000"
    run = frontends.FrontendsRun(QUICK_FRONTENDS, datetime.now(UTC), {}, 0.0, (), kv_slots=args.kv_slots)
    assert "- the sim worker's KV pool: 60,000 slots (it fills" in "\n".join(frontends.notes(run))
