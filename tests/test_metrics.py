"""Prometheus metrics of both services and the step timeline, under real load."""

from __future__ import annotations

import asyncio
import json
import pathlib
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from stepahead.processes import Service, serving_pair
from stepahead.v1 import generation_pb2 as pb
from stepahead.v1 import generation_pb2_grpc

SIM = ["--model", "sim", "--sim-step-ms", "4", "--sim-token-us", "0"]

SCHEDULER_METRICS = {
    "stepahead_requests_running",
    "stepahead_requests_waiting",
    "stepahead_prompt_tokens_total",
    "stepahead_generation_tokens_total",
    "stepahead_requests_finished_total",
    "stepahead_time_to_first_token_seconds",
    "stepahead_inter_token_latency_seconds",
    "stepahead_e2e_request_latency_seconds",
    "stepahead_request_queue_time_seconds",
    "stepahead_batch_size",
    "stepahead_batch_tokens",
    "stepahead_step_phase_seconds",
    "stepahead_result_queue_depth",
    "stepahead_kv_cache_usage_ratio",
    "stepahead_preemptions_total",
    "stepahead_dropped_inflight_tokens_total",
    "stepahead_worker_step_latency_seconds",
    "stepahead_worker_connected",
}
WORKER_METRICS = {
    "stepahead_device_busy_seconds_total",
    "stepahead_device_idle_seconds_total",
    "stepahead_forward_seconds",
    "stepahead_device_gap_seconds",
    "stepahead_copy_seconds",
    "stepahead_batches_total",
    "stepahead_batch_tokens_total",
    "stepahead_live_request_slots",
    "stepahead_tensor_parallel_size",
}


def scrape(service: Service) -> str:
    with urllib.request.urlopen(service.metrics_url, timeout=10) as response:
        return str(response.read().decode())


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    return sum(v for (n, ls), v in samples(text).items() if n == name and set(labels.items()) <= ls)


def promtool_check(text: str) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool (Debian package prometheus) is required"
    done = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


async def run_clients(address: str, n: int, abort_every: int) -> dict[str, list[pb.GenerateResponse]]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def one(i: int) -> list[pb.GenerateResponse]:
            sampling = pb.SamplingParams(max_new_tokens=20 + i % 30, ignore_eos=i % 3 == 0)
            call = stub.Generate(
                pb.GenerateRequest(request_id=f"m{i}", text=f"metric {i} " * (1 + i % 5), sampling=sampling)
            )
            got = []
            async for response in call:
                got.append(response)
                if i % abort_every == 0 and len(got) == 2:
                    await stub.Abort(pb.AbortRequest(request_id=f"m{i}"))
            return got

        results = await asyncio.gather(*(one(i) for i in range(n)))
    return {f"m{i}": r for i, r in enumerate(results)}


@pytest.fixture(scope="module")
def loaded_pair() -> Iterator[tuple[Service, Service, dict[str, list[pb.GenerateResponse]]]]:
    with serving_pair([*SIM, "--kv-slots", "700"], ["--max-batch-tokens", "128"]) as (worker, scheduler):
        yield worker, scheduler, asyncio.run(run_clients(scheduler.address, 60, abort_every=7))


def test_both_endpoints_pass_promtool_and_carry_constant_labels(
    loaded_pair: tuple[Service, Service, dict[str, list[pb.GenerateResponse]]],
) -> None:
    worker, scheduler, _ = loaded_pair
    for service, names, const in (
        (scheduler, SCHEDULER_METRICS, {("mode", "overlap")}),
        (worker, WORKER_METRICS, {("model", "sim"), ("device", "cpu")}),
    ):
        text = scrape(service)
        promtool_check(text)
        found = {family.name for family in text_string_to_metric_families(text)}
        assert {n.removesuffix("_total") for n in names} <= found
        for _, labels in samples(text):
            assert const <= labels


