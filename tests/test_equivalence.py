"""Invariants 1-4 of the design notes on one mixed workload, serial vs overlap."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from bench.promtext import scrape, total
from scheduler_svc.contract import FinishReason
from scheduler_svc.engine.core import EngineCore
from stepahead.processes import Link, serving_pair
from stepahead.v1 import generation_pb2 as pb
from stepahead.v1 import generation_pb2_grpc
from tests.harness import (
    ClientView,
    WorkItem,
    mixed_workload,
    preempting_call,
    serve_workload,
    with_forced_scenarios,
)
from tests.live import (
    CALL_TIMEOUT_S,
    FRONTEND_COUNTS,
    channels_by_frontend,
    frontend_flags,
    wait_all_free,
    worker_stats_after_drain,
)
from worker_svc.backends import sim_next_token
from worker_svc.engine import WorkerEngine

pytestmark = pytest.mark.anyio

EOS = 257


def sim_reference(item: WorkItem) -> tuple[list[int], FinishReason]:
    """What the sim device must produce for this request, computed on the host."""
    p = item.params
    seq = list(item.prompt_ids)
    out: list[int] = []
    while len(out) < p.max_new_tokens:
        token = sim_next_token(seq[-1], len(seq))
        seq.append(token)
        out.append(token)
        if token in p.stop_token_ids or (token == EOS and not p.ignore_eos):
            return out, FinishReason.STOP
        text = bytes(t for t in out if t < 256).decode()
        if any(stop in text for stop in p.stop):
            return out, FinishReason.STOP
    return out, FinishReason.LENGTH


def check_client_views(items: list[WorkItem], views: dict[str, ClientView]) -> None:
    """No token after a finish; a length finish gives exactly max_new_tokens."""
    for item in items:
        view = views[item.rid]
        assert view.finish_reason is not None
        assert view.completion_tokens == sorted(view.completion_tokens)
        assert view.completion_tokens[-1] == len(view.token_ids)
        if view.finish_reason == FinishReason.LENGTH:
            assert len(view.token_ids) == item.params.max_new_tokens
        assert len(view.token_ids) <= item.params.max_new_tokens
        if view.finish_reason == FinishReason.ABORT:
            assert item.abort_after is not None
        for stop in item.params.stop:
            assert stop not in view.text


def check_drained(core: EngineCore, engine: WorkerEngine) -> None:
    """Every KV slot free or held, unreferenced, by the prefix cache; every request slot free;
    the sentinel never read; launch order kept."""
    policy, tree = core.policy, core.policy.kv.tree
    assert policy.kv.num_free + tree.size == policy.kv.capacity
    assert tree.evictable == tree.size, "a cached prefix is still referenced after the drain"
    assert policy.req_slots.num_used == 0
    assert not policy.running and not policy.waiting and not policy.requests
    assert not core.result_queue
    stats = engine.stats()
    assert stats.live_request_slots == 0
    assert stats.sentinel_reads == 0
    assert stats.out_of_order_launches == 0
    assert stats.steps_executed == core.stats.steps == stats.last_step_id
    assert core.stats.results_out_of_order == 0


def assert_same_tokens(items: list[WorkItem], a: dict[str, ClientView], b: dict[str, ClientView]) -> None:
    for item in items:
        va, vb = a[item.rid], b[item.rid]
        aborted = [v for v in (va, vb) if v.finish_reason == FinishReason.ABORT]
        if not aborted:
            assert va.token_ids == vb.token_ids, item.rid
            assert va.finish_reason == vb.finish_reason, item.rid
            continue
        # An abort lands after a timing-dependent number of tokens: compare the prefix.
        assert all(len(v.token_ids) >= (item.abort_after or 0) for v in aborted), item.rid
        n = min(len(va.token_ids), len(vb.token_ids))
        assert va.token_ids[:n] == vb.token_ids[:n], item.rid


async def serve_both(model: str, items: list[WorkItem], **kw: object) -> dict[str, dict[str, ClientView]]:
    views, dropped = {}, {}
    for mode in ("serial", "overlap"):
        got, scheduler, engine = await serve_workload(model, mode, items, **kw)  # type: ignore[arg-type]
        check_client_views(items, got)
        check_drained(scheduler, engine)
        dropped[mode] = scheduler.stats.dropped_inflight_tokens
        assert scheduler.stats.preemptions > 0, "the workload must exercise preemption"
        views[mode] = got
    assert_same_tokens(items, views["serial"], views["overlap"])
    # Serial drops only the in-flight token of a client abort; overlap also
    # the extra token of each request that ended on EOS/stop with batch k+1 launched.
    assert dropped["serial"] <= sum(item.abort_after is not None for item in items)
    assert dropped["overlap"] > dropped["serial"]
    return views


async def test_sim_overlap_equals_serial_and_the_host_reference() -> None:
    items = with_forced_scenarios(mixed_workload(240, seed=1, sampled=False), 1200, sampled=False)
    views = await serve_both("sim", items, kv_slots=1200, request_slots=48)
    reasons = {v.finish_reason for v in views["overlap"].values()}
    assert reasons == {FinishReason.LENGTH, FinishReason.STOP, FinishReason.ABORT}
    for item in items:
        expected, reason = sim_reference(item)
        got = views["overlap"][item.rid]
        if item.abort_after is None:
            assert (got.token_ids, got.finish_reason) == (expected, reason), item.rid
        else:
            assert got.token_ids == expected[: len(got.token_ids)], item.rid
    eos_finishes = [i for i in items if views["serial"][i.rid].token_ids[-1:] == [EOS]]
    assert eos_finishes, "the workload must finish some requests on EOS"


async def test_sim_overlap_with_late_pick_equals_serial() -> None:
    # The worker's clock seems a second ahead of the handshake's, so each in-flight forward seems
    # to end later than it does: every pick is held back (by a step at most), whatever the speed.
    items = mixed_workload(200, seed=4, sampled=False)
    kw: dict[str, object] = dict(kv_slots=1200, request_slots=48, sim_step_ms=6.0)
    serial, _, _ = await serve_workload("sim", "serial", items, **kw)  # type: ignore[arg-type]
    late, core, engine = await serve_workload(
        "sim",
        "overlap",
        items,
        late_pick=True,
        clock_skew_s=1.0,
        **kw,  # type: ignore[arg-type]
    )
    check_client_views(items, late)
    check_drained(core, engine)
    assert_same_tokens(items, serial, late)
    assert core.late_pick.late_picks > 0, "no pick was held back: the test cannot fail for late pick"


# ---- the same invariants through live processes, with the frontend in 0 or 2 processes -------

LIVE_SIM = ["--model", "sim", "--sim-step-ms", "1", "--sim-token-us", "0", "--check-invariants"]
LIVE_SIM += ["--kv-slots", "1200", "--request-slots", "48"]


def to_proto(item: WorkItem) -> pb.GenerateRequest:
    p = item.params
    sampling = pb.SamplingParams(
        max_new_tokens=p.max_new_tokens,
        seed=p.seed,
        stop_token_ids=sorted(p.stop_token_ids),
        stop=list(p.stop),
        ignore_eos=p.ignore_eos,
        n=item.n,
    )
    return pb.GenerateRequest(
        request_id=item.rid, input_ids=pb.TokenIds(ids=item.prompt_ids), sampling=sampling
    )


async def live_client(
    channel: grpc.aio.Channel, abort_channel: grpc.aio.Channel, item: WorkItem
) -> tuple[list[ClientView], str]:
    """One call (a view per completion); an abort goes through another channel (often another
    frontend)."""
    views = [ClientView() for _ in range(item.n)]
    call = generation_pb2_grpc.GenerationStub(channel).Generate(to_proto(item), timeout=CALL_TIMEOUT_S)
    async for r in call:
        view = views[r.index]
        view.messages += 1
        view.token_ids += r.token_ids
        view.text += r.text
        view.completion_tokens.append(r.completion_tokens)
        view.finish_reason = FinishReason(r.finish_reason) if r.finish_reason else None
        first = views[0]
        if (
            item.abort_after is not None
            and len(first.token_ids) >= item.abort_after
            and not first.finish_reason
        ):
            abort = pb.AbortRequest(request_id=item.rid)
            await generation_pb2_grpc.GenerationStub(abort_channel).Abort(abort, timeout=CALL_TIMEOUT_S)
            item = WorkItem(item.rid, item.prompt_ids, item.params, item.delay_s, n=item.n)  # abort once
    frontend = str(dict(await call.trailing_metadata())["stepahead-frontend"])
    return views, frontend


async def serve_live(
    address: str, frontends: int, items: list[WorkItem]
) -> dict[str, tuple[ClientView, str]]:
    """Each completion's view (keyed as serve_workload keys them) and the frontend it came from."""
    groups = await channels_by_frontend(address, frontends, per_frontend=3)
    channels = [c for group in zip(*groups.values(), strict=True) for c in group]  # alternate frontends
    try:
        tasks = {}
        for i, item in enumerate(items):
            await asyncio.sleep(item.delay_s)
            pair = channels[i % len(channels)], channels[(i + 1) % len(channels)]
            tasks[item.rid] = asyncio.create_task(live_client(*pair, item))
        served = {}
        for rid, task in tasks.items():
            views, frontend = await task
            served.update({rid if i == 0 else f"{rid}/{i}": (view, frontend) for i, view in enumerate(views)})
        return served
    finally:
        for channel in channels:
            await channel.close()


