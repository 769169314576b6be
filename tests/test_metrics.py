"""Prometheus metrics of both services and the step timeline, under real load.

What a test counts is forced, on a machine of any speed: a call of n completions that together
outgrow the KV pool (preemptions), a request that stops on the sim's EOS while its next step is
in flight (a dropped in-flight token), and the overlap loop's launch order in the scheduler's own
trace. Counters that reach the scheduler's /metrics from its frontend process, and gauges that
follow the last finish, are read once they have settled (a poll with a deadline)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import pathlib
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from stepahead.processes import Service, serving_pair, spawn_worker, wait_serving
from stepahead.v1 import generation_pb2 as pb
from stepahead.v1 import generation_pb2_grpc
from tests.live import (
    CALL_TIMEOUT_S,
    POLL_S,
    SETTLE_TIMEOUT_S,
    generate,
    scheduler_behind_a_link,
    wait_all_free,
    worker_stats_after_drain,
)
from worker_svc.backends import sim_continuation
from worker_svc.loading import TINY_CONFIG

SIM = ["--model", "sim", "--sim-step-ms", "4", "--sim-token-us", "0"]
KV_SLOTS = 700
PROMTOOL_TIMEOUT_S = 60.0  # a hang guard: promtool checks a scrape in well under a second

GC_METRICS = ("stepahead_gc_collections_total", "stepahead_gc_seconds_total", "stepahead_gc_frozen_objects")
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
    *GC_METRICS,
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
    *GC_METRICS,
}


def scrape(service: Service) -> str:
    with urllib.request.urlopen(service.metrics_url, timeout=CALL_TIMEOUT_S) as response:
        return str(response.read().decode())


def settled_scrape(service: Service, ready: Callable[[str], bool]) -> str:
    """A scrape of `service` once `ready` holds for it; after SETTLE_TIMEOUT_S (a hang guard), the
    last one, for the asserts that follow to say what is missing. The scheduler's /metrics asks
    its frontend process for the client-side counters and leaves out one that does not answer in
    time, and its gauges follow a finish at the core's next turn: a single read may be early."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        text = scrape(service)
        if ready(text) or time.monotonic() > deadline:
            return text
        time.sleep(POLL_S)


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    return sum(v for (n, ls), v in samples(text).items() if n == name and set(labels.items()) <= ls)


def family_names(text: str) -> set[str]:
    return {family.name for family in text_string_to_metric_families(text)}


def has_families(names: set[str]) -> Callable[[str], bool]:
    return lambda text: names <= family_names(text)


def promtool_check(text: str) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool (Debian package prometheus) is required"
    done = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=PROMTOOL_TIMEOUT_S
    )
    assert done.returncode == 0, done.stdout + done.stderr


# Each completion's responses, by "request id/completion index".
Streams = dict[str, list[pb.GenerateResponse]]


def by_completion(responses: list[pb.GenerateResponse]) -> Streams:
    streams: Streams = {}
    for r in responses:
        streams.setdefault(f"{r.request_id}/{r.index}", []).append(r)
    return streams


def tokens(stream: list[pb.GenerateResponse]) -> list[int]:
    return [t for r in stream for t in r.token_ids]


async def run_clients(address: str, n: int, abort_every: int) -> Streams:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def one(i: int) -> list[pb.GenerateResponse]:
            sampling = pb.SamplingParams(max_new_tokens=20 + i % 30, ignore_eos=i % 3 == 0)
            call = stub.Generate(
                pb.GenerateRequest(request_id=f"m{i}", text=f"metric {i} " * (1 + i % 5), sampling=sampling),
                timeout=CALL_TIMEOUT_S,
            )
            got = []
            async for response in call:
                got.append(response)
                if i % abort_every == 0 and len(got) == 2:
                    await stub.Abort(pb.AbortRequest(request_id=f"m{i}"), timeout=CALL_TIMEOUT_S)
            return got

        results = await asyncio.gather(*(one(i) for i in range(n)))
    return {key: stream for r in results for key, stream in by_completion(r).items()}


