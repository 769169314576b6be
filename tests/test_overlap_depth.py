"""N-step-ahead scheduling (`--overlap-depth N|auto`, scheduler_svc/engine/depth.py): any depth gives
serial's tokens, finishes exactly, drops only unstreamed tokens and frees every slot, with and
without a slow link; auto picks the depth a link needs."""

from __future__ import annotations

import asyncio
import contextlib
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from scheduler_svc.contract import FinishReason
from scheduler_svc.engine.core import EngineCore
from scheduler_svc.engine.depth import AUTO, DepthConfig, OverlapDepth, parse_depth
from stepahead.processes import STOP_TIMEOUT_S, Service, spawn_worker, wait_serving
from stepahead.v1 import generation_pb2_grpc
from tests.harness import (
    ClientView,
    WorkItem,
    mixed_workload,
    params,
    record_depth,
    serve_workload,
    with_forced_scenarios,
)
from tests.live import CALL_TIMEOUT_S, generate, scheduler_behind_a_link, unused_port, wait_all_free
from tests.test_equivalence import (
    EOS,
    assert_same_tokens,
    check_client_views,
    check_drained,
    sim_reference,
    to_proto,
)
from tests.test_sampling_equivalence import assert_same_outputs, check_views, features_workload
from worker_svc.backends import sim_continuation
from worker_svc.engine import WorkerEngine

pytestmark = pytest.mark.anyio

SIM = dict(kv_slots=1200, request_slots=48)
DEPTHS = (1, 2, 3)

# ---- the controller ------------------------------------------------------------------------


def test_parse_depth() -> None:
    assert parse_depth("3") == 3 and parse_depth("auto") == AUTO
    for bad in ("0", "9", "two", "-1"):
        with pytest.raises(ValueError):
            parse_depth(bad)


def test_a_fixed_depth_never_moves() -> None:
    depth = OverlapDepth(DepthConfig(3))
    for _ in range(100):
        depth.observe(0.05, 0.01, 0.001)  # a link that would call for the maximum
    assert depth.current == 3


def test_auto_covers_the_round_trip_and_the_cpu_work_with_its_margin() -> None:
    depth = OverlapDepth(DepthConfig(AUTO, smoothing=1.0))
    assert depth.current == 1
    depth.observe(0.0003, 0.002, 0.010)  # loopback: 2.3 ms of a 10 ms step
    assert depth.current == 1
    depth.observe(0.010, 0.002, 0.010)  # 5 ms each way: (10 + 2) x 1.25 / 10 = 1.5
    assert depth.current == 2
    depth.observe(0.030, 0.002, 0.010)
    assert depth.current == 4
    depth.observe(10.0, 0.002, 0.010)
    assert depth.current == DepthConfig().max_depth


def test_auto_goes_deeper_at_once_and_shallower_one_step_at_a_time_once_it_has_held() -> None:
    depth = OverlapDepth(DepthConfig(AUTO, smoothing=1.0, hold_steps=5))
    depth.observe(0.030, 0.002, 0.010)
    assert depth.current == 4
    for _ in range(4):
        depth.observe(0.0, 0.001, 0.010)
    assert depth.current == 4  # not yet held long enough
    depth.observe(0.0, 0.001, 0.010)
    assert depth.current == 3
    for _ in range(10):
        depth.observe(0.0, 0.001, 0.010)
    assert depth.current == 1


def test_auto_without_measurements_stays_one_step_ahead() -> None:
    depth = OverlapDepth(DepthConfig(AUTO, smoothing=1.0))
    depth.observe(None, 0.001, 0.0)  # no link round trip, no device time yet
    assert depth.current == 1


# ---- the loop at depth N, in process ---------------------------------------------------------