def live_run(
    mode: str, frontends: int, items: list[WorkItem], link: Link = "grpc"
) -> tuple[dict[str, tuple[ClientView, str]], float]:
    """Client views (and the frontend of each), and the preemptions the core counted."""
    flags = ["--mode", mode, "--max-batch-tokens", "128", *frontend_flags(frontends)]
    with serving_pair(LIVE_SIM, flags, link=link) as (worker, scheduler):

        async def run() -> dict[str, tuple[ClientView, str]]:
            got = await serve_live(scheduler.address, frontends, items)
            await wait_all_free(scheduler.address)
            stats = await worker_stats_after_drain(worker.address)
            assert stats.sentinel_reads == 0 and stats.out_of_order_launches == 0
            assert stats.steps_executed == stats.last_step_id
            return got

        views = asyncio.run(run())
        preemptions = total(scrape(scheduler.metrics_url), "stepahead_preemptions_total")
    return views, preemptions


@pytest.mark.parametrize(
    ("frontends", "link"),
    [*((n, "grpc") for n in FRONTEND_COUNTS), (FRONTEND_COUNTS[-1], "socket")],
    ids=lambda v: f"frontends={v}" if isinstance(v, int) else f"{v} link",
)
def test_live_overlap_equals_serial_whatever_the_frontends(frontends: int, link: Link) -> None:
    items = [
        preempting_call("forced-preempt", 1200, sampled=False),
        *mixed_workload(160, seed=7, sampled=False),
    ]
    served = {mode: live_run(mode, frontends, items, link) for mode in ("serial", "overlap")}
    views = {mode: {rid: view for rid, (view, _) in got.items()} for mode, (got, _) in served.items()}
    for mode, (got, preemptions) in served.items():
        check_client_views(items, views[mode])
        assert preemptions > 0, "the workload must exercise preemption"
        assert len({frontend for _, frontend in got.values()}) == max(frontends, 1), (
            "spread over every frontend"
        )
    assert_same_tokens(items, views["serial"], views["overlap"])
    string_stops = [
        i for i in items if views["overlap"][i.rid].finish_reason == FinishReason.STOP and i.params.stop
    ]
    assert string_stops, "some requests must end on a stop string (found by a frontend)"
    for item in items:  # and what the sim must produce, computed on the host
        expected, reason = sim_reference(item)
        view = views["overlap"][item.rid]
        if item.abort_after is None:
            assert (view.token_ids, view.finish_reason) == (expected, reason), item.rid