# Preemptions, forced: one call of PREEMPT_N completions of a PREEMPT_PROMPT-token prompt, with
# ignore_eos and no stops. The policy admits completions 1..n-1 together as soon as completion 0's
# prompt is in the prefix cache (scheduler_svc/engine/admission.py `_waits_for_first_completion`), so all n
# run at once; each of them reuses the prompt's first P-1 cached slots and holds max_new slots of
# its own by its last token. Completions 1..n-1 alone then need (n-1) x max_new + P-1 slots, more
# than KV_SLOTS, while one completion (P + max_new) fits: the pool runs out under them and the
# policy preempts (and recomputes), whatever the timing.
PREEMPT_PROMPT, PREEMPT_N, PREEMPT_MAX_NEW = 40, 16, 50
assert (PREEMPT_N - 1) * PREEMPT_MAX_NEW + PREEMPT_PROMPT - 1 > KV_SLOTS >= PREEMPT_PROMPT + PREEMPT_MAX_NEW
PREEMPT = pb.GenerateRequest(
    request_id="preempt",
    input_ids=pb.TokenIds(ids=[ord("p")] * PREEMPT_PROMPT),
    sampling=pb.SamplingParams(max_new_tokens=PREEMPT_MAX_NEW, ignore_eos=True, n=PREEMPT_N),
)

# A dropped in-flight token, forced: a request alone that stops on the sim's EOS before its
# max_new_tokens (the sim's tokens are a function of the prompt: worker_svc/backends.py). The
# overlap loop launches step k+1 before it processes step k, and a running request short of its
# max_new_tokens has a row in every step, so when the EOS of step k is processed, step k+1 is in
# flight with a row of the request: that row's token is dropped.
EOS_MAX_NEW = 60
SIM_EOS = TINY_CONFIG.eos_token_ids[0]


