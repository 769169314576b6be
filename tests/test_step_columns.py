"""The CPU per token: the core's per-step work a column at a time (`scheduler_svc/engine/rows.py`:
the same outputs as the row-by-row path, stale rows never applied to a slot's next request, the
request fields that read through to the columns), histograms without a lock per observation, and
a frontend's text made once a message."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from scheduler_svc.contract import FinishReason, SamplingParams, StepOutputs
from scheduler_svc.engine.batch import ScheduledBatch
from scheduler_svc.engine.kv.allocator import SlotAllocator
from scheduler_svc.engine.outputs import Outbox
from scheduler_svc.engine.policy import PolicyConfig, SchedulingPolicy
from scheduler_svc.engine.request import Request
from scheduler_svc.engine.results import ResultProcessor
from scheduler_svc.engine.rows import TAIL, SlotRows
from scheduler_svc.engine.running import RunningManager
from scheduler_svc.engine.telemetry import SchedulerTelemetry
from scheduler_svc.frontend import frontend as frontend_module
from scheduler_svc.frontend.streams import OutputStream
from scheduler_svc.frontend.text import RequestText
from scheduler_svc.frontend.tokenizer import ByteTokenizer
from stepahead.loop_metrics import LoopHistogram
from stepahead.metrics import LATENCY_BUCKETS
from stepahead.protocol import StepResult, TokenizerSpec, WorkerInfo
from tests.fake_worker import FakeWorker
from tests.harness import mixed_workload, params, serve_workload, with_forced_scenarios
from tests.test_equivalence import check_client_views, check_drained, sim_reference
from tests.test_scheduler_policy import add, connected
from worker_svc.backends import sim_continuation as expected

pytestmark = pytest.mark.anyio


async def test_the_column_and_small_batch_paths_give_what_the_row_by_row_path_gives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One mixed workload (EOS, stop-id and stop-string finishes, aborts, a forced preemption),
    served a column at a time, then with plain decode rows picked and applied a row at a time
    through the `array` columns (the small-batch path), then with every row taken one by one as
    a request: the same outputs (and the column and small-batch paths did run)."""
    items = with_forced_scenarios(mixed_workload(80, seed=11, sampled=False), 900, sampled=False)
    kw: dict[str, object] = dict(kv_slots=900, request_slots=32)
    used = {"_pick_decodes": 0, "_apply_plain": 0, "_pick_small": 0, "_apply_small": 0}

    def counting(cls: type, name: str) -> None:
        method = getattr(cls, name)

        def counted(self, batch_or_reqs, *args):  # type: ignore[no-untyped-def]
            before = used[name]
            rows = batch_or_reqs.launch.num_rows if name.startswith("_pick") else 0
            took = method(self, batch_or_reqs, *args)
            if name.startswith("_pick"):
                used[name] = before + (batch_or_reqs.launch.num_rows - rows if took else 0)
            elif took is not False:
                used[name] = before + len(batch_or_reqs)
            return took

        monkeypatch.setattr(cls, name, counted)

    for cls, name in [
        (RunningManager, "_pick_decodes"),
        (RunningManager, "_pick_small"),
        (ResultProcessor, "_apply_plain"),
        (ResultProcessor, "_apply_small"),
    ]:
        counting(cls, name)

    # columns only
    columns, core, engine = await serve_workload("sim", "overlap", items, small_batch=0, **kw)  # type: ignore[arg-type]
    check_client_views(items, columns)
    check_drained(core, engine)
    assert core.stats.preemptions > 0
    assert used["_pick_decodes"] > 0 and used["_apply_plain"] > 0  # the column path did run
    assert used["_pick_small"] == used["_apply_small"] == 0

    # every step a row at a time
    small, core, engine = await serve_workload("sim", "overlap", items, small_batch=10_000, **kw)  # type: ignore[arg-type]
    check_client_views(items, small)
    check_drained(core, engine)
    assert core.stats.preemptions > 0
    assert used["_pick_small"] > 0 and used["_apply_small"] > 0  # the small-batch path did run

    place = SlotRows.place

    def place_not_plain(self: SlotRows, req, slot, computed, inflight, kept):  # type: ignore[no-untyped-def]
        place(self, req, slot, computed, inflight, kept)
        self.plain[slot] = 0  # every result row one by one

    monkeypatch.setattr(RunningManager, "_pick_decodes", lambda self, batch, budget: False)
    monkeypatch.setattr(SlotRows, "place", place_not_plain)
    rows, core, engine = await serve_workload("sim", "overlap", items, **kw)  # type: ignore[arg-type]
    check_client_views(items, rows)
    check_drained(core, engine)
    for item in items:
        if item.abort_after is None:
            for outputs in (columns, small):
                a, b = outputs[item.rid], rows[item.rid]
                assert (a.token_ids, a.text, a.finish_reason, a.logprobs) == (
                    b.token_ids,
                    b.text,
                    b.finish_reason,
                    b.logprobs,
                ), item.rid
                assert (a.token_ids, a.finish_reason) == sim_reference(item)
        else:  # where an abort lands depends on timing; what came before it does not
            for outputs in (columns, small):
                n = min(len(outputs[item.rid].token_ids), len(rows[item.rid].token_ids))
                assert outputs[item.rid].token_ids[:n] == rows[item.rid].token_ids[:n], item.rid