async def serve_at(
    model: str, items: list[WorkItem], depth: int, delay_s: float, **kw: object
) -> tuple[dict[str, ClientView], EngineCore, WorkerEngine, int]:
    """The workload in overlap at `depth` behind a link of `delay_s`; with the most batches the
    core ever had launched and not processed."""
    sizes: list[list[int]] = []
    got, core, engine = await serve_workload(
        model,
        "overlap",
        items,
        depth=depth,
        link_delay_s=delay_s,
        instrument=lambda core: sizes.append(record_depth(core)),
        **kw,  # type: ignore[arg-type]
    )
    return got, core, engine, max(sizes[0], default=0)


@pytest.mark.parametrize("delay_ms", [0.0, 2.0], ids=["loopback", "2ms-link"])
async def test_sim_at_every_depth_equals_serial_and_the_reference(delay_ms: float) -> None:
    items = with_forced_scenarios(mixed_workload(200, seed=21, sampled=False), SIM["kv_slots"], sampled=False)
    serial, _, _ = await serve_workload("sim", "serial", items, **SIM)  # type: ignore[arg-type]
    for depth in DEPTHS:
        got, core, engine, most_in_flight = await serve_at("sim", items, depth, delay_ms / 1e3, **SIM)
        check_client_views(items, got)
        check_drained(core, engine)
        assert core.stats.preemptions > 0, "the workload must exercise preemption"
        assert_same_tokens(items, serial, got)
        for item in items:
            if item.abort_after is None:  # no token after a finish, exact length finishes
                assert (got[item.rid].token_ids, got[item.rid].finish_reason) == sim_reference(item)
        # The loop ran `depth` batches ahead of the one it processed, not fewer, never more.
        assert most_in_flight == depth + 1, (depth, most_in_flight)
    assert any(serial[i.rid].token_ids[-1:] == [EOS] for i in items), "some requests must end on EOS"


def stop_finishing_requests() -> list[WorkItem]:
    """Requests that end on EOS or a stop token the sim is known to produce, some before and
    some within `max(DEPTHS)` tokens of their max_new_tokens; all sent at once."""
    items = []
    for i in range(24):
        prompt = [40 + i, 50 + i % 7, 60 + i % 5]
        out = sim_continuation(prompt, 64)
        stop_at = 3 + i % 20  # the index of the token that ends it
        stop = frozenset({out[stop_at]}) - set(out[:stop_at])
        max_new = stop_at + 1 + i % 4  # 1..4 tokens of room left after the stop
        if stop and EOS not in out[: stop_at + 1]:
            items.append(
                WorkItem(f"s{i}", prompt, params(max_new, stop_token_ids=stop, ignore_eos=True), 0.0)
            )
    assert len(items) >= 12
    return items


async def test_each_stop_finish_drops_exactly_the_tokens_launched_after_it() -> None:
    """At depth D, a request that ends on a stop token has been launched in up to D more
    batches (not beyond its max_new_tokens), whose tokens are dropped, never streamed; serial
    drops none. All requests arrive together and fit one batch, so every running request is in
    every batch: the count is exact, whatever the machine's speed."""
    items = stop_finishing_requests()
    kw: dict[str, object] = dict(kv_slots=4000, request_slots=48, max_batch_tokens=512)
    serial, core, _ = await serve_workload("sim", "serial", items, **kw)  # type: ignore[arg-type]
    assert core.stats.dropped_inflight_tokens == 0
    for depth in DEPTHS:
        got, core, engine, _ = await serve_at("sim", items, depth, 0.0, **kw)
        check_drained(core, engine)
        assert_same_tokens(items, serial, got)
        assert all(got[i.rid].finish_reason == FinishReason.STOP for i in items)
        room = [i.params.max_new_tokens - len(got[i.rid].token_ids) for i in items]
        assert core.stats.dropped_inflight_tokens == sum(min(depth, r) for r in room), depth