def eos_request() -> tuple[pb.GenerateRequest, list[int]]:
    """The first of the prompts "eos 0 ", "eos 1 ", ... whose sim continuation stops on EOS in the
    first half of its max_new_tokens, and the tokens it streams (the EOS last)."""
    for j in itertools.count():
        prompt = list(f"eos {j} ".encode())
        expected = sim_continuation(prompt, EOS_MAX_NEW)
        if SIM_EOS in expected[: EOS_MAX_NEW // 2]:
            sampling = pb.SamplingParams(max_new_tokens=EOS_MAX_NEW)
            request = pb.GenerateRequest(
                request_id="eos", input_ids=pb.TokenIds(ids=prompt), sampling=sampling
            )
            return request, expected[: expected.index(SIM_EOS) + 1]
    raise AssertionError("unreachable")


async def load(scheduler: str, worker: str) -> Streams:
    """The mixed load (aborts, EOS stops, lengths), then the forcing calls one after the other, each
    alone; returns once both services are idle."""
    streams = await run_clients(scheduler, 60, abort_every=7)
    streams |= by_completion(await generate(scheduler, PREEMPT))
    streams |= by_completion(await generate(scheduler, eos_request()[0]))
    await wait_all_free(scheduler)
    await worker_stats_after_drain(worker)
    return streams


@pytest.fixture(scope="module")
def loaded_pair() -> Iterator[tuple[Service, Service, Streams]]:
    with serving_pair([*SIM, "--kv-slots", str(KV_SLOTS)], ["--max-batch-tokens", "128"]) as (
        worker,
        scheduler,
    ):
        yield worker, scheduler, asyncio.run(load(scheduler.address, worker.address))


def test_both_endpoints_pass_promtool_and_carry_constant_labels(
    loaded_pair: tuple[Service, Service, Streams],
) -> None:
    worker, scheduler, _ = loaded_pair
    for service, names, const in (
        (scheduler, SCHEDULER_METRICS, {("mode", "overlap")}),
        (worker, WORKER_METRICS, {("model", "sim"), ("device", "cpu")}),
    ):
        expected = {n.removesuffix("_total") for n in names}
        text = settled_scrape(service, has_families(expected))
        promtool_check(text)
        assert expected <= family_names(text)
        for _, labels in samples(text):
            assert const <= labels


def test_every_service_process_froze_its_start_up_heap_before_serving(
    loaded_pair: tuple[Service, Service, Streams],
) -> None:
    """`stepahead.heap.settle` ran in the worker, the core and the frontend process: the first two
    say so on /metrics (objects frozen; the full collection before the freeze counted), and each
    says so in its log."""
    worker, scheduler, _ = loaded_pair
    for service in (worker, scheduler):
        text = scrape(service)
        assert value(text, "stepahead_gc_frozen_objects") > 10_000
        assert value(text, "stepahead_gc_collections_total", generation="2") >= 1
    frozen = [line for line in [*worker.output, *scheduler.output] if "start-up objects frozen" in line]
    for process in ("worker:", "scheduler:", "frontend 0:"):
        assert any(process in line for line in frozen), (process, frozen)


def test_counters_agree_with_what_clients_received(loaded_pair: tuple[Service, Service, Streams]) -> None:
    worker, scheduler, streams = loaded_pair
    # The forcing calls ran as designed.
    preempt = [s for key, s in streams.items() if key.startswith("preempt/")]
    assert len(preempt) == PREEMPT_N
    assert all(
        len(tokens(s)) == PREEMPT_MAX_NEW and s[-1].finish_reason == pb.FINISH_REASON_LENGTH for s in preempt
    )
    eos = streams["eos/0"]
    assert (tokens(eos), eos[-1].finish_reason) == (eos_request()[1], pb.FINISH_REASON_STOP)

    received = sum(len(r.token_ids) for s in streams.values() for r in s)

    def settled(text: str) -> bool:
        return (
            value(text, "stepahead_generation_tokens_total") == received
            and value(text, "stepahead_requests_running") == 0
            and value(text, "stepahead_kv_cache_usage_ratio") == 0
        )

    text = settled_scrape(scheduler, settled)
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
    assert value(text, "stepahead_preemptions_total") > 0  # forced by PREEMPT
    assert value(text, "stepahead_dropped_inflight_tokens_total") > 0  # forced by eos_request()
    assert value(text, "stepahead_kv_cache_usage_ratio") == 0
    assert value(text, "stepahead_requests_running") == 0
    steps = value(text, "stepahead_step_phase_seconds_count", phase="pick")
    assert steps >= value(text, "stepahead_step_phase_seconds_count", phase="launch") > 0
    batches = value(text, "stepahead_batch_size_count")
    # The worker counts a batch once it has run: the last ones may still be on their way.
    worker_text = settled_scrape(worker, lambda t: value(t, "stepahead_batches_total") == batches)
    assert value(worker_text, "stepahead_batches_total") == batches
    assert value(worker_text, "stepahead_forward_seconds_count") == batches
    assert value(worker_text, "stepahead_device_busy_seconds_total") > 0


# ---- overlap against serial: the device's idle time and the step timeline ----------------------

# The overlap loop launches batch k+1 before it waits for batch k's result, the serial loop only
# after it has processed it: asserted as such in the scheduler's own trace. On the device, the
# serial loop's every step then waits for the result's trip to the scheduler and the next launch's
# trip back; the scheduler reaches the worker over `bench.link_delay` here, so each of those trips
# takes LINK_DELAY_MS at least: a deliberate delay, whose lower bound the serial run's idle time
# must show. The overlap loop hides the trips behind a device step as long as they and the loop's
# CPU work take less than TRACE_STEP_MS (a secondary measure: the step is long against them, so a
# starved machine's stalls of tens of milliseconds are hidden too).
LINK_DELAY_MS = 20.0
TRACE_STEP_MS = 100.0
TRACE_SIM = ["--model", "sim", "--sim-step-ms", f"{TRACE_STEP_MS:g}", "--sim-token-us", "0"]
SOLO_TOKENS = 24  # a request alone first: a batch of one row a token, each launched ahead in overlap
MODES = ("serial", "overlap")


@dataclass(frozen=True)
class TracedRun:
    scheduler_trace: pathlib.Path
    worker_trace: pathlib.Path
    worker_metrics: str  # once the worker has run every launched step


@contextlib.contextmanager
def linked_pair(worker_args: list[str], scheduler_args: list[str]) -> Iterator[tuple[Service, Service]]:
    """A sim worker, and a scheduler that reaches it through `bench.link_delay`; both SERVING, and
    stopped on exit, the scheduler first."""
    worker = spawn_worker(worker_args)
    try:
        wait_serving(worker.address)
        with scheduler_behind_a_link(worker.address, LINK_DELAY_MS, scheduler_args) as scheduler:
            yield worker, scheduler
    finally:
        worker.stop()


async def traced_load(scheduler: str, worker: str) -> None:
    solo = pb.GenerateRequest(
        request_id="solo",
        input_ids=pb.TokenIds(ids=list(b"solo request")),
        sampling=pb.SamplingParams(max_new_tokens=SOLO_TOKENS, ignore_eos=True),
    )
    assert len(tokens(await generate(scheduler, solo))) == SOLO_TOKENS
    await run_clients(scheduler, 16, abort_every=1000)
    await wait_all_free(scheduler)
    await worker_stats_after_drain(worker)


def traced_run(mode: str, tmp_path: pathlib.Path) -> TracedRun:
    sched_trace, worker_trace = tmp_path / f"scheduler-{mode}.json", tmp_path / f"worker-{mode}.json"
    with linked_pair(
        [*TRACE_SIM, "--trace-file", str(worker_trace)], ["--mode", mode, "--trace-file", str(sched_trace)]
    ) as (worker, scheduler):
        asyncio.run(traced_load(scheduler.address, worker.address))
        metrics = settled_scrape(worker, lambda t: value(t, "stepahead_live_request_slots") == 0)
    return TracedRun(sched_trace, worker_trace, metrics)  # the traces are complete once both stopped


@pytest.fixture(scope="module")
def traced_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TracedRun]:
    tmp = tmp_path_factory.mktemp("traces")
    return {mode: traced_run(mode, tmp) for mode in MODES}