async def test_a_stale_row_is_not_applied_to_the_next_request_of_its_slot() -> None:
    """x is aborted with its batch in flight and y takes x's request slot at once: x's token, when
    it comes, is dropped; y's columns and outputs are its own."""
    worker = FakeWorker(4096, 8, hold=True)
    core, frontend = await connected(worker)
    add(frontend, "x", [1] * 10, 50)
    b1 = core.pick_batch()
    assert b1 is not None
    h1 = await core.launch_step(b1)
    slot = core.policy.requests["x", 0].req_slot
    assert core.abort("x")
    y_prompt = [2] * 5
    client = add(frontend, "y", y_prompt, 3)
    y = core.policy.requests["y", 0]
    b2 = core.pick_batch()
    assert b2 is not None and y.req_slot == slot
    h2 = await core.launch_step(b2)
    worker.complete_next()
    await core.process_results(b1, h1)
    assert core.stats.dropped_inflight_tokens == 1
    assert y.output_ids == [] and (y.num_computed, y.num_inflight) == (5, 1)
    worker.complete_next()
    await core.process_results(b2, h2)
    while core.policy.requests:
        batch = core.pick_batch()
        assert batch is not None
        handle = await core.launch_step(batch)
        worker.complete_next()
        await core.process_results(batch, handle)
    tokens = [t for _, chunk in client.take() for t in chunk.token_ids]
    assert tokens == expected(y_prompt, 3)


def test_progress_reads_through_to_the_row_while_a_slot_is_held() -> None:
    rows = SlotRows(4)
    req = Request("r", [1, 2, 3], params(10, ignore_eos=True), 0)
    req.num_computed, req.num_inflight = 2, 0
    rows.place(req, 3, req.num_computed, req.num_inflight, req.prompt_kept)
    req.req_slot, req.rows = 3, rows
    req.num_computed += 1
    req.num_inflight = 1
    req.add_output(9)
    assert (rows.computed[3], rows.inflight[3], rows.known[3]) == (3, 1, 4)
    assert (req.num_computed, req.num_inflight, req.num_known) == (3, 1, 4)
    held = rows.clear(3)
    req.rows = None
    req.num_computed, req.num_inflight, req.prompt_kept = held
    assert (req.num_computed, req.num_inflight) == (3, 1) and rows.tag[3] == -1


