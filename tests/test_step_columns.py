"""The CPU per token: the core's per-step work a column at a time (`scheduler_svc/engine/rows.py`:
the same outputs as the row-by-row path, stale rows never applied to a slot's next request, the
request fields that read through to the columns), histograms without a lock per observation, and
a frontend's text made once a message."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from scheduler_svc.engine.kv.allocator import SlotAllocator
from scheduler_svc.engine.request import Request
from scheduler_svc.engine.results import ResultProcessor
from scheduler_svc.engine.rows import SlotRows
from scheduler_svc.engine.running import RunningManager
from scheduler_svc.frontend.streams import OutputStream
from scheduler_svc.frontend.text import RequestText
from scheduler_svc.frontend.tokenizer import ByteTokenizer
from stepahead.loop_metrics import LoopHistogram
from stepahead.metrics import LATENCY_BUCKETS
from tests.fake_worker import FakeWorker
from tests.harness import mixed_workload, params, serve_workload, with_forced_scenarios
from tests.test_equivalence import check_client_views, check_drained, sim_reference
from tests.test_scheduler_policy import add, connected
from worker_svc.backends import sim_continuation as expected

pytestmark = pytest.mark.anyio


async def test_the_column_path_gives_what_the_row_by_row_path_gives(monkeypatch: pytest.MonkeyPatch) -> None:
    """One mixed workload (EOS, stop-id and stop-string finishes, aborts, a forced preemption),
    served a column at a time and then with every row taken one by one: the same outputs (and
    the column path did run)."""
    items = with_forced_scenarios(mixed_workload(80, seed=11, sampled=False), 900, sampled=False)
    kw: dict[str, object] = dict(kv_slots=900, request_slots=32)
    picked = {"columns": 0}
    applied = {"columns": 0}
    pick_decodes, apply_plain = RunningManager._pick_decodes, ResultProcessor._apply_plain

    def counting_pick(self: RunningManager, batch, budget):  # type: ignore[no-untyped-def]
        before = batch.launch.num_rows
        took = pick_decodes(self, batch, budget)
        picked["columns"] += batch.launch.num_rows - before if took else 0
        return took

    def counting_apply(self: ResultProcessor, reqs, slots, tokens):  # type: ignore[no-untyped-def]
        applied["columns"] += len(reqs)
        apply_plain(self, reqs, slots, tokens)

    monkeypatch.setattr(RunningManager, "_pick_decodes", counting_pick)
    monkeypatch.setattr(ResultProcessor, "_apply_plain", counting_apply)
    columns, core, engine = await serve_workload("sim", "overlap", items, **kw)  # type: ignore[arg-type]
    check_client_views(items, columns)
    check_drained(core, engine)
    assert core.stats.preemptions > 0
    assert picked["columns"] > 0 and applied["columns"] > 0  # the column path did run

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
            a, b = columns[item.rid], rows[item.rid]
            assert (a.token_ids, a.text, a.finish_reason, a.logprobs) == (
                b.token_ids,
                b.text,
                b.finish_reason,
                b.logprobs,
            ), item.rid
            assert (columns[item.rid].token_ids, columns[item.rid].finish_reason) == sim_reference(item)
        else:  # where an abort lands depends on timing; what came before it does not
            n = min(len(columns[item.rid].token_ids), len(rows[item.rid].token_ids))
            assert columns[item.rid].token_ids[:n] == rows[item.rid].token_ids[:n], item.rid


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
