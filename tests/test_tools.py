"""Tool calling's grammar and parse (scheduler_svc/frontend/tools.py), on their own: random
walks under each `tool_choice`'s grammar (the byte-level tokenizer, every allowed token as
likely as the others, structure a little likelier so that walks end) always parse back into
content and calls, every call names a tool it may and its arguments validate against that
tool's schema (jsonschema); bad definitions are refused naming their field."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from scheduler_svc.frontend.tools import (
    CALL_OPEN,
    CallCapture,
    Tool,
    ToolCall,
    ToolChoice,
    ToolError,
    check_tools,
    parse_reply,
    render_call,
    tool_constraint,
    tools_system_prompt,
)
from stepahead.protocol import Constraint, TokenizerSpec
from worker_svc.grammar import MatcherTable, allowed, grammar_tokenizer, new_bitmask

VOCAB, EOS = 258, 257
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
SUM = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    Tool("get_weather", "The weather in a city", json.dumps(WEATHER)),
    Tool("add", "a + b", json.dumps(SUM)),
]
SCHEMAS = {"get_weather": WEATHER, "add": SUM}
LIKELIER = {ord(c) for c in '"}<>/\n'} | {EOS}  # structure, so that walks end


@pytest.fixture(scope="module")
def table() -> MatcherTable:
    return MatcherTable(grammar_tokenizer(TokenizerSpec("byte"), VOCAB, (EOS,)), VOCAB)


def walk(
    table: MatcherTable, constraint: Constraint, seed: int, prefix: str = "", limit: int = 600
) -> str | None:
    """A random word of the grammar that starts with `prefix` (None if it runs past `limit`
    tokens)."""
    rng = random.Random(seed)
    out = list(prefix.encode())
    table.start(0, constraint, out)
    try:
        bitmask = new_bitmask(1, VOCAB)
        for _ in range(limit):
            table.fill_masks([0], bitmask)
            ids = allowed(bitmask, VOCAB)[0].nonzero().flatten().tolist()
            weights = [20 if i in LIKELIER else 1 for i in ids]
            token = rng.choices(ids, weights)[0]
            if table.advance(0, token) or token == EOS:
                return bytes(t for t in [*out, token] if t < 256).decode()
            out.append(token)
        return None
    finally:
        table.release(0)


def check_calls(calls: tuple[ToolCall, ...], names: set[str]) -> None:
    for call in calls:
        assert call.name in names
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "one call"])
@pytest.mark.parametrize("mode", ["required", "named", "auto"])
def test_every_word_of_a_choices_grammar_parses_into_valid_calls(
    table: MatcherTable, mode: str, parallel: bool
) -> None:
    choice = ToolChoice("named", "add") if mode == "named" else ToolChoice(mode)  # type: ignore[arg-type]
    constraint = tool_constraint(TOOLS, choice, parallel)
    assert constraint is not None
    names = {"add"} if mode == "named" else set(SCHEMAS)
    # Under `auto`, half the walks begin a call (random bytes seldom spell its trigger).
    prefixes = [f"Checking. {CALL_OPEN}" if mode == "auto" and seed % 2 else "" for seed in range(40)]
    words = [
        w for w in (walk(table, constraint, seed, p) for seed, p in enumerate(prefixes)) if w is not None
    ]
    assert len(words) >= 30
    with_calls = 0
    for word in words:
        reply = parse_reply(word)
        check_calls(reply.calls, names)
        assert (reply.content or "").count(CALL_OPEN) == 0, word  # no call text in the content
        if not parallel:
            assert len(reply.calls) <= 1, word
        if mode != "auto":
            assert reply.content is None and reply.calls, word
        else:  # the whole word is its content, or its content and then its calls
            content = reply.content or ""
            assert word.startswith(content), word
            assert word[len(content) :].count(CALL_OPEN) == len(reply.calls), word
        with_calls += bool(reply.calls)
    assert with_calls >= 10


def test_auto_leaves_text_free_until_a_call_begins(table: MatcherTable) -> None:
    constraint = tool_constraint(TOOLS, ToolChoice("auto"))
    assert constraint is not None
    bitmask = new_bitmask(1, VOCAB)
    for text, free in [("It is sunny", True), ("It is <tool_", True), ("It is <tool_call>", False)]:
        table.start(0, constraint, list(text.encode()))
        table.fill_masks([0], bitmask)
        table.release(0)
        allowed_ids = allowed(bitmask, VOCAB)[0].nonzero().flatten().tolist()
        assert (len(allowed_ids) > 100) == free, text
        if not free:
            assert allowed_ids == [ord("{")]


def test_none_and_no_tools_constrain_nothing() -> None:
    assert tool_constraint(TOOLS, ToolChoice("none")) is None
    assert tool_constraint([], ToolChoice("auto")) is None


def test_a_reply_cut_short_keeps_its_complete_calls() -> None:
    first = render_call(ToolCall("add", json.dumps({"a": 1, "b": 2})))
    reply = parse_reply(f"Sure.{first}\n{CALL_OPEN}" + '{"name": "add", "argu')
    assert reply.content == "Sure."
    assert reply.calls == (ToolCall("add", json.dumps({"a": 1, "b": 2})),)
    assert parse_reply("plain text") == parse_reply("plain text")
    assert parse_reply("plain text").calls == ()


@pytest.mark.parametrize(
    ("tools", "choice", "field", "says"),
    [
        ([Tool("a b")], ToolChoice(), "tools[0].function.name", "must match"),
        ([Tool("f"), Tool("f")], ToolChoice(), "tools[1].function.name", "defined twice"),
        ([Tool("f", parameters="{not json")], ToolChoice(), "tools[0].function.parameters", "not JSON"),
        (
            [Tool("f", parameters='{"type": "string"}')],
            ToolChoice(),
            "tools[0].function.parameters",
            "object",
        ),
        (
            [Tool("f", parameters='{"type": "object", "properties": {"x": {"type": "nonsense"}}}')],
            ToolChoice(),
            "tools[0].function.parameters",
            "nonsense",
        ),
        ([Tool("f")], ToolChoice("named", "g"), "tool_choice.function.name", "names no tool"),
        ([], ToolChoice("required"), "tool_choice", "at least one tool"),
    ],
)
def test_bad_definitions_are_refused_naming_their_field(
    tools: list[Tool], choice: ToolChoice, field: str, says: str
) -> None:
    with pytest.raises(ToolError, match=says) as refused:
        check_tools(tools, choice)
    assert refused.value.field == field


def test_good_definitions_pass_and_the_fallback_prompt_lists_them() -> None:
    check_tools(TOOLS, ToolChoice("named", "add"))
    check_tools([], ToolChoice("auto"))
    prompt = tools_system_prompt(TOOLS)
    assert "get_weather" in prompt and "add" in prompt and CALL_OPEN in prompt


@pytest.mark.parametrize("pieces", [1, 2, 3, 7], ids=lambda n: f"in {n}-character pieces")
def test_the_capture_streams_the_content_and_never_a_call(pieces: int) -> None:
    """Whatever the pieces the text arrives in: the content is streamed whole, no character
    of a call ever is, and the calls come back parsed at the end."""
    call = ToolCall("add", json.dumps({"a": 1, "b": 2}))
    for content in ["", "Let me add them. ", "a < b <tool ", "<"]:
        reply = content + render_call(call) + "\n" + render_call(call)
        capture = CallCapture()
        streamed = "".join(capture.push(reply[i : i + pieces]) for i in range(0, len(reply), pieces))
        held, calls = capture.finish()
        assert streamed + held == content, reply  # so not one character of a call
        assert calls == (call, call)
    plain = CallCapture()
    text = "No call: a <tool but not a call <tool_cal"
    streamed = "".join(plain.push(text[i : i + pieces]) for i in range(0, len(text), pieces))
    assert streamed + plain.finish()[0] == text and plain.finish() == ("", ())
