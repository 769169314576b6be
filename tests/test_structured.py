"""Structured outputs under overlap, in process: the worker's matchers beside its sampler.

A differential workload on `tiny` (float64, greedy and seeded): constrained requests (JSON
Schema, regex, choice, Lark) among plain ones, with chunked prefill, forced preemption (a
constrained call recomputed: its outputs replayed into fresh matchers), client aborts, n > 1,
penalties, logit_bias, min_tokens and logprobs. Serial and overlap at depths 1, 2 and 3 give
the same outputs, every constrained output that ends with STOP is valid for its constraint (by
independent validators: json + jsonschema, re, a parser), and every constrained output is a
prefix its grammar accepts. The worker runs with --check-invariants: a token drawn outside its
row's mask fails the step. Then one regression test per bug class the anchors had.
"""

from __future__ import annotations

import json
import random
import re
import threading
from dataclasses import replace

import jsonschema
import pytest
import torch

from scheduler_svc.contract import FinishReason
from scheduler_svc.engine.core import EngineCore
from scheduler_svc.frontend.tools import (
    CALL_CLOSE,
    CALL_OPEN,
    CALL_SEPARATOR,
    Tool,
    ToolChoice,
    parse_reply,
    tool_constraint,
)
from stepahead.protocol import (
    Constraint,
    GrammarConstraint,
    Launch,
    LogitsProcessing,
    NewRequest,
    TokenizerSpec,
)
from tests.harness import ClientView, WorkItem, make_engine, params, preempting_call, serve_workload
from tests.test_equivalence import check_drained
from tests.test_overlap_depth import serve_at
from tests.test_sampling_equivalence import assert_same_outputs, completions, features_workload
from tests.test_worker_engine import decode, prefill
from worker_svc import structured
from worker_svc.backends import SimDraw, load_backend
from worker_svc.engine import EngineConfig, WorkerEngine
from worker_svc.grammar import MatcherTable, grammar_tokenizer
from worker_svc.structured import MaskViolation

pytestmark = pytest.mark.anyio

