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
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFRawTokenizer

from scheduler_svc.frontend.tokenizer import ByteTokenizer, HFTokenizer
from scheduler_svc.frontend.tools import (
    CALL_CLOSE,
    CALL_OPEN,
    DEFAULT_FORMAT,
    HERMES_FORMAT,
    CallDelta,
    CallFormat,
    CallStream,
    Reply,
    Tool,
    ToolCall,
    ToolChoice,
    ToolError,
    call_tags,
    check_tools,
    compile_tools,
    merge_deltas,
    parse_reply,
    render_call,
    tool_constraint,
    tools_system_prompt,
)
from stepahead.grammars import GrammarError
from stepahead.protocol import Constraint, TokenizerSpec
from tests.test_tokenizer import byte_level_bpe_json
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


def test_a_reply_cut_short_keeps_what_it_got_of_its_last_call() -> None:
    """As a stream sent it: the call whose name is whole, with its arguments so far (the
    finish reason says the reply was cut); a call cut before its name is whole is not one."""
    first = render_call(ToolCall("add", json.dumps({"a": 1, "b": 2})))
    reply = parse_reply(f"Sure.{first}{CALL_OPEN}" + '{"name": "add", "arguments": {"a": 3')
    assert reply.content == "Sure."
    assert reply.calls == (ToolCall("add", json.dumps({"a": 1, "b": 2})), ToolCall("add", '{"a": 3'))
    assert parse_reply(f"{CALL_OPEN}" + '{"name": "ad') == parse_reply("") == Reply("", ())
    assert parse_reply("plain text <tool_c") == Reply("plain text <tool_c", ())


@pytest.mark.parametrize(
    ("tools", "choice", "field", "says"),
    [
        ([Tool("a b")], ToolChoice(), "tools[0].name", "must match"),
        ([Tool("f"), Tool("f")], ToolChoice(), "tools[1].name", "defined twice"),
        ([Tool("f", parameters="{not json")], ToolChoice(), "tools[0].parameters", "not JSON"),
        (
            [Tool("f", parameters='{"type": "string"}')],
            ToolChoice(),
            "tools[0].parameters",
            "object",
        ),
        (
            [Tool("f", parameters='{"type": "object", "properties": {"x": {"type": "nonsense"}}}')],
            ToolChoice(),
            "tools[0].parameters",
            "nonsense",
        ),
        ([Tool("f")], ToolChoice("named", "g"), "tool_choice.function", "names no tool"),
        ([], ToolChoice("required"), "tool_choice", "at least one tool"),
    ],
)
def test_bad_definitions_are_refused_naming_their_field(
    tools: list[Tool], choice: ToolChoice, field: str, says: str
) -> None:
    with pytest.raises(ToolError, match=says) as refused:
        check_tools(tools, choice)
        constraint = tool_constraint(tools, choice)
        assert constraint is not None
        compile_tools(tools, constraint)
    assert refused.value.field == field


def test_good_definitions_pass_and_the_fallback_prompt_lists_them() -> None:
    check_tools(TOOLS, ToolChoice("named", "add"))
    check_tools([], ToolChoice("auto"))
    prompt = tools_system_prompt(TOOLS)
    assert "get_weather" in prompt and "add" in prompt and CALL_OPEN in prompt


ARGUMENTS = json.dumps({"a": 'x}"{ ]\\', "b": [1, {"c": [2]}], "é": "ü"}, ensure_ascii=False)


@pytest.mark.parametrize("fmt", [DEFAULT_FORMAT, HERMES_FORMAT], ids=["default", "hermes"])
@pytest.mark.parametrize("pieces", [1, 2, 3, 7, 10_000], ids=lambda n: f"in {n}-character pieces")
def test_the_stream_sends_the_content_whole_and_the_calls_as_deltas(pieces: int, fmt: CallFormat) -> None:
    """Whatever the pieces the text arrives in: the content is streamed whole and no character
    of a call's markup ever is; each call's first delta names it, and its deltas' arguments
    join into exactly the text the model wrote (braces and quotes inside strings included)."""
    call = ToolCall("add", ARGUMENTS)
    for content in ["", "Let me add them. ", "a < b <tool ", "<"]:
        reply = content + render_call(call, fmt) + fmt.separator + render_call(call, fmt)
        stream = CallStream(fmt, new_id=lambda i: f"call-{i}")
        streamed, deltas = "", list[CallDelta]()
        for i in range(0, len(reply), pieces):
            text, more = stream.push(reply[i : i + pieces])
            streamed, deltas = streamed + text, deltas + more
        assert streamed + stream.finish() == content, reply
        assert stream.complete and not stream.broken and stream.named == 2
        assert [(d.index, d.id, d.name) for d in deltas if d.name] == [
            (0, "call-0", "add"),
            (1, "call-1", "add"),
        ]
        assert merge_deltas(deltas) == [
            ToolCall("add", ARGUMENTS, "call-0"),
            ToolCall("add", ARGUMENTS, "call-1"),
        ]
        if pieces == 1:  # the arguments went out as they came, not at the end
            assert sum(1 for d in deltas if d.arguments) == 2 * len(ARGUMENTS)
    plain = CallStream(fmt)
    text = "No call: a <tool but not a call <tool_cal"
    streamed = "".join(plain.push(text[i : i + pieces])[0] for i in range(0, len(text), pieces))
    assert streamed + plain.finish() == text and plain.named == 0 and not plain.complete


