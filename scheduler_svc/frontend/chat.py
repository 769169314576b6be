"""Chat messages to prompt text, through the model's Jinja chat template, rendered as transformers'
`apply_chat_template` renders it."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import NoReturn

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from scheduler_svc.frontend.tools import (
    CALL_SEPARATOR,
    DEFAULT_FORMAT,
    CallFormat,
    Tool,
    ToolCall,
    render_call,
    tools_system_prompt,
)


class ChatTemplateError(ValueError):
    """The template cannot render these messages (its raise_exception, or a template error)."""


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant turn's calls
    tool_call_id: str = ""  # a "tool" turn: the call it answers
    reasoning_content: str = ""  # an assistant turn's thinking as a reply gave it (Qwen3's template reads it)


# Errors a template's own expressions raise on some input (`{{ 1 // 0 }}`, `{{ 'a' + 1 }}`, a macro
# calling itself forever): the template cannot render those messages.
_RENDER_ERRORS = (jinja2.TemplateError, ArithmeticError, LookupError, TypeError, ValueError, RecursionError)


class ChatTemplate:
    def __init__(self, source: str, special_tokens: Mapping[str, str], thinks: bool = False) -> None:
        """Compiles `source` once (raises ChatTemplateError when it does not compile). `special_tokens`
        are the template variables transformers passes: bos_token, eos_token, unk_token, pad_token
        (only the ones the tokenizer has). `thinks`: a reasoning model's, whose replies' thinking
        can be split from their text (`scheduler_svc/frontend/reasoning.py: thinks`)."""
        self.thinks = thinks
        self._special_tokens = dict(special_tokens)
        self._source = source
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"chat template does not compile: {error}") from error

    @property
    def knows_tools(self) -> bool:
        """Whether the template reads `tools` (transformers passes them; the others get them in
        a system turn, `tools_fallback`)."""
        return "tools" in self._source

    @property
    def call_format(self) -> CallFormat:
        """How the model writes tool calls: its template's format where it describes one."""
        return CallFormat.of_template(self._source) if self.knows_tools else DEFAULT_FORMAT

    def render(
        self,
        messages: Sequence[ChatMessage],
        add_generation_prompt: bool = True,
        tools: Sequence[Tool] = (),
        extra: Mapping[str, object] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """As transformers' `apply_chat_template(messages, tools=..., **extra)`: a tool's
        `parameters` and a call's `arguments` as objects; `extra` are more variables (the
        request's chat_template_kwargs), under the ones named here. A template that knows no
        tools renders `tools_fallback(messages, tools)` instead. `continue_final_message`: the
        text ends where the last message's content does (its turn left open for the reply to
        continue), found as transformers finds it: its last occurrence, else stripped (templates
        that strip contents)."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt: one or the other")
        if not self.knows_tools and (tools or any(m.tool_calls for m in messages)):
            messages = tools_fallback(messages, tools)
        # NOTE: transformers defines `tools` and `documents` (as None) for every template.
        variables = {
            **self._special_tokens,
            **(extra or {}),
            "messages": [_message(m) for m in messages],
            "add_generation_prompt": add_generation_prompt,
            "tools": [_tool(t) for t in tools] if tools and self.knows_tools else None,
            "documents": None,
        }
        try:
            text = self._template.render(variables)
        except ChatTemplateError:
            raise
        except _RENDER_ERRORS as error:
            raise ChatTemplateError(f"chat template failed: {error}") from error
        return _open_final_turn(text, messages[-1].content) if continue_final_message else text


def _open_final_turn(text: str, final: str) -> str:
    """`text` cut after the last occurrence of the final message's content (or of it stripped)."""
    for content in (final, final.strip()):
        end = text.rfind(content)
        if end >= 0:
            return text[: end + len(content)]
    raise ChatTemplateError("continue_final_message: the template does not write the last message's content")


RESERVED_VARIABLES = frozenset({"messages", "add_generation_prompt", "tools", "documents"})


def _message(m: ChatMessage) -> dict[str, object]:
    message: dict[str, object] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        message["content"] = m.content or None  # OpenAI's assistant turn that only calls
        message["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": json.loads(c.arguments)},
            }
            for c in m.tool_calls
        ]
    if m.tool_call_id:
        message["tool_call_id"] = m.tool_call_id
    if m.reasoning_content:
        message["reasoning_content"] = m.reasoning_content
    return message


def _tool(t: Tool) -> dict[str, object]:
    function = {"name": t.name, "description": t.description, "parameters": json.loads(t.parameters)}
    return {"type": "function", "function": function}


def tools_fallback(messages: Sequence[ChatMessage], tools: Sequence[Tool]) -> list[ChatMessage]:
    """For a template that knows no tools: the tools and their call format in the system turn
    (after its own text; a system turn of their own first where there is none), each call of
    the history written out as the model writes calls, after its turn's text."""
    plain = [
        ChatMessage(
            m.role,
            m.content + CALL_SEPARATOR.join(map(render_call, m.tool_calls)),
            reasoning_content=m.reasoning_content,
        )
        for m in messages
    ]
    if not tools:
        return plain
    prompt = tools_system_prompt(list(tools))
    if plain and plain[0].role == "system":
        return [
            ChatMessage("system", f"{plain[0].content}\n\n{prompt}" if plain[0].content else prompt),
            *plain[1:],
        ]
    return [ChatMessage("system", prompt), *plain]


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(message)


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' `tojson`: plain json.dumps, so no HTML escaping, and non-ASCII kept as is."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)