EOS, VOCAB = 257, 258
POOL = 1500  # KV slots: small enough that the forced call preempts
TINY: dict[str, object] = dict(kv_slots=POOL, request_slots=48, dtype=torch.float64)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "minItems": 1, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "main": {"type": "boolean"}},
            "required": ["zip", "main"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
LEVELS = {"enum": ["low", "mid", "high"]}
REGEX = r"[a-c]{2,5}-[0-9]{1,4}"
CHOICES = ["yes", "no", "maybe so"]
SUMS = 'start: expr\nexpr: NUM | "(" expr "+" expr ")"\nNUM: /[0-9]{1,2}/\n'
# Arguments of bounded length, so that a call ends within the budget its request gets.
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{0,3}$"}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "boolean"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [Tool("get_weather", "", json.dumps(WEATHER)), Tool("add", "", json.dumps(ADD))]
TOOL_SCHEMAS = {"get_weather": WEATHER, "add": ADD}


def _tools(choice: ToolChoice, parallel: bool) -> tuple[Constraint, tuple[ToolChoice, bool]]:
    constraint = tool_constraint(TOOLS, choice, parallel)
    assert constraint is not None
    return constraint, (choice, parallel)


# Tool calling's grammars (scheduler_svc/frontend/tools.py): what a chat request with tools sends.
TOOL_GRAMMARS = dict(
    [
        _tools(ToolChoice("required"), True),
        _tools(ToolChoice("named", "add"), False),
        _tools(ToolChoice("auto"), True),
    ]
)
CONSTRAINTS = [
    Constraint("json", json.dumps(PERSON)),
    Constraint("json", json.dumps(LEVELS)),
    Constraint("regex", REGEX),
    Constraint("choice", json.dumps(CHOICES)),
    Constraint("grammar", SUMS),
    *TOOL_GRAMMARS,
]


def is_sum(text: str) -> bool:
    """Whether `text` is a word of SUMS (an independent recursive-descent parser)."""

    def expr(i: int) -> int:
        number = re.match(r"[0-9]{1,2}", text[i:])
        if number:
            return i + number.end()
        if text[i : i + 1] != "(":
            return -1
        i = expr(i + 1)
        if i < 0 or text[i : i + 1] != "+":
            return -1
        i = expr(i + 1)
        return i + 1 if i >= 0 and text[i : i + 1] == ")" else -1

    return expr(0) == len(text)


def valid_calls(constraint: Constraint, text: str) -> bool:
    """Whether `text` is a reply a tool grammar allows: content (under `auto` only) and then
    calls of the tools it may call, one at most without parallel calls, each call's arguments
    valid for its tool's schema (jsonschema)."""
    choice, parallel = TOOL_GRAMMARS[constraint]
    reply = parse_reply(text)
    if choice.mode != "auto" and (reply.content is not None or not reply.calls):
        return False
    if len(reply.calls) > 1 and not parallel:
        return False
    # The calls are the whole rest of the reply (their arguments as the model wrote them).
    written = [
        f'{CALL_OPEN}{{"name": "{c.name}", "arguments": {c.arguments}}}{CALL_CLOSE}' for c in reply.calls
    ]
    if text != (reply.content or "") + CALL_SEPARATOR.join(written):
        return False
    for call in reply.calls:
        if choice.mode == "named" and call.name != choice.name:
            return False
        try:
            jsonschema.validate(json.loads(call.arguments), TOOL_SCHEMAS[call.name])
        except (ValueError, KeyError, jsonschema.ValidationError):
            return False
    return True


def is_valid(constraint: Constraint, text: str) -> bool:
    if constraint in TOOL_GRAMMARS:
        return valid_calls(constraint, text)
    if constraint.kind == "json":
        try:
            jsonschema.validate(json.loads(text), json.loads(constraint.text))
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if constraint.kind == "regex":
        return re.fullmatch(constraint.text, text) is not None
    if constraint.kind == "choice":
        return text in json.loads(constraint.text)
    return is_sum(text)


_BYTE_TABLE: list[MatcherTable] = []


def accepted_prefix(constraint: Constraint, tokens: list[int]) -> bool:
    """Whether a fresh matcher takes `tokens` (what any constrained output must be)."""
    if not _BYTE_TABLE:
        _BYTE_TABLE.append(MatcherTable(grammar_tokenizer(TokenizerSpec("byte"), VOCAB, (EOS,)), VOCAB))
    table = _BYTE_TABLE[0]
    try:
        table.start(0, constraint, tokens)
    except ValueError:
        return False
    finally:
        table.release(0)
    return True


TOOL_CALL_BUDGET = 150


def structured_workload(count: int, seed: int, *, sampled: bool) -> list[WorkItem]:
    """The sampling features' workload (every feature, stops, aborts, long prompts chunked,
    a forced preemption) with a constraint on about half the requests, and a constrained call
    that forces preemption too (its completions decode until the pool runs out)."""
    rng = random.Random(seed)
    items = features_workload(count, seed, sampled=sampled, kv_slots=POOL)
    constrained = []
    for item in items:
        if item.rid.startswith("forced") or rng.random() < 0.5:
            constrained.append(item)
            continue
        # A stop string or stop token may cut a word short (as the client asked): those are
        # tested on their own, so that every STOP here is the grammar's or EOS.
        p = replace(item.params, constraint=rng.choice(CONSTRAINTS), stop=(), stop_token_ids=frozenset())
        if p.constraint in TOOL_GRAMMARS:  # room for a call or two (60 tokens each)
            p = replace(p, max_new_tokens=max(p.max_new_tokens, TOOL_CALL_BUDGET))
        constrained.append(replace(item, params=p))
    letters = preempting_call("forced-preempt-constrained", POOL, sampled=sampled)
    long_word = replace(letters.params, constraint=Constraint("regex", "[a-z]{400}"))
    return [replace(letters, params=long_word), *constrained]


def check_constrained(items: list[WorkItem], views: dict[str, ClientView]) -> None:
    checked = calls = 0
    for key, item in completions(items):
        constraint, view = item.params.constraint, views[key]
        if constraint is None:
            continue
        tokens = [t for t in view.token_ids if t != EOS]
        assert accepted_prefix(constraint, tokens), (key, view.text)
        if view.finish_reason == FinishReason.STOP:
            assert is_valid(constraint, view.text), (key, constraint.kind, view.text)
            checked += 1
            calls += constraint in TOOL_GRAMMARS and bool(parse_reply(view.text).calls)
    assert checked >= 10, "the workload must finish constrained requests"
    # A named tool without parallel calls ends its reply after one call, well within its budget.
    assert calls >= 1, "the workload must finish tool calls"


def check_run(
    items: list[WorkItem], views: dict[str, ClientView], core: EngineCore, engine: WorkerEngine
) -> None:
    check_constrained(items, views)
    check_drained(core, engine)
    assert core.stats.preemptions > 0, "the workload must exercise preemption"
    assert engine.grammar_matchers() == 0, "every finished request's matcher is released"


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
async def test_constrained_and_plain_requests_serial_equals_overlap_at_every_depth(sampled: bool) -> None:
    items = structured_workload(70, seed=41 + sampled, sampled=sampled)
    serial, core, engine = await serve_workload("tiny", "serial", items, **TINY)  # type: ignore[arg-type]
    check_run(items, serial, core, engine)
    for depth in (1, 2, 3):
        # A 1 ms link holds `depth` batches in flight whatever the machine's speed.
        got, core, engine, most_in_flight = await serve_at(
            "tiny", items, depth, 0.001 if depth > 1 else 0.0, **TINY
        )
        check_run(items, got, core, engine)
        if depth > 1:
            assert most_in_flight == depth + 1, (depth, most_in_flight)
        assert_same_outputs(items, serial, got)
    finishes = {views.finish_reason for key, views in serial.items() if key.startswith("r")}
    assert finishes >= {FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT}


# ---- the anchors' bug classes, one test each ------------------------------------------------


async def test_a_constrained_prompt_in_many_chunks_and_its_recompute_in_chunks_stay_valid() -> None:
    """vLLM 29379 ("Failed to advance FSM" with chunked prefill): prompts of 300 tokens in
    chunks of at most 32, and a constrained call that preempts itself, whose recompute replays
    prompt and outputs in chunks again; the matcher takes only sampled tokens."""
    rng = random.Random(7)
    items = [
        WorkItem(f"c{i}", [rng.randrange(32, 127) for _ in range(300)], params(60, constraint=c, seed=i), 0.0)
        for i, c in enumerate(CONSTRAINTS)
    ]
    preempting = preempting_call("preempt", 400, sampled=False)
    items.append(
        replace(preempting, params=replace(preempting.params, constraint=Constraint("regex", "[a-z]{400}")))
    )
    kw: dict[str, object] = dict(kv_slots=400, request_slots=16, dtype=torch.float64, max_batch_tokens=32)
    serial, core, engine = await serve_workload("tiny", "serial", items, **kw)  # type: ignore[arg-type]
    assert core.stats.preemptions > 0
    got, core, engine, _ = await serve_at("tiny", items, 2, 0.001, **kw)
    assert core.stats.preemptions > 0
    check_drained(core, engine)
    assert_same_outputs(items, serial, got)
    for key, item in completions(items):
        assert item.params.constraint is not None
        view = got[key]
        assert accepted_prefix(item.params.constraint, [t for t in view.token_ids if t != EOS]), key
        if view.finish_reason == FinishReason.STOP:
            assert is_valid(item.params.constraint, view.text), key


def choice_request(slot: int, choices: list[str]) -> NewRequest:
    grammar = GrammarConstraint(Constraint("choice", json.dumps(choices)))
    return NewRequest(slot, 0.0, 1.0, 0, 0, grammar=grammar)


def test_a_finished_matcher_takes_nothing_more_while_later_steps_are_in_flight() -> None:
    """vLLM 42619 (a terminated matcher advanced again): the worker reports the finish once,
    with the step whose token ended the word; the steps queued behind it draw EOS for the row
    (the only token a finished grammar allows) and the matcher takes none of them."""
    engine = make_engine("sim", kv_slots=64, request_slots=4, sim_step_ms=0.0)
    try:
        engine.begin_session().result()
        first = prefill(1, 0, [72, 73], [0, 1], new_requests=[choice_request(0, ["ok"])])
        steps = [engine.submit(first)]
        steps += [engine.submit(decode(1 + k, [0], [1 + k], [1 + k])) for k in range(1, 6)]
        results = [s.result() for s in steps]  # all six queued before any result is read
        tokens = [r.token_ids[0] for r in results]
        assert bytes(tokens[:2]) == b"ok"
        assert tokens[2:] == [EOS] * 4
        assert [r.grammar_finished for r in results] == [(), (0,), (), (), (), ()]
        engine.submit(Launch(7, released_slots=[0])).result()
        assert engine.grammar_matchers() == 0
    finally:
        engine.shutdown()


def test_a_release_queued_at_shutdown_still_frees_its_matcher() -> None:
    """A release-only launch hands its slot's release to a busy grammar thread, and the engine is
    shut down at once: the release runs before the thread ends (it was once cancelled, and the
    drained engine reported a live matcher)."""
    engine = make_engine("sim", kv_slots=64, request_slots=4, sim_step_ms=0.0)
    busy = threading.Event()
    try:
        engine.begin_session().result()
        first = prefill(1, 0, [72, 73], [0, 1], new_requests=[choice_request(0, ["ok"])])
        engine.submit(first).result()
        assert engine.grammar_matchers() == 1
        grammar = engine._grammar_thread
        assert grammar is not None
        grammar._thread.submit(busy.wait)  # the grammar thread is busy ...
        engine.submit(Launch(2, released_slots=[0])).result()  # ... when the release is handed
        threading.Timer(2.0, busy.set).start()  # long after shutdown has been called
    finally:
        engine.shutdown()
    assert engine.grammar_matchers() == 0


async def test_a_grammar_that_finishes_ends_its_request_with_stop_at_every_depth() -> None:
    """The finish comes with the word's last token: no EOS step is needed, nothing more is
    streamed (the in-flight steps' tokens are dropped), the word is the text."""
    items = [
        WorkItem(
            f"w{i}",
            [65 + i, 66],
            params(50, constraint=Constraint("choice", json.dumps(["alpha", "beta"]))),
            0.0,
        )
        for i in range(6)
    ]
    kw: dict[str, object] = dict(kv_slots=4000, request_slots=16, sim_step_ms=1.0)
    for depth in (1, 2, 3):
        got, core, engine, _ = await serve_at("sim", items, depth, 0.001 if depth > 1 else 0.0, **kw)
        check_drained(core, engine)
        for item in items:
            view = got[item.rid]
            assert view.finish_reason == FinishReason.STOP
            assert view.text in ("alpha", "beta") and EOS not in view.token_ids
        assert core.stats.dropped_inflight_tokens >= len(items) * (depth - 1)


def test_min_tokens_never_pushes_a_constrained_row_outside_its_grammar() -> None:
    """min_tokens holds back stop ids; where the grammar allows only such an id, the grammar
    wins (the id is then an ordinary token) and no masked row draws a token its grammar refuses."""
    engine = make_engine("tiny", kv_slots=64, request_slots=4)
    try:
        engine.begin_session().result()
        processing = LogitsProcessing(prompt_len=2, min_tokens=5, stop_ids=(ord('"'), EOS))
        grammar = GrammarConstraint(Constraint("json", json.dumps(LEVELS | {"type": "string"})))
        request = NewRequest(0, 0.0, 1.0, 0, 0, processing, grammar=grammar)
        launch = prefill(1, 0, [72, 73], [0, 1], new_requests=[request])
        assert engine.submit(launch).result().token_ids == [ord('"')]  # the only token it allows
    finally:
        engine.shutdown()


@pytest.mark.parametrize("check_invariants", [True, False], ids=["checked", "serving"])
def test_a_token_drawn_outside_its_mask_is_caught(
    monkeypatch: pytest.MonkeyPatch, check_invariants: bool
) -> None:
    """The worker's own check on every constrained draw (a draw that ignored its mask is made
    here on purpose): --check-invariants fails the step; a serving worker ends the row (reported
    finished, so the core stops it) and counts the violation."""
    monkeypatch.setattr(
        SimDraw, "sample_masked", lambda self, rows, index, bitmask: self.sample().index_select(0, index)
    )
    backend = load_backend("sim", torch.device("cpu"), torch.float32, 0.0, 0.0)
    engine = WorkerEngine(
        backend, EngineConfig(64, 4, check_invariants), backend.make_streams(torch.device("cpu"))
    )
    try:
        engine.begin_session().result()
        launch = prefill(1, 0, [72, 73], [0, 1], new_requests=[choice_request(0, ["zz"])])
        step = engine.submit(launch)
        if check_invariants:
            with pytest.raises(MaskViolation, match="outside its grammar"):
                step.result()
            return
        assert step.result().grammar_finished == (0,)
        assert engine.metrics.grammar_violations._value.get() == 1
    finally:
        engine.shutdown()


def test_a_step_that_fails_after_its_draws_leaves_the_grammar_thread_free(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A constrained step that fails once its rows are drawn (here: its log-probabilities) never
    hands its tokens to the grammar thread, which would wait for them forever: the next
    session's constrained requests run (a hang guard, not a timing)."""
    engine = make_engine("sim", kv_slots=64, request_slots=4, sim_step_ms=0.0)
    logprobs = SimDraw.logprobs

    def failing(self: SimDraw, ids: torch.Tensor) -> object:
        raise RuntimeError("a fault after the draws")

    try:
        engine.begin_session().result()
        monkeypatch.setattr(SimDraw, "logprobs", failing)
        with pytest.raises(RuntimeError, match="a fault after the draws"):
            engine.submit(prefill(1, 0, [72, 73], [0, 1], new_requests=[choice_request(0, ["ok"])])).result()
        monkeypatch.setattr(SimDraw, "logprobs", logprobs)
        engine.begin_session().result(timeout=60)
        first = engine.submit(prefill(1, 0, [72, 73], [0, 1], new_requests=[choice_request(0, ["ok"])]))
        second = engine.submit(decode(2, [0], [2], [2]))
        assert [first.result(timeout=60).token_ids, second.result(timeout=60).token_ids] == [
            [ord("o")],
            [ord("k")],
        ]
    finally:
        engine.shutdown()


def test_a_tokenizer_the_grammar_engine_cannot_read_is_said_and_breaks_no_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """llguidance refuses some tokenizers (a tokenizer.json without a decoder, for one). The Welcome
    says why, so that the scheduler refuses constrained requests at admission; one that reaches the
    worker anyway ends with its first token, and the step, the session and the other rows go on
    (the first table-less step used to fail every time, the session with it, again and again)."""

    def unreadable(*_: object) -> None:
        raise ValueError("can't determine decoder type: None")

    monkeypatch.setattr(structured, "grammar_tokenizer", unreadable)
    engine = make_engine("sim", kv_slots=64, request_slots=4, sim_step_ms=0.0)
    try:
        info = engine.begin_session().result()
        assert "cannot read this model's tokenizer (can't determine decoder type" in (
            info.structured_outputs_unavailable
        )
        first = Launch(
            1,
            new_requests=[choice_request(0, ["ok"]), NewRequest(1, 0.0, 1.0, 0, 0)],
            row_req_slots=[0, 1],
            row_start_pos=[0, 0],
            row_num_tokens=[2, 2],
            row_from_future=[False, False],
            row_sample=[True, True],
            prompt_ids=[72, 73, 72, 73],
            kv_slots=[0, 1, 2, 3],
        )
        results = [engine.submit(first).result()]
        results += [
            engine.submit(decode(1 + k, [0, 1], [1 + k, 1 + k], [2 + 2 * k, 3 + 2 * k])).result()
            for k in (1, 2)
        ]
        assert [r.grammar_finished for r in results] == [(0,), (), ()]  # the constrained row ends at once
        assert all(len(r.token_ids) == 2 for r in results)  # every step drew both rows
        assert engine.grammar_matchers() == 0
    finally:
        engine.shutdown()
