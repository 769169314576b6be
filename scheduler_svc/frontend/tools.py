"""Tool calling, enforced: the grammar that holds a reply to the calls a request allows, and the
parse of a reply back into its content and calls.

A call is written in one format, which the grammar guarantees, so parsing never fails and no
call text reaches `content`. The default (for a chat template that defines none, as SmolLM2's):

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

A template that writes its calls as Hermes and Qwen do (`<tool_call>`, a newline, the JSON, a
newline, `</tool_call>`) gets that layout, calls separated by a newline
(`CallFormat.of_template`). The default writes several calls one right after another: with a
newline between them, a model that was not tuned on calls (SmolLM2) tends to write the same call
again and again, where it ends its turn after `</tool_call>`. With `tool_choice`:
- `none`: no grammar (the model answers in text);
- `auto`: any text that does not contain `<tool_call>`, or text up to the first `<tool_call>`
  and then calls only: the trigger is a lazy lexeme, so free text is held only against writing
  the opening where no call follows (its masks cost 0.4 of a JSON string's,
  `bench.tool_masks`), and from the opening on the call is held to its tool's schema;
- `required`: calls only, at least one; a named function: calls of that function only.
`parallel_tool_calls` false allows one call at most. Each call's `arguments` are held to the
tool's `parameters` JSON Schema (`strict` or not: a call always validates).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from scheduler_svc.frontend.tokenizer import Tokenizer
from stepahead.grammars import JSON_LAYOUT, GrammarError, compile_constraint
from stepahead.protocol import Constraint

CALL_OPEN, CALL_CLOSE, CALL_SEPARATOR = "<tool_call>", "</tool_call>", ""
# A template that writes `<tool_call>` then a newline (as a character, or as Jinja's escape).
HERMES_CALL = re.compile(r"<tool_call>(\n|\\n)")
TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for a function's name
MAX_TOOLS = 128
ANY_ARGUMENTS = '{"type": "object"}'  # the schema of a tool that gives no `parameters`

ChoiceMode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class CallFormat:
    """How a reply's calls are written: each `open` + `{"name": ..., "arguments": ...}` +
    `close`, joined by `separator` (the JSON in `json.dumps`' layout)."""

    open: str = CALL_OPEN
    close: str = CALL_CLOSE
    separator: str = CALL_SEPARATOR

    @staticmethod
    def of_template(source: str) -> CallFormat:
        """The format a chat template's own text describes, else the default."""
        return HERMES_FORMAT if HERMES_CALL.search(source) else DEFAULT_FORMAT


DEFAULT_FORMAT = CallFormat()
HERMES_FORMAT = CallFormat(CALL_OPEN + "\n", "\n" + CALL_CLOSE, "\n")


class ToolError(ValueError):
    """A bad tool definition or choice; `field` names it as the request spells it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class Tool:
    """A function tool: its name, what it does, and its arguments' JSON Schema."""

    name: str
    description: str = ""
    parameters: str = ANY_ARGUMENTS  # JSON text
    strict: bool = True


@dataclass(frozen=True)
class ToolChoice:
    mode: ChoiceMode = "auto"
    name: str = ""  # with mode "named"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI carries it
    id: str = ""  # the call's id, as a response gave it (a history's turns carry it back)


@dataclass(frozen=True)
class Reply:
    """A reply split into its text and its calls (`content` None when it is calls only)."""

    content: str | None
    calls: tuple[ToolCall, ...]


def check_tools(tools: list[Tool], choice: ToolChoice, prefix: str = "") -> None:
    """Raise ToolError naming the first bad definition or choice: `{prefix}tools[i].name`,
    `{prefix}tools[i].parameters`, `{prefix}tool_choice` or `{prefix}tool_choice.function`."""
    if len(tools) > MAX_TOOLS:
        raise ToolError(f"{prefix}tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"{prefix}tools[{i}]"
        if not TOOL_NAME.match(tool.name):
            raise ToolError(f"{where}.name", f"must match {TOOL_NAME.pattern}, got {tool.name!r}")
        if tool.name in seen:
            raise ToolError(f"{where}.name", f"{tool.name!r} is defined twice")
        seen.add(tool.name)
        _check_parameters(f"{where}.parameters", tool.parameters)
    if choice.mode == "required" and not tools:
        raise ToolError(f"{prefix}tool_choice", "'required' needs at least one tool")
    if choice.mode == "named" and choice.name not in seen:
        raise ToolError(f"{prefix}tool_choice.function", f"{choice.name!r} names no tool of the request")


def _check_parameters(field: str, parameters: str) -> None:
    try:
        schema = json.loads(parameters)
    except ValueError as exc:
        raise ToolError(field, f"not JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise ToolError(field, "a JSON Schema object")
    if schema.get("type", "object") != "object":
        raise ToolError(
            field, f"the arguments are an object: type must be 'object', got {schema.get('type')!r}"
        )


def compile_tools(tools: list[Tool], constraint: Constraint, prefix: str = "") -> None:
    """Compile `constraint` (`tool_constraint(tools, ...)`), the costliest check, once the cheap
    ones passed; when it fails, ToolError names the tool whose schema does not compile."""
    try:
        compile_constraint(constraint)
    except GrammarError as exc:
        for i, tool in enumerate(tools):
            try:
                compile_constraint(Constraint("json", json.dumps(_object(json.loads(tool.parameters)))))
            except GrammarError as own:
                raise ToolError(f"{prefix}tools[{i}].parameters", str(own).strip()) from None
        raise ToolError(f"{prefix}tools", str(exc).strip()) from None


def tool_constraint(
    tools: list[Tool],
    choice: ToolChoice,
    parallel: bool = True,
    fmt: CallFormat | None = None,
    tags: tuple[int, int] | None = None,
) -> Constraint | None:
    """The grammar a reply is held to (None: `none`, or no tools with `auto`). `tags`: the ids of
    `<tool_call>` and `</tool_call>` where they are tokens added to the vocabulary (Qwen's, with
    Hermes' format): the grammar engine takes such tokens as special, never as text, so the
    grammar allows them by id beside the tags' text, or the model could not write its own."""
    if choice.mode == "none" or not tools:
        return None
    fmt = fmt or DEFAULT_FORMAT
    allowed = [t for t in tools if choice.mode != "named" or t.name == choice.name]
    opening, closing = json.dumps(fmt.open), json.dumps(fmt.close)
    token_opening = ""
    if tags is not None:
        token_opening = _around(f"<[{tags[0]}]>", "", fmt.open.removeprefix(CALL_OPEN))
        opening += f" | {token_opening}"
        closing += f" | {_around(f'<[{tags[1]}]>', fmt.close.removesuffix(CALL_CLOSE), '')}"
    separator = f"{json.dumps(fmt.separator)} " if fmt.separator else ""
    more = f"({separator}opening call_body)*" if parallel else ""
    rules = [
        f"call_body: %json {json.dumps(_call_schema(allowed))} closing",
        f"opening: {opening}",
        f"closing: {closing}",
    ]
    if choice.mode == "auto":
        text_opening = _lark_regex(fmt.open)
        starts = ["TEXT", f"head call_body {more}"]
        if token_opening:  # text (never the tag's text) up to the tag's token
            starts.append(f"TEXT? {token_opening} call_body {more}")
        rules = [
            f"start: {' | '.join(starts)}",
            f"TEXT: /(.|\\n)*/ & ~/(?s:.*){text_opening}(?s:.*)/",
            f"head[lazy]: /(.|\\n)*{text_opening}/",
            *rules,
        ]
    else:
        rules = [f"start: opening call_body {more}", *rules]
    return Constraint("grammar", "\n".join(rules) + "\n")


def call_tags(fmt: CallFormat, tokenizer: Tokenizer) -> tuple[int, int] | None:
    """The ids of the format's tags (`<tool_call>`, `</tool_call>`) where both are tokens added to
    the vocabulary (None: they are text)."""
    opening, closing = tokenizer.added_token(CALL_OPEN), tokenizer.added_token(CALL_CLOSE)
    if opening is None or closing is None or not fmt.open.startswith(CALL_OPEN):
        return None
    return opening, closing


def _around(token: str, before: str, after: str) -> str:
    """A token between two literals (either may be empty), as a Lark sequence."""
    return " ".join(
        [*([json.dumps(before)] if before else []), token, *([json.dumps(after)] if after else [])]
    )


def _lark_regex(literal: str) -> str:
    """`literal` as a regex inside a Lark /.../ (a newline written as an escape)."""
    return "".join("\\n" if c == "\n" else re.escape(c).replace("/", "\\/") for c in literal)


def _call_schema(tools: list[Tool]) -> dict[str, Any]:
    """One call of any of `tools`: {"name": <its name>, "arguments": <its parameters>}."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": _object(json.loads(t.parameters))},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    # NOTE: `json.dumps`' layout, as for response_format: free whitespace has no end.
    return {**schema, "x-guidance": dict(JSON_LAYOUT)}


def _object(schema: dict[str, Any]) -> dict[str, Any]:
    """Arguments are an object, whatever else the schema allows (`{}` allows any JSON)."""
    return {**schema, "type": "object"}


def render_call(call: ToolCall, fmt: CallFormat = DEFAULT_FORMAT) -> str:
    """A call as the model writes it (an assistant turn of the history that made calls)."""
    body = json.dumps({"name": call.name, "arguments": json.loads(call.arguments)}, ensure_ascii=False)
    return f"{fmt.open}{body}{fmt.close}"


def parse_reply(text: str, fmt: CallFormat | None = None) -> Reply:
    """`text` split into content and calls, as a CallStream splits it (ids left empty). Text the
    grammar produced always parses whole; a reply cut short (by length, a stop string or an
    abort) in the middle of a call keeps that call with the arguments it got so far, as a
    stream sent them (its finish reason says it was cut)."""
    stream = CallStream(fmt, new_id=lambda index: "")
    content, deltas = stream.push(text)
    content += stream.finish()
    calls = merge_deltas(deltas)
    return Reply(content if content or not calls else None, tuple(calls))


@dataclass(frozen=True)
class CallDelta:
    """A piece of a call, as OpenAI streams it: a call's first delta names it (`id`, `name`),
    every delta may carry a fragment of its `arguments` (their concatenation is the whole)."""

    index: int  # which call of the reply
    id: str = ""
    name: str = ""
    arguments: str = ""


def merge_deltas(deltas: Iterable[CallDelta]) -> list[ToolCall]:
    """The calls the deltas make up, in index order."""
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        known = calls.get(d.index)
        if known is None:
            calls[d.index] = ToolCall(d.name, d.arguments, d.id)
        else:
            calls[d.index] = ToolCall(known.name, known.arguments + d.arguments, known.id)
    return [calls[i] for i in sorted(calls)]


def new_call_id(index: int = 0) -> str:
    """A call's id, as OpenAI's look: `call_` and 24 random characters."""
    return f"call_{uuid.uuid4().hex[:24]}"


_HEAD, _SEP, _TAIL = '{"name": "', ', "arguments": ', "}"  # the layout the grammar holds a call to


class CallStream:
    """A reply's text stream split where its calls begin, incrementally.

    The text before the first call is content, streamed as it comes, less a tail that may begin
    the call's opening (held back, as a stop string's prefix is). From the opening on, the text
    is calls only, in the layout the grammar guarantees:
    `<open>{"name": "NAME", "arguments": ARGS}<close>` joined by the separator. A call's first
    delta (id, name) goes out once its name is whole, then its arguments as they come: no
    character of the calls' markup ever reaches the content.

    Text that breaks the layout (which only a reply not held by the grammar could hold) ends the
    parse: the rest is dropped, and `broken` says so.
    """

    def __init__(self, fmt: CallFormat | None = None, new_id: Callable[[int], str] = new_call_id) -> None:
        self._fmt = fmt or DEFAULT_FORMAT
        self._new_id = new_id
        self._pending = ""  # text not consumed yet
        self._state = "content"
        self._index = -1  # the call being read
        self._depth, self._in_string, self._escaped = 0, False, False  # inside ARGS
        self.broken = False
        self.named = 0  # calls begun (their name seen)

    def push(self, text: str) -> tuple[str, list[CallDelta]]:
        """(content now safe to stream, call deltas now known)."""
        self._pending += text
        content, deltas = "", []
        while self._pending:
            step = self._step()
            if step is None:
                break
            more_content, delta = step
            content += more_content
            if delta is not None:
                deltas.append(delta)
        return content, deltas

    @property
    def complete(self) -> bool:
        """Whether the text so far is calls, each one whole."""
        return self._state == "next"

    def finish(self) -> str:
        """The content held back (a tail that did not begin a call after all)."""
        held = self._pending if self._state == "content" else ""
        self._pending = ""
        return held

    def _step(self) -> tuple[str, CallDelta | None] | None:
        """Consume what the state can; None when it needs more text."""
        fmt, pending = self._fmt, self._pending
        if self._state == "content":
            start = pending.find(fmt.open)
            if start >= 0:
                self._consume(start + len(fmt.open), "head")
                self._index += 1
                return pending[:start], None
            keep = _partial_suffix(pending, fmt.open)
            self._pending = pending[len(pending) - keep :]
            return (pending[: len(pending) - keep], None) if keep < len(pending) else None
        if self._state == "head":
            return self._expect(_HEAD, "name")
        if self._state == "name":
            end = pending.find('"')
            if end < 0:
                return None
            self._consume(end + 1, "sep")
            self.named += 1
            return "", CallDelta(self._index, self._new_id(self._index), pending[:end])
        if self._state == "sep":
            return self._expect(_SEP, "arguments")
        if self._state == "arguments":
            return "", self._arguments()
        if self._state == "tail":
            return self._expect(_TAIL + fmt.close, "next")
        if self._state == "next":
            step = self._expect(fmt.separator + fmt.open, "head")
            if step is not None and not self.broken:
                self._index += 1
            return step
        self._pending = ""  # broken: dropped
        return None

    def _expect(self, literal: str, then: str) -> tuple[str, None] | None:
        if self._pending.startswith(literal):
            self._consume(len(literal), then)
            return "", None
        if literal.startswith(self._pending):
            return None  # more to come
        self.broken, self._state, self._pending = True, "broken", ""
        return None

    def _arguments(self) -> CallDelta:
        """The arguments' JSON, scanned for where the object ends."""
        pending = self._pending
        end = len(pending)
        for i, ch in enumerate(pending):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    end = i + 1
                    self._state = "tail"
                    break
        self._pending = pending[end:]
        return CallDelta(self._index, arguments=pending[:end])

    def _consume(self, n: int, then: str) -> None:
        self._pending, self._state = self._pending[n:], then


def _partial_suffix(text: str, literal: str) -> int:
    """The length of the longest tail of `text` that begins `literal` (but is not all of it)."""
    return next((n for n in range(min(len(literal) - 1, len(text)), 0, -1) if text.endswith(literal[:n])), 0)


def tools_system_prompt(tools: list[Tool]) -> str:
    """For a chat template that knows no tools: the tools and the call format, as a system turn."""
    listed = "\n".join(
        json.dumps({"name": t.name, "description": t.description, "parameters": json.loads(t.parameters)})
        for t in tools
    )
    example = render_call(ToolCall("<function name>", json.dumps({"<argument>": "<value>"})))
    return (
        "You may call these tools. To call one, reply with\n"
        f"{example}\n"
        "(several calls one right after another), and nothing after the calls. The tools:\n"
        f"{listed}"
    )
