"""The prefix cache under both loops: outputs identical with the cache on and off on a
workload of heavy prefix sharing (shared system prompts, multi-turn chats that resend their
history, n > 1), with aborts, chunked prefills of cached and uncached parts, preemptions and
eviction pressure; and after the drain every KV slot is free or held, unreferenced, by the tree."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from scheduler_svc.contract import FinishReason
from scheduler_svc.engine.core import EngineCore
from scheduler_svc.engine.kv.manager import KvManager
from scheduler_svc.engine.outputs import Outbox
from scheduler_svc.engine.policy import PolicyConfig, SchedulingPolicy
from scheduler_svc.engine.request import Request
from scheduler_svc.engine.telemetry import SchedulerTelemetry
from scheduler_svc.process.cli import parse_args
from stepahead.protocol import TokenizerSpec, WorkerInfo
from tests.harness import ClientView, WorkItem, aborted_call, params, preempting_call, serve_workload
from tests.test_equivalence import check_drained
from tests.test_sampling_equivalence import assert_same_outputs

pytestmark = pytest.mark.anyio


SHARED_COMPLETIONS = 16


def forced_cache_scenarios(systems: list[list[int]], kv_slots: int) -> list[WorkItem]:
    """What the cache must see whatever the timing, each call sent once the one before it has
    ended, before any other load:
    - reuse: two rounds over the system prompts of calls of SHARED_COMPLETIONS completions
      (completions 1..n-1 reuse completion 0's prompt, a second round's completion 0 the first
      round's system prompt): at least forced_reuse(systems) cached prompt tokens;
    - eviction: two prompts of 2/3 of the pool each, the second after the first has ended and
      left its KV to the tree, so the tree must give up slots;
    - preemption (preempting_call) and an abort before the first token (aborted_call), which
      the random load follows at once."""
    items: list[WorkItem] = []
    for i, system in enumerate(systems * 2):
        p = params(3, ignore_eos=True, temperature=1.0, seed=i)
        after = items[-1].rid if items else None
        items.append(WorkItem(f"share{i}", [*system, 65 + i], p, 0.0, n=SHARED_COMPLETIONS, after=after))
    rng = random.Random(len(systems))
    for name in ("evict-a", "evict-b"):
        prompt = [rng.randrange(32, 127) for _ in range(kv_slots * 2 // 3)]
        items.append(WorkItem(name, prompt, params(1, ignore_eos=True), 0.0, after=items[-1].rid))
    preempt = preempting_call("forced-preempt", kv_slots, sampled=False)
    items.append(replace(preempt, after=items[-1].rid))
    return [*items, aborted_call("forced-abort-0", 0)]


def forced_reuse(systems: list[list[int]]) -> int:
    """The cached prompt tokens forced_cache_scenarios guarantees: every completion but the
    first of each call reuses its prompt less the last token."""
    return 2 * sum((SHARED_COMPLETIONS - 1) * len(system) for system in systems)


def system_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(32, 127) for _ in range(rng.randint(60, 180))] for _ in range(3)]


def shared_prefix_workload(count: int, seed: int, kv_slots: int) -> list[WorkItem]:
    """The forced scenarios, then system prompts shared by many requests, chats that resend a
    growing history, a few requests with n > 1 or penalties, and client aborts."""
    systems = system_prompts(seed)
    rng = random.Random(seed + 1)
    history: list[int] = []
    items = forced_cache_scenarios(systems, kv_slots)
    for i in range(count):
        kind = rng.random()
        if kind < 0.3:  # the next turn of one conversation: its whole history again, and more
            history = history + [rng.randrange(32, 127) for _ in range(rng.randint(4, 20))]
            prompt = systems[0] + history
        else:
            prompt = rng.choice(systems) + [rng.randrange(32, 127) for _ in range(rng.randint(1, 24))]
        p = params(rng.randint(1, 24), ignore_eos=rng.random() < 0.5, seed=rng.getrandbits(63))
        if rng.random() < 0.2:
            p = replace(p, temperature=1.0)
        if rng.random() < 0.1:
            p = replace(p, frequency_penalty=1.0)  # penalized: computes its whole prompt
        abort_after = rng.randint(0, 4) if rng.random() < 0.15 else None  # 0: mid-prefill
        n = 2 if rng.random() < 0.1 else 1
        items.append(WorkItem(f"p{i}", prompt, p, rng.expovariate(1 / 0.004), abort_after, n))
    return items


POOL = 900  # KV slots: far fewer than the workload's working set


async def serve(mode: str, items: list[WorkItem], cache: bool) -> tuple[dict[str, ClientView], EngineCore]:
    # float64 keeps a row's results independent of its batch to ~1e-15, so KV computed in another
    # request's batch cannot flip a token; the pool is far smaller than the working set.
    views, core, engine = await serve_workload(
        "tiny", mode, items, kv_slots=POOL, request_slots=32, dtype=torch.float64, prefix_cache=cache
    )
    check_drained(core, engine)
    return views, core


async def test_outputs_are_the_same_with_the_cache_on_and_off_in_both_loops() -> None:
    items = shared_prefix_workload(120, seed=5, kv_slots=POOL)
    assert forced_reuse(system_prompts(5)) > 10_000
    reference, _ = await serve("serial", items, cache=False)
    for mode in ("serial", "overlap"):
        views, core = await serve(mode, items, cache=True)
        assert_same_outputs(items, reference, views)
        cache = core.policy.kv
        assert cache.cached_prompt_tokens >= forced_reuse(system_prompts(5)), (
            "the workload must reuse prefixes"
        )
        assert cache.evicted > 0, "the workload must put the cache under eviction pressure"
        assert core.stats.preemptions > 0, "the workload must preempt"
    overlap_off, _ = await serve("overlap", items, cache=False)
    assert_same_outputs(items, reference, overlap_off)
    aborted = [v for v in reference.values() if v.finish_reason == FinishReason.ABORT]
    assert any(not v.token_ids for v in aborted), "some requests must be aborted before their first token"


async def test_a_prompt_cached_by_the_batch_before_reads_the_same_kv_as_without_the_cache() -> None:
    """A request whose prompt the previous step inserted, admitted and decoding right after it
    (the situation of a prefix inserted one step late), gets the tokens it gets uncached."""
    rng = random.Random(3)
    prompt = [rng.randrange(32, 127) for _ in range(90)]
    first = WorkItem("first", prompt, params(12, ignore_eos=True), 0.0)
    # Sent as the client of "first" sees its first token: the core kept its prompt in the tree
    # as it processed that token, and picks the followers with the next batch.
    follow = [
        WorkItem(
            f"f{i}",
            prompt + [65 + i] * i,
            params(12, ignore_eos=True),
            0.0,
            after="first",
            after_first_token=True,
        )
        for i in range(6)
    ]
    items = [first, *follow]
    uncached, _ = await serve("overlap", items, cache=False)
    cached, core = await serve("overlap", items, cache=True)
    assert_same_outputs(items, uncached, cached)
    assert core.policy.kv.cached_prompt_tokens >= 5 * (len(prompt) - 1)


def test_the_cache_is_on_by_default_and_no_prefix_cache_turns_it_off() -> None:
    assert parse_args([]).core.policy.prefix_cache
    assert not parse_args(["--no-prefix-cache"]).core.policy.prefix_cache


async def test_with_the_cache_off_nothing_is_matched_or_kept() -> None:
    items = shared_prefix_workload(30, seed=9, kv_slots=POOL)
    _, core, _ = await serve_workload("sim", "overlap", items, kv_slots=POOL, prefix_cache=False)
    assert core.policy.kv.cached_prompt_tokens == 0 and core.policy.kv.tree.size == 0
    assert core.policy.kv.num_free == core.policy.kv.capacity


async def test_the_n_completions_of_a_call_share_its_prompt() -> None:
    rng = random.Random(4)
    prompt = [rng.randrange(32, 127) for _ in range(120)]
    items = [WorkItem("n4", prompt, params(10, temperature=1.0, seed=7, ignore_eos=True), 0.0, n=4)]
    uncached, _ = await serve("overlap", items, cache=False)
    cached, core = await serve("overlap", items, cache=True)
    assert_same_outputs(items, uncached, cached)
    assert core.policy.kv.cached_prompt_tokens == 3 * (len(prompt) - 1)


def test_a_new_worker_session_starts_with_an_empty_cache() -> None:
    policy = SchedulingPolicy(PolicyConfig(), Outbox(), SchedulerTelemetry("overlap"))
    info = WorkerInfo("tiny", 258, 2048, (257,), None, 64, 4, "cpu", TokenizerSpec("byte"))
    policy.begin_session(info)
    req = Request("r", [1, 2, 3, 4], params(1), 0)
    policy.kv.allocate(req, 3)
    req.num_computed = 3
    policy.kv.keep(req, 3)
    assert policy.kv.tree.size == 3
    policy.begin_session(info)
    assert policy.kv.tree.size == 0 and policy.kv.num_free == policy.kv.capacity


def test_a_request_s_end_frees_exactly_the_slots_the_tree_does_not_hold() -> None:
    """Two requests of one prompt, both computed before either was kept: the second's prompt
    slots duplicate the tree's and stay its own; each keeps its own outputs; one ends with a
    position allocated past what it computed, one is matched and lost with its session
    (computed=False). Every slot ends free or in the tree, none freed twice (the allocator
    raises), and the tree gives the rest back."""
    kv = KvManager(64, True, SchedulerTelemetry("overlap"))
    prompt = list(range(1, 9))
    first, second = Request("a", list(prompt), params(8), 0), Request("b", list(prompt), params(8), 1)
    for req in (first, second):
        assert not kv.reuse_prefix(req)
        kv.allocate(req, len(prompt))
        req.num_computed = len(prompt)
    kv.keep(first, len(prompt))
    kv.keep(second, len(prompt))  # all cached already: its slots stay its own
    assert kv.tree.size == len(prompt)
    first.output_ids.extend([100, 101, 102, 103])
    kv.allocate(first, 4)  # positions 8..11, the last not computed yet
    first.num_computed = len(prompt) + 3
    second.output_ids.extend([200, 201])
    kv.allocate(second, 2)
    second.num_computed = len(prompt) + 2
    kv.release(first)  # the tree takes its 3 computed outputs; its last slot is freed
    kv.release(second)  # the tree takes its 2 outputs; its 8 prompt duplicates are freed
    assert kv.tree.size == len(prompt) + 3 + 2 and kv.num_free + kv.tree.size == kv.capacity
    lost = Request("c", [*prompt, 100, 101], params(8), 2)
    assert kv.reuse_prefix(lost)  # the prompt and an output, matched
    kv.allocate(lost, 1)
    lost.num_computed += 1
    kv.release(lost, computed=False)  # its session is gone: only its new slot is its own
    assert kv.num_free + kv.tree.size == kv.capacity and kv.tree.evictable == kv.tree.size
    assert kv.make_room(kv.capacity) and kv.num_free == kv.capacity