def test_counters_agree_with_what_clients_received(
    loaded_pair: tuple[Service, Service, dict[str, list[pb.GenerateResponse]]],
) -> None:
    worker, scheduler, streams = loaded_pair
    text = scrape(scheduler)
    received = sum(len(r.token_ids) for s in streams.values() for r in s)
    assert value(text, "stepahead_generation_tokens_total") == received
    prompt = sum(s[-1].prompt_tokens for s in streams.values())
    assert value(text, "stepahead_prompt_tokens_total") == prompt
    reasons = {
        "length": pb.FINISH_REASON_LENGTH,
        "stop": pb.FINISH_REASON_STOP,
        "abort": pb.FINISH_REASON_ABORT,
    }
    for reason, code in reasons.items():
        expected = sum(s[-1].finish_reason == code for s in streams.values())
        assert value(text, "stepahead_requests_finished_total", reason=reason) == expected, reason
    assert value(text, "stepahead_time_to_first_token_seconds_count") == len(streams)
    assert value(text, "stepahead_e2e_request_latency_seconds_count") == len(streams)
    assert value(text, "stepahead_inter_token_latency_seconds_count") == received - len(streams)
    assert value(text, "stepahead_preemptions_total") > 0
    assert value(text, "stepahead_dropped_inflight_tokens_total") > 0
    assert value(text, "stepahead_kv_cache_usage_ratio") == 0
    assert value(text, "stepahead_requests_running") == 0
    steps = value(text, "stepahead_step_phase_seconds_count", phase="pick")
    assert steps >= value(text, "stepahead_step_phase_seconds_count", phase="launch") > 0
    worker_text = scrape(worker)
    batches = value(worker_text, "stepahead_batches_total")
    assert batches == value(text, "stepahead_batch_size_count")
    assert value(worker_text, "stepahead_forward_seconds_count") == batches
    assert value(worker_text, "stepahead_device_busy_seconds_total") > 0


def idle_fraction(mode: str) -> float:
    with serving_pair(SIM, ["--mode", mode]) as (worker, scheduler):
        asyncio.run(run_clients(scheduler.address, 48, abort_every=1000))
        text = scrape(worker)
    busy = value(text, "stepahead_device_busy_seconds_total")
    idle = value(text, "stepahead_device_idle_seconds_total")
    return idle / (busy + idle)


def test_overlap_leaves_the_device_less_idle_than_serial() -> None:
    serial, overlap = idle_fraction("serial"), idle_fraction("overlap")
    assert overlap < serial, (overlap, serial)


def spans(path: pathlib.Path, prefix: str) -> dict[int, tuple[float, float]]:
    events = json.loads(path.read_text())
    return {
        int(e["name"].split()[1]): (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e["ph"] == "X" and e["name"].startswith(prefix + " ")
    }


def traced_run(mode: str, tmp_path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    sched_trace, worker_trace = tmp_path / f"scheduler-{mode}.json", tmp_path / f"worker-{mode}.json"
    with serving_pair(
        [*SIM, "--trace-file", str(worker_trace)], ["--mode", mode, "--trace-file", str(sched_trace)]
    ) as (_, scheduler):
        asyncio.run(run_clients(scheduler.address, 16, abort_every=1000))
    return sched_trace, worker_trace


def overlapping(forward: dict[int, tuple[float, float]], process: dict[int, tuple[float, float]]) -> int:
    """Steps k whose forward overlaps the processing of k-1."""
    return sum(
        1
        for k, (fs, fe) in forward.items()
        if k - 1 in process and fs < process[k - 1][1] and process[k - 1][0] < fe
    )


def test_trace_shows_forward_k_overlapping_process_k_minus_1(tmp_path: pathlib.Path) -> None:
    for mode in ("overlap", "serial"):
        sched_trace, worker_trace = traced_run(mode, tmp_path)
        lanes = {
            e["args"]["name"]
            for f in (sched_trace, worker_trace)
            for e in json.loads(f.read_text())
            if e["name"] == "thread_name"
        }
        assert {"scheduler", "device", "copy"} <= lanes
        forward, process = spans(worker_trace, "forward"), spans(sched_trace, "process")
        assert len(forward) > 20 and len(process) > 20
        if mode == "overlap":
            assert overlapping(forward, process) > len(forward) // 2
        else:
            assert overlapping(forward, process) == 0