def test_text_that_breaks_the_layout_ends_the_parse() -> None:
    stream = CallStream()
    content, deltas = stream.push('ok <tool_call>{"name": "f", "args": {}}</tool_call>')
    assert content == "ok " and [d.name for d in deltas] == ["f"] and stream.broken
    assert stream.push(" more")[0] == "" and stream.finish() == "" and not stream.complete


def test_a_template_that_writes_hermes_calls_gets_their_layout(table: MatcherTable) -> None:
    qwen_like = '{{- "<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args>}\\n</tool_call>" }}'
    assert CallFormat.of_template(qwen_like) == HERMES_FORMAT
    assert CallFormat.of_template("{{ messages[0].content }}") == DEFAULT_FORMAT
    for mode in ["required", "auto"]:
        constraint = tool_constraint(TOOLS, ToolChoice(mode), True, HERMES_FORMAT)  # type: ignore[arg-type]
        assert constraint is not None
        prefix = f"Checking. {HERMES_FORMAT.open}" if mode == "auto" else ""
        words = [w for w in (walk(table, constraint, seed, prefix) for seed in range(10)) if w is not None]
        assert len(words) >= 6
        for word in words:
            assert word.startswith(prefix + (HERMES_FORMAT.open if mode == "required" else ""))
            reply = parse_reply(word, HERMES_FORMAT)
            assert reply.calls, word
            check_calls(reply.calls, set(SCHEMAS))


def test_a_vocabulary_s_call_tags_are_taken_as_the_tokens_the_model_writes() -> None:
    """Qwen's `<tool_call>` and `</tool_call>` are tokens added to its vocabulary, which the
    grammar engine takes as special (never text): the grammar allows them by id (`call_tags`),
    beside their text, so a call may open and close with the tokens the model was tuned on."""
    raw = HFRawTokenizer.from_str(byte_level_bpe_json().decode())
    raw.add_tokens([AddedToken(CALL_OPEN, special=False), AddedToken(CALL_CLOSE, special=False)])
    tokenizer = HFTokenizer(raw.to_str().encode())
    tags = call_tags(HERMES_FORMAT, tokenizer)
    assert tags is not None and call_tags(HERMES_FORMAT, ByteTokenizer()) is None
    opening, closing = tags
    vocab = raw.get_vocab_size()
    tokens = MatcherTable(
        grammar_tokenizer(TokenizerSpec("hf", hf_json=raw.to_str().encode()), vocab, (0,)), vocab
    )
    call = '{"name": "add", "arguments": {"a": 1, "b": 2}}'

    def ids(text: str) -> list[int]:
        return list(raw.encode(text, add_special_tokens=False).ids)

    def takes(constraint: Constraint | None, reply: list[int]) -> bool:
        assert constraint is not None
        tokens.start(0, constraint)
        try:
            for token in reply:
                mask = new_bitmask(1, vocab)
                tokens.fill_mask(0, mask, 0)
                if not allowed(mask, vocab)[0, token]:
                    return False
                tokens.advance(0, token)  # as text only, the mask offers the tag's token, which it refuses
            return True
        except GrammarError:
            return False
        finally:
            tokens.release(0)

    as_tokens = [opening, *ids("\n" + call + "\n"), closing]
    for mode, before in (("required", []), ("auto", ids("Let me add. "))):
        choice = ToolChoice(mode)  # type: ignore[arg-type]
        reply = before + as_tokens
        assert takes(tool_constraint(TOOLS, choice, True, HERMES_FORMAT, tags), reply), mode
        assert not takes(tool_constraint(TOOLS, choice, True, HERMES_FORMAT), reply), mode  # as text only
        spelled = before + ids(HERMES_FORMAT.open + call + HERMES_FORMAT.close)
        assert takes(tool_constraint(TOOLS, choice, True, HERMES_FORMAT, tags), spelled), mode
        parsed = parse_reply(raw.decode(reply, skip_special_tokens=True), HERMES_FORMAT)
        assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("add", {"a": 1, "b": 2})]