def test_a_row_s_tails_hold_its_new_tokens_and_kv_slots_until_full_read_or_cleared() -> None:
    """Tokens and KV slots written into the rows' tails, a column at a time and a row at a time,
    at different fill levels: a request's `output_ids` and `kv_slots` always read every one, in
    order; a tail never holds more than TAIL; clearing the row moves its tail into the lists."""
    rows = SlotRows(4)
    reqs = [Request(f"r{i}", [1, 2, 3], params(1000, ignore_eos=True), i) for i in range(3)]
    want_tokens: list[list[int]] = [[], [], [7]]
    want_kv: list[list[int]] = [[], [], [70]]
    reqs[2].output_head.append(7)  # from before: a recompute's processed output
    reqs[2].kv_head.append(70)
    for slot, req in enumerate(reqs):
        rows.place(req, slot, 0, 0, 0)
        req.req_slot, req.rows = slot, rows
    for step in range(3 * TAIL + 5):
        slots = [0, 1, 2] if step % 2 else [0, 1]  # row 2 fills at half the rate
        tokens = [1000 * step + slot for slot in slots]
        kv = [2000 * step + slot for slot in slots]
        if step % 3:
            rows.append_tokens(np.array(slots, np.int64), np.array(tokens, np.int64))
            rows.append_kv(np.array(slots, np.int64), np.array(kv, np.int64))
        else:
            for slot, token, kv_slot in zip(slots, tokens, kv, strict=True):
                rows.append_token(slot, token)
                rows.append_kv_one(slot, kv_slot)
        for slot, token, kv_slot in zip(slots, tokens, kv, strict=True):
            want_tokens[slot].append(token)
            want_kv[slot].append(kv_slot)
            rows.known[slot] += 1  # as the result processing counts them
        assert max(rows.new_tokens_np[:3]) < TAIL and max(rows.new_kv_np[:3]) < TAIL
        if step in (TAIL // 2, 2 * TAIL + 1):  # read midway: the tail moves, and fills again
            assert reqs[1].output_ids == want_tokens[1] and reqs[1].kv_slots == want_kv[1]
            assert rows.new_tokens[1] == rows.new_kv[1] == 0
    assert len(reqs[0].output_head) < len(want_tokens[0])  # some were still in the tail
    for slot, req in enumerate(reqs):
        assert req.output_ids == want_tokens[slot] and req.kv_slots == want_kv[slot]
        assert req.num_known == 3 + len(want_tokens[slot])
    rows.append_tokens(np.array([0], np.int64), np.array([5], np.int64))
    rows.clear(0)
    reqs[0].rows = None
    assert reqs[0].output_head == [*want_tokens[0], 5] and rows.requests[0] is None
    assert rows.new_tokens[0] == 0
    assert reqs[0].num_known == 3 + len(want_tokens[0]) + 1  # from its own lists, out of its row


def test_a_double_free_of_many_slots_is_refused_and_changes_nothing() -> None:
    slots = SlotAllocator(64, "kv slots")
    taken = slots.allocate(20)
    slots.free(taken[:10])
    with pytest.raises(ValueError, match="freed twice"):
        slots.free(taken[5:])  # 5..9 are free already
    assert slots.num_free == 54
    slots.free(taken[10:])  # still held: freed now
    assert slots.num_free == 64
    extra = slots.allocate(12)
    with pytest.raises(ValueError, match="freed twice"):
        slots.free([*extra, extra[0]])  # one slot twice in one call
    assert slots.num_free == 52
    slots.free_one(extra[0])
    with pytest.raises(ValueError, match="freed twice"):
        slots.free_one(extra[0])
    assert slots.num_free == 53


def test_slots_go_out_once_each_and_the_free_stack_is_never_reallocated() -> None:
    """Against a set of the slots in use, over random columns and single slots taken and given
    back; the free stack keeps its one buffer (a resized one was an `mremap` of the pool's
    megabytes a step)."""
    rng = random.Random(7)
    slots = SlotAllocator(300, "kv slots")
    buffer = slots._stack.ctypes.data
    held: list[int] = []
    for _ in range(400):
        if held and rng.random() < 0.45:
            rng.shuffle(held)
            n = rng.randint(1, len(held))
            if n == 1 and rng.random() < 0.5:
                slots.free_one(held[0])
            else:
                slots.free(held[:n])
            held = held[n:]
        else:
            n = rng.choice([1, 3, 9, 40, 120])
            if not slots.can_allocate(n):
                with pytest.raises(MemoryError):
                    slots.allocate(n)
                continue
            got = slots.allocate_column(n).tolist() if rng.random() < 0.5 else slots.allocate(n)
            assert not set(got) & set(held) and len(set(got)) == n and all(0 <= s < 300 for s in got)
            held += got
        assert slots.num_used == len(held) and slots.num_free == 300 - len(held)
    assert slots._stack.ctypes.data == buffer
    slots.free(held)
    assert sorted(slots.allocate(300)) == list(range(300))


def test_the_loop_histogram_exposes_what_the_client_library_histogram_does() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    loop = LoopHistogram("h_seconds", "A histogram.", ("mode", "phase"), LATENCY_BUCKETS)
    ours.register(loop)
    reference = Histogram(
        "h_seconds", "A histogram.", ["mode", "phase"], buckets=LATENCY_BUCKETS, registry=theirs
    )
    for i, value in enumerate((0.0, 0.001, 0.0011, 0.02, 0.5, 3.0, 1e6, LATENCY_BUCKETS[3])):
        phase = ("pick", "wait")[i % 2]
        loop.labels("overlap", phase).observe(value)
        reference.labels("overlap", phase).observe(value)
    loop.labels("overlap", "wait").observe_many(0.25, 3)  # as three observations
    for _ in range(3):
        reference.labels("overlap", "wait").observe(0.25)

    def lines(registry: CollectorRegistry) -> list[str]:
        return [ln for ln in generate_latest(registry).decode().splitlines() if "_created" not in ln]

    assert lines(ours) == lines(theirs)


def test_text_without_stop_strings_is_made_once_a_message_and_is_the_per_token_text() -> None:
    """A stream whose text nothing reads token by token (no stop strings, no tools) decodes a
    message's tokens in one call when the message is taken; the text is what decoding each token
    as it came gives, split characters (multi-byte UTF-8) included."""
    tokenizer = ByteTokenizer()
    tokens = list("héllo, wörld ✓ — 日本".encode())
    eager_text = RequestText(tokenizer, ())
    eager = "".join(eager_text.push(t)[0] for t in tokens) + eager_text.finish()

    lazy_text = RequestText(tokenizer, ())
    calls: list[int] = []

    def counting(ids: list[int]) -> str:
        calls.append(len(ids))
        return lazy_text.push_ids(ids)

    stream = OutputStream()
    stream.decode_later(counting)
    texts = []
    for i, token in enumerate(tokens):
        stream.put_id(token)
        if i in (0, 7, 20):  # the client reads now and then
            texts.append(stream.take().text)
    stream.catch_up()
    texts.append(lazy_text.finish())
    texts.append(stream.take().text)
    assert "".join(texts) == eager == "héllo, wörld ✓ — 日本"
    assert len(calls) == 4 and sum(calls) == len(tokens)
    with pytest.raises(AssertionError):
        RequestText(tokenizer, ("stop",)).push_ids([65])  # stop strings are looked for token by token


async def test_small_batches_launch_and_stream_what_columns_do() -> None:
    """Overlap order stepped by hand (launch k + 1, then process k), requests ending at
    different lengths (EOS ignored): the launches, row for row, and the streamed tokens are the
    same a row at a time as a column at a time; no decode row is picked for a request whose
    last allowed token is already in flight."""

    async def serve(n: int) -> tuple[list[tuple[list[int], ...]], dict[str, list[int]]]:
        worker = FakeWorker(4096, 16, hold=True)
        core, frontend = await connected(worker)
        core.policy.running_manager.small_batch = core.policy.results.small_batch = n
        clients = {f"r{i}": add(frontend, f"r{i}", [i + 1] * (2 + i), 1 + i % 5) for i in range(9)}
        launches: list[tuple[list[int], ...]] = []
        in_flight: tuple[ScheduledBatch, asyncio.Future[StepResult]] | None = None
        while core.policy.requests or in_flight is not None:
            batch = core.pick_batch()
            launched = None
            if batch is not None:
                launch = batch.launch
                launches.append(
                    (list(launch.row_req_slots), list(launch.row_start_pos), list(launch.kv_slots))
                )
                launched = (batch, await core.launch_step(batch))
            if in_flight is not None:
                worker.complete_next()
                await core.process_results(*in_flight)
            in_flight = launched
        assert core.stats.dropped_inflight_tokens == 0  # nothing picked past a request's last token
        streamed = {rid: [t for _, chunk in c.take() for t in chunk.token_ids] for rid, c in clients.items()}
        return launches, streamed

    launches, streamed = await serve(10_000)  # a row at a time
    assert (launches, streamed) == await serve(0)  # a column at a time
    assert streamed == {f"r{i}": expected([i + 1] * (2 + i), 1 + i % 5) for i in range(9)}


async def test_the_gaps_between_a_step_s_tokens_are_observed_per_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows whose last token came in the same message are observed as one gap a run of rows at
    a time: the inter-token histogram still counts one gap per token after a stream's first,
    and sums each stream's own gaps (a stream that joined a step later has other gaps)."""
    clock = [100.0]
    monkeypatch.setattr(frontend_module, "time", SimpleNamespace(time=lambda: clock[0]))
    worker = FakeWorker(4096, 8)
    core, frontend = await connected(worker, mode="serial")
    add(frontend, "a", [1, 2], 4)
    add(frontend, "b", [3, 4], 4)

    async def step(at: float) -> None:
        clock[0] = at
        batch = core.pick_batch()
        assert batch is not None
        await core.process_results(batch, await core.launch_step(batch))

    await step(101.0)  # a, b: first tokens
    add(frontend, "c", [5, 6], 3)
    await step(103.0)  # a, b: gap 2; c: first token
    await step(104.0)  # a, b, c: gap 1
    await step(108.0)  # a, b, c: gap 4 (a and b end: 4 tokens)
    itl = frontend.telemetry.itl
    buckets, total = itl.snapshot()
    assert buckets[-1][1] == 3 + 3 + 2  # gaps: a 3, b 3, c 2
    assert total == pytest.approx(2 * (2 + 1 + 4) + (1 + 4))


@pytest.mark.parametrize("small_batch", [0, 10_000], ids=["columns", "rows"])
async def test_a_step_of_decodes_evicts_cached_prefixes_for_its_rows_at_once(small_batch: int) -> None:
    """A pool full of cached prefixes (a long-running server's usual state) with no slot free: the
    next step of decodes makes room once, evicting whole unreferenced leaves, and is still picked
    a column (or a small batch's row) at a time, not row by row with a room check each."""
    worker = FakeWorker(1000, 16, hold=True)
    core, frontend = await connected(worker, budget=512)
    core.policy.running_manager.small_batch = core.policy.results.small_batch = small_batch

    async def drain() -> None:
        in_flight: tuple[ScheduledBatch, asyncio.Future[StepResult]] | None = None
        while core.policy.requests or in_flight is not None:
            batch = core.pick_batch()
            launched = None if batch is None else (batch, await core.launch_step(batch))
            if in_flight is not None:
                worker.complete_next()
                await core.process_results(*in_flight)
            in_flight = launched

    for i in range(8):  # their prompts and outputs stay cached: 8 leaves of 27 slots
        add(frontend, f"old{i}", [i + 1] * 8, 20)
    await drain()
    kv = core.policy.kv
    assert kv.tree.evictable == kv.tree.size == 8 * 27
    clients = [add(frontend, f"new{i}", [100 + i] * 8, 4) for i in range(8)]
    prefill = core.pick_batch()
    assert prefill is not None and prefill.forward_mode == "prefill"
    prefill_done = await core.launch_step(prefill)
    kv._slots.allocate(kv.num_free)  # nothing free: the decodes' slots must come from the cache
    cached, evicted = kv.tree.size, kv.evicted
    took = []
    pick_decodes = core.policy.running_manager._pick_decodes

    def recording(batch: ScheduledBatch, budget: int) -> bool:
        took.append(pick_decodes(batch, budget))
        return took[-1]

    core.policy.running_manager._pick_decodes = recording  # type: ignore[method-assign]
    decodes = core.pick_batch()
    assert took == [True]  # the step's fast path, not row by row
    assert decodes is not None and decodes.forward_mode == "decode" and decodes.launch.num_rows == 8
    # Each old request left a node of its prompt and first token (9 slots, kept at that token)
    # and a leaf of the rest (18): one leaf is room for the 8 rows.
    assert kv.evicted - evicted == 18 and kv.tree.size == cached - 18
    assert core.stats.preemptions == 0
    worker.complete_next()
    await core.process_results(prefill, prefill_done)
    decodes_done = await core.launch_step(decodes)
    worker.complete_next()
    await core.process_results(decodes, decodes_done)
    for i, client in enumerate(clients):
        assert [t for _, chunk in client.take() for t in chunk.token_ids] == expected([100 + i] * 8, 2)


@pytest.mark.parametrize("small_batch", [0, 10_000], ids=["columns", "rows"])
async def test_a_prompt_taken_in_chunks_continues_beside_a_column_of_decodes(
    small_batch: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt longer than a step's budget, admitted while others decode: the steps that carry
    the rest of its prefill are picked a column (or a small batch's row) at a time too, not
    request by request, and launch the rows the request-by-request pick launches: each decode,
    and the prompt's next chunk; its last chunk samples."""

    async def serve(fast: bool) -> tuple[list[list[tuple[int, int, int, bool]]], dict[str, list[int]]]:
        worker = FakeWorker(4096, 16)
        core, frontend = await connected(worker, mode="serial", budget=40)
        running = core.policy.running_manager
        running.small_batch = core.policy.results.small_batch = small_batch
        took: list[bool] = []
        if fast:
            pick_decodes = running._pick_decodes

            def recording(batch: ScheduledBatch, budget: int) -> bool:
                took.append(pick_decodes(batch, budget))
                return took[-1]

            running._pick_decodes = recording  # type: ignore[method-assign]
        else:
            running._pick_decodes = lambda batch, budget: False  # type: ignore[method-assign]
        clients = {f"d{i}": add(frontend, f"d{i}", [i + 1] * 3, 12) for i in range(6)}
        steps: list[list[tuple[int, int, int, bool]]] = []
        for _ in range(2):  # the six decode
            batch = core.pick_batch()
            assert batch is not None
            await core.process_results(batch, await core.launch_step(batch))
        clients["long"] = add(frontend, "long", [50] * 100, 4)
        while core.policy.requests:
            batch = core.pick_batch()
            assert batch is not None
            launch = batch.launch
            rows = zip(
                launch.row_req_slots,
                launch.row_start_pos,
                launch.row_num_tokens,
                launch.row_sample,
                strict=True,
            )
            steps.append(sorted(rows))
            await core.process_results(batch, await core.launch_step(batch))
        if fast:
            assert took and all(took)  # every step's pick took the fast path
        streamed = {rid: [t for _, chunk in c.take() for t in chunk.token_ids] for rid, c in clients.items()}
        return steps, streamed

    def no_request_walk(self: Request) -> bool:
        raise AssertionError("a running request's row was picked request by request")

    by_request = await serve(fast=False)
    monkeypatch.setattr(Request, "wants_decode", no_request_walk)
    steps, streamed = await serve(fast=True)
    assert (steps, streamed) == by_request
    chunks = [[row for row in step if row[2] > 1] for step in steps]
    assert [c[0][1:] for c in chunks if c] == [(0, 34, False), (34, 34, False), (68, 32, True)]
    assert streamed["long"] == expected([50] * 100, 4)


def _first_token_outputs(row_by_row: bool, monkeypatch: pytest.MonkeyPatch) -> list[list[StepOutputs]]:
    """Two frontends' requests, interleaved, admitted in one step, some reusing a prompt an
    earlier request left in the prefix cache, one ending at its first token: what each frontend
    is sent for the step of their first tokens (`row_by_row`: every row through `_process_row`)."""
    if row_by_row:
        place = SlotRows.place

        def place_not_plain(self: SlotRows, req, slot, computed, inflight, kept):  # type: ignore[no-untyped-def]
            place(self, req, slot, computed, inflight, kept)
            self.plain[slot] = 0

        monkeypatch.setattr(SlotRows, "place", place_not_plain)
    sinks = [RecordingSink(), RecordingSink()]
    outbox = Outbox()
    policy = SchedulingPolicy(PolicyConfig(4096, small_batch=0), outbox, SchedulerTelemetry("overlap"))
    policy.begin_session(WorkerInfo("m", 300, 4096, (257,), None, 4096, 16, "cpu", TokenizerSpec("byte")))
    shared = list(range(40, 60))

    def step(tokens: list[int]) -> None:
        batch = policy.schedule()
        assert batch is not None and batch.num_sampled == len(tokens)
        policy.update_from_result(batch, tokens)
        outbox.flush()

    def add(rid: str, sink: int, prompt: list[int], max_new: int) -> None:
        params = SamplingParams(max_new, 0.0, 1.0, 0, 0, frozenset(), (), True)
        policy.add_request(Request(rid, prompt, params, 0, sinks[sink], len(policy.requests) + 10 * sink))

    add("warm", 0, shared, 1)
    step([70])  # its prompt's KV stays in the tree
    for s in sinks:
        s.got.clear()
    add("a1", 0, [*shared, 1, 2], 3)
    add("b1", 1, [90, 91, 92], 1)  # ends at its first token
    add("a2", 0, [93, 94], 3)
    add("b2", 1, [*shared[:12], 5], 3)
    step([71, 72, 73, 74])
    return [s.got for s in sinks]


@dataclass(eq=False)
class RecordingSink:
    got: list[StepOutputs] = field(default_factory=list)

    def send(self, outputs: StepOutputs) -> None:
        self.got.append(outputs)


def test_first_tokens_a_column_at_a_time_carry_what_the_row_by_row_path_gives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A step of first tokens applied a column at a time (their prompts kept in the prefix cache
    row by row) sends each frontend what the row-by-row path sends: the same entries, the prompt
    tokens found cached on each request's first token, the finish of one that ends there."""
    columns = _first_token_outputs(False, monkeypatch)
    rows = _first_token_outputs(True, monkeypatch)
    assert columns == rows
    a, b = (got[0] for got in columns)
    assert (a.token_ids, a.cached_entries, a.cached_tokens) == ([71, 73], [0, 1], [20, 0])
    assert (b.token_ids, b.finish_reasons, b.cached_entries, b.cached_tokens) == (
        [72, 74],
        [int(FinishReason.LENGTH), 0],
        [0, 1],
        [0, 12],
    )