async def test_every_sampling_feature_at_depth_3_equals_serial() -> None:
    """Penalties, logit_bias, min_tokens, logprobs and n > 1 on tiny (float64), behind a 1 ms
    link: the token history on the worker counts three launches ahead of what the scheduler has
    seen (four batches in flight, checked)."""
    items = features_workload(120, seed=31, sampled=True, kv_slots=1500)
    kw: dict[str, object] = dict(kv_slots=1500, request_slots=48, dtype=torch.float64)
    serial, _, _ = await serve_workload("tiny", "serial", items, **kw)  # type: ignore[arg-type]
    got, core, engine, most_in_flight = await serve_at("tiny", items, 3, 0.001, **kw)
    check_views(items, got)
    check_drained(core, engine)
    assert core.stats.preemptions > 0, "the workload must exercise preemption"
    assert most_in_flight == 4
    assert_same_outputs(items, serial, got)


# A step far longer than the loop's work per step (about a millisecond here, tens when starved),
# so that auto has no reason to go deeper than 1 without a slow link on any machine of this kind.
LONG_STEP_MS = 100.0


async def test_auto_deepens_for_a_slow_link_and_stays_one_step_ahead_without_one() -> None:
    fast_items = [WorkItem(f"r{i}", [65 + i % 26] * 8, params(12, ignore_eos=True), 0.0) for i in range(8)]
    fast_kw: dict[str, object] = dict(kv_slots=20000, request_slots=48, sim_step_ms=LONG_STEP_MS)
    _, fast, _, _ = await serve_at("sim", fast_items, AUTO, 0.0, **fast_kw)
    assert fast.depth.current == 1
    items = [WorkItem(f"r{i}", [65 + i % 26] * 8, params(120, ignore_eos=True), 0.0) for i in range(32)]
    kw: dict[str, object] = dict(kv_slots=20000, request_slots=48, sim_step_ms=10.0)
    _, slow, _, most_in_flight = await serve_at("sim", items, AUTO, 0.006, **kw)
    # 6 ms each way: 12 ms of round trip a 10 ms step must cover, so 2 at least.
    assert slow.depth.current >= 2 and most_in_flight >= 3, (slow.depth.current, most_in_flight)
    assert slow.depth.link_rtt.value is not None and slow.depth.link_rtt.value >= 0.012


async def test_auto_does_not_count_idle_time_as_the_loops_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pause between two bursts is not CPU work between a result and the next launch."""
    pause_s = 2.0
    burst = [WorkItem(f"a{i}", [70 + i] * 6, params(6, ignore_eos=True), 0.0) for i in range(8)]
    later = [
        WorkItem(f"b{i}", [80 + i] * 6, params(6, ignore_eos=True), pause_s if i == 0 else 0.0)
        for i in range(8)
    ]
    samples: list[float] = []
    observe = OverlapDepth.observe

    def recording(depth: OverlapDepth, rtt: float | None, cpu: float, step: float) -> None:
        samples.append(cpu)
        observe(depth, rtt, cpu, step)

    monkeypatch.setattr(OverlapDepth, "observe", recording)
    kw: dict[str, object] = dict(kv_slots=4000, request_slots=48, sim_step_ms=LONG_STEP_MS)
    _, core, _ = await serve_workload("sim", "overlap", burst + later, depth=AUTO, **kw)  # type: ignore[arg-type]
    assert core.depth.current == 1
    # The pause is in no sample: each is the loop's work alone (a millisecond or so here; the
    # bound is a hang guard far above it and far below the pause).
    assert len(samples) >= 4 and max(samples) < pause_s / 2, samples


def test_the_finish_reasons_are_the_workloads() -> None:
    """The workload above has every kind of ending (a guard on the tests, not the code)."""
    items = mixed_workload(200, seed=21, sampled=False)
    reasons = {sim_reference(i)[1] for i in items if i.abort_after is None}
    assert reasons == {FinishReason.LENGTH, FinishReason.STOP}


# ---- through live processes, behind the link-delay proxy -------------------------------------

LIVE_SIM = ["--model", "sim", "--sim-token-us", "0", "--check-invariants", "--kv-slots", "20000"]


def live_requests(count: int, new_tokens: int) -> list[WorkItem]:
    return [
        WorkItem(f"l{i}", [66 + i % 20] * (4 + i % 7), params(new_tokens, ignore_eos=True), 0.0)
        for i in range(count)
    ]


async def stream(address: str, item: WorkItem, started: asyncio.Event) -> list[int]:
    """One request's tokens; `started` is set once the first has arrived."""
    tokens: list[int] = []
    async with grpc.aio.insecure_channel(address) as channel:
        call = generation_pb2_grpc.GenerationStub(channel).Generate(to_proto(item), timeout=CALL_TIMEOUT_S)
        async for response in call:
            tokens += response.token_ids
            started.set()
    return tokens