def spans(path: pathlib.Path, prefix: str) -> dict[int, tuple[float, float]]:
    events = json.loads(path.read_text())
    return {
        int(e["name"].split()[1]): (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e["ph"] == "X" and e["name"].startswith(prefix + " ")
    }


def launched_ahead(scheduler_trace: pathlib.Path) -> tuple[int, int]:
    """(steps k whose successor k+1 was launched before the loop waited for k's result, steps k
    whose successor was launched only after k was processed), from the scheduler's phases."""
    launch, wait, process = (spans(scheduler_trace, p) for p in ("launch", "wait", "process"))
    pairs = [(launch[k + 1], k) for k in process if k + 1 in launch]
    ahead = sum(1 for (_, launched), k in pairs if launched <= wait[k][0])
    behind = sum(1 for (started, _), k in pairs if started >= process[k][1])
    return ahead, behind


def device_seconds(worker_metrics: str) -> tuple[float, float]:
    """(busy, idle) seconds of the device."""
    busy = value(worker_metrics, "stepahead_device_busy_seconds_total")
    return busy, value(worker_metrics, "stepahead_device_idle_seconds_total")


def idle_fraction(worker_metrics: str) -> float:
    busy, idle = device_seconds(worker_metrics)
    return idle / (busy + idle)


def test_overlap_leaves_the_device_less_idle_than_serial(traced_runs: dict[str, TracedRun]) -> None:
    # The cause, structurally: overlap launches the next batch before it waits for a result (at
    # each token of the solo request at least), serial never does.
    ahead, _ = launched_ahead(traced_runs["overlap"].scheduler_trace)
    assert ahead >= SOLO_TOKENS - 1
    ahead, behind = launched_ahead(traced_runs["serial"].scheduler_trace)
    assert ahead == 0 and behind >= SOLO_TOKENS - 1
    # Serial: between two of the solo request's steps, a result and a launch crossed the link.
    _, serial_idle = device_seconds(traced_runs["serial"].worker_metrics)
    assert serial_idle >= (SOLO_TOKENS - 1) * 2 * LINK_DELAY_MS / 1e3
    serial, overlap = (idle_fraction(traced_runs[mode].worker_metrics) for mode in MODES)
    assert overlap < serial, (overlap, serial)


def overlapping(forward: dict[int, tuple[float, float]], process: dict[int, tuple[float, float]]) -> int:
    """Steps k whose forward overlaps the processing of k-1."""
    return sum(
        1
        for k, (fs, fe) in forward.items()
        if k - 1 in process and fs < process[k - 1][1] and process[k - 1][0] < fe
    )


def test_trace_shows_forward_k_overlapping_process_k_minus_1(traced_runs: dict[str, TracedRun]) -> None:
    for mode, run in traced_runs.items():
        lanes = {
            e["args"]["name"]
            for f in (run.scheduler_trace, run.worker_trace)
            for e in json.loads(f.read_text())
            if e["name"] == "thread_name"
        }
        assert {"scheduler", "device", "copy"} <= lanes
        forward, process = spans(run.worker_trace, "forward"), spans(run.scheduler_trace, "process")
        assert len(forward) > 20 and len(process) > 20
        if mode == "overlap":
            assert overlapping(forward, process) > len(forward) // 2
        else:  # structural: forward k is launched after process k-1 has ended
            assert overlapping(forward, process) == 0
