"""Tool calling, enforced: the grammar that holds a reply to the calls a request allows, and the
parse of a reply back into its content and calls.

A call is written in one format, which the grammar guarantees, so parsing never fails and no
call text reaches `content`:

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

(SmolLM2's chat template defines no format of its own; this is the one most open chat models
were tuned on.) Several calls are separated by a newline. With `tool_choice`:
- `none`: no grammar (the model answers in text);
- `auto`: any text that does not contain `<tool_call>`, or text up to the first `<tool_call>`
  and then calls only: the trigger is a lazy lexeme, so free text costs nothing until the model
  begins a call, and from there the call is held to its tool's schema;
- `required`: calls only, at least one; a named function: calls of that function only.
`parallel_tool_calls` false allows one call at most. Each call's `arguments` are held to the
tool's `parameters` JSON Schema (`strict` or not: a call always validates).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from stepahead.grammars import JSON_LAYOUT, GrammarError, compile_constraint
from stepahead.protocol import Constraint

CALL_OPEN, CALL_CLOSE, CALL_SEPARATOR = "<tool_call>", "</tool_call>", "\n"
TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for a function's name
MAX_TOOLS = 128
ANY_ARGUMENTS: dict[str, Any] = {"type": "object"}  # a tool that gives no `parameters`

ChoiceMode = Literal["none", "auto", "required", "named"]


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
    parameters: str = json.dumps(ANY_ARGUMENTS)  # JSON text
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


def check_tools(tools: list[Tool], choice: ToolChoice, field: str = "tools") -> None:
    """Raise ToolError naming the first bad definition or choice."""
    if len(tools) > MAX_TOOLS:
        raise ToolError(field, f"at most {MAX_TOOLS} tools, got {len(tools)}")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"{field}[{i}].function"
        if not TOOL_NAME.match(tool.name):
            raise ToolError(f"{where}.name", f"must match {TOOL_NAME.pattern}, got {tool.name!r}")
        if tool.name in seen:
            raise ToolError(f"{where}.name", f"{tool.name!r} is defined twice")
        seen.add(tool.name)
        _check_parameters(f"{where}.parameters", tool.parameters)
    if choice.mode == "required" and not tools:
        raise ToolError("tool_choice", "'required' needs at least one tool")
    if choice.mode == "named" and choice.name not in seen:
        raise ToolError("tool_choice.function.name", f"{choice.name!r} names no tool of the request")


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
    try:
        compile_constraint(Constraint("json", parameters))
    except GrammarError as exc:
        raise ToolError(field, str(exc)) from None


def tool_constraint(tools: list[Tool], choice: ToolChoice, parallel: bool = True) -> Constraint | None:
    """The grammar a reply is held to (None: `none`, or no tools with `auto`)."""
    if choice.mode == "none" or not tools:
        return None
    allowed = [t for t in tools if choice.mode != "named" or t.name == choice.name]
    body = f"call_body: %json {json.dumps(_call_schema(allowed))} {json.dumps(CALL_CLOSE)}"
    more = f"({json.dumps(CALL_SEPARATOR + CALL_OPEN)} call_body)*" if parallel else ""
    if choice.mode == "auto":
        rules = [
            f"start: TEXT | head call_body {more}",
            f"TEXT: /(.|\\n)*/ & ~/(?s:.*){re.escape(CALL_OPEN)}(?s:.*)/",
            f"head[lazy]: /(.|\\n)*{re.escape(CALL_OPEN)}/",
        ]
    else:
        rules = [f"start: {json.dumps(CALL_OPEN)} call_body {more}"]
    return Constraint("grammar", "\n".join([*rules, body]) + "\n")


def _call_schema(tools: list[Tool]) -> dict[str, Any]:
    """One call of any of `tools`: {"name": <its name>, "arguments": <its parameters>}."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": json.loads(t.parameters)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    # NOTE: `json.dumps`' layout, as for response_format: free whitespace has no end.
    return {**schema, "x-guidance": dict(JSON_LAYOUT)}


def render_call(call: ToolCall) -> str:
    """A call as the model writes it (an assistant turn of the history that made calls)."""
    return (
        f"{CALL_OPEN}{json.dumps({'name': call.name, 'arguments': json.loads(call.arguments)})}{CALL_CLOSE}"
    )


def parse_reply(text: str) -> Reply:
    """`text` split into content and calls. Text the grammar produced always parses whole; a
    reply cut short (by length, a stop string or an abort) keeps its complete calls and drops
    the one it was in the middle of."""
    start = text.find(CALL_OPEN)
    if start < 0:
        return Reply(text, ())
    content = text[:start] or None
    calls = []
    for chunk in text[start:].split(CALL_SEPARATOR + CALL_OPEN):
        body = chunk.removeprefix(CALL_OPEN)
        if not body.endswith(CALL_CLOSE):
            break  # cut short
        try:
            call = json.loads(body[: -len(CALL_CLOSE)])
        except ValueError:
            break
        calls.append(ToolCall(call["name"], json.dumps(call["arguments"], ensure_ascii=False)))
    return Reply(content, tuple(calls))


class CallCapture:
    """A reply's text stream split where its calls begin: the text before the first `<tool_call>`
    is content, streamed as it comes (less a tail that may begin the trigger, held back as a
    stop string's prefix is); everything from the trigger on is the calls' text, never streamed,
    parsed once the reply ends."""

    def __init__(self) -> None:
        self._held = ""
        self.calls_text: str | None = None  # None until the trigger is seen

    def push(self, text: str) -> str:
        """The content now safe to stream."""
        if self.calls_text is not None:
            self.calls_text += text
            return ""
        pending = self._held + text
        start = pending.find(CALL_OPEN)
        if start >= 0:
            self._held, self.calls_text = "", pending[start:]
            return pending[:start]
        keep = next((n for n in range(len(CALL_OPEN) - 1, 0, -1) if pending.endswith(CALL_OPEN[:n])), 0)
        self._held = pending[len(pending) - keep :]
        return pending[: len(pending) - keep]

    def finish(self) -> tuple[str, tuple[ToolCall, ...]]:
        """The content held back, and the reply's calls."""
        held, self._held = self._held, ""
        if self.calls_text is None:
            return held, ()
        return held, parse_reply(self.calls_text).calls


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
        "one call a line, and nothing after the calls. The tools:\n"
        f"{listed}"
    )