async def generate_all(address: str, items: list[WorkItem]) -> list[list[int]]:
    async def one(item: WorkItem) -> list[int]:
        return [t for r in await generate(address, to_proto(item)) for t in r.token_ids]

    return await asyncio.gather(*(one(item) for item in items))


def metric(service: Service, name: str) -> float:
    with urllib.request.urlopen(service.metrics_url, timeout=CALL_TIMEOUT_S) as response:
        text = response.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


@dataclass
class LinkedWorker:
    """A sim worker on a port of its own, which it keeps when replaced."""

    args: list[str]
    port: int
    service: Service

    def restart(self) -> None:
        self.service.proc.kill()
        self.service.proc.wait(STOP_TIMEOUT_S)
        self.service = spawn_worker(self.args, self.port)


@contextlib.contextmanager
def behind_a_link(step_ms: float, delay_ms: float, depth: str) -> Iterator[tuple[LinkedWorker, Service]]:
    """A sim worker, and an overlap scheduler at `depth` that reaches it through
    `bench.link_delay` (`delay_ms` each way)."""
    args, port = [*LIVE_SIM, "--sim-step-ms", f"{step_ms:g}"], unused_port()
    worker = LinkedWorker(args, port, spawn_worker(args, port))
    try:
        wait_serving(worker.service.address)
        # --worker-retry-timeout: a hang guard; a restarted worker is back in seconds.
        flags = ["--overlap-depth", depth, "--worker-retry-timeout", "600"]
        with scheduler_behind_a_link(worker.service.address, delay_ms, flags) as scheduler:
            yield worker, scheduler
    finally:
        worker.service.stop()


def test_worker_loss_with_three_batches_in_flight_over_a_slow_link_loses_nothing() -> None:
    items = live_requests(32, 240)
    with behind_a_link(3.0, 2.0, "3") as (worker, scheduler):

        async def load_with_a_crash() -> list[list[int]]:
            started = [asyncio.Event() for _ in items]
            calls = asyncio.gather(
                *(stream(scheduler.address, i, e) for i, e in zip(items, started, strict=True))
            )
            for event in started:  # every request decoding: batches launched ahead of the results
                await event.wait()
            assert not calls.done()
            await asyncio.to_thread(worker.restart)
            return await calls

        got = asyncio.run(load_with_a_crash())
        assert got == [sim_reference(item)[0] for item in items]
        asyncio.run(wait_all_free(scheduler.address))
        assert "requests wait for a worker" in "".join(scheduler.output)
        assert metric(scheduler, "stepahead_overlap_depth") == 3
        assert metric(scheduler, "stepahead_overlap_depth_configured") == 3
        rtt_sum = metric(scheduler, "stepahead_worker_link_rtt_seconds_sum")
        rtt_count = metric(scheduler, "stepahead_worker_link_rtt_seconds_count")
        assert rtt_count > 100 and rtt_sum / rtt_count >= 0.004  # 2 ms each way


def test_auto_deepens_behind_a_5ms_link_through_the_services() -> None:
    items = live_requests(48, 150)
    with behind_a_link(10.0, 5.0, "auto") as (_, scheduler):
        got = asyncio.run(generate_all(scheduler.address, items))
        assert got == [sim_reference(item)[0] for item in items]
        assert metric(scheduler, "stepahead_overlap_depth_configured") == 0  # auto
        assert metric(scheduler, "stepahead_overlap_depth") >= 2
