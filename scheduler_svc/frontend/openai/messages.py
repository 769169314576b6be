"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`), served over
the chat path as the Responses API is: a body is checked and mapped onto a chat completion's
(`MessagesRequest.to_chat`), which the frontend admits as any other, and its one completion is
shaped as a Message: content blocks (a reasoning model's `thinking`, the text, then one `tool_use`
block per tool call), Anthropic's stop reasons and usage, and, streamed, its events
(`message_start`, `content_block_start`, `content_block_delta` with `thinking_delta` and
`signature_delta`, `text_delta` or `input_json_delta`, `content_block_stop`, `message_delta`,
`message_stop`). `max_tokens` is a cap, as Anthropic's: a request is admitted with at most what
the context leaves, and an answer the full context ended says `model_context_window_exceeded`.
Errors have Anthropic's body (`{"type": "error", "error": {"type", "message"}}`), and the API key
may come as `x-api-key`, as its clients send it.

Mapped: `system` (a string or text blocks), the `messages` (text, `tool_use` and `thinking` in an
assistant turn (its thinking reaches the template as the turn's `reasoning_content`;
`redacted_thinking` is dropped), a system turn's text blocks, `tool_result` in a user turn: a
tool message each; a last assistant turn is continued, as chat's `continue_final_message`),
`stop_sequences`, `tools` (client tools: name, description, input_schema, strict) and
`tool_choice` (`auto`, `any`, `tool`, `none`; `disable_parallel_tool_use`), `output_config.format`
(a JSON schema the answer is held to: chat's `response_format`), `thinking` (`enabled` and
`disabled` reach the template as `enable_thinking`, which a reasoning model's reads; `adaptive`
leaves it to the model; no budget is steered, and thinking blocks carry an empty signature), and
the sampling settings Anthropic's API had and local servers keep (`temperature` 0-1, `top_p`,
`top_k`). Accepted as hints that change no output: `cache_control` (top-level or on any block:
the prefix cache needs no marks), `metadata.user_id`, `service_tier`, `speed`, `inference_geo`,
`diagnostics`, `user_profile_id`, `workspace_id`. Refused by name: images and documents, server
tools, `output_config.effort`, `container`, `mcp_servers`, `max_tokens` 0 (pre-warming a cache).
The sampling extras of the chat body (`seed`, `ignore_eos`, ...) pass on as they are.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from scheduler_svc.contract import FinishReason
from scheduler_svc.frontend.openai.protocol import (
    STRICT,
    ChatCompletionRequest,
    Counts,
    FieldError,
)
from scheduler_svc.frontend.openai.renames import FieldNames
from scheduler_svc.frontend.openai.responses import CHAT_EXTRAS, chat_body, chat_request, string_field
from scheduler_svc.frontend.tools import CallDelta

# Fields only Anthropic's hosted service serves: refused unless absent.
NOT_SERVED = {
    "container": "containers are not served",
    "mcp_servers": "MCP servers are not served: pass the tools as client tools",
    "context_management": "not served: send the context as messages",
}
# Fields that change no output here: accepted, whatever their value.
HINTS = ("cache_control", "speed", "inference_geo", "diagnostics", "user_profile_id", "workspace_id")
# adaptive: the model decides; enabled and disabled reach the template as `enable_thinking` (a
# reasoning model's that reads it, as Qwen3's); no budget is steered here
THINKING_SERVED = ("disabled", "adaptive", "enabled")
SERVED_BLOCKS = {
    "assistant": "an assistant turn: only text, thinking and tool_use",
    "user": "a user turn: only text and tool_result",
}
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # and "tool": a named one
# Anthropic's error types by HTTP status.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class OutputFormat(BaseModel):
    model_config = STRICT

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = STRICT

    format: OutputFormat | None = None
    effort: str | None = None  # refused unless absent: no effort is steered here


class MessagesRequest(BaseModel):
    """A Messages body (`count_tokens`: no `max_tokens`); `messages`, `system`, `tools` and
    `tool_choice` are checked block by block in `to_chat`."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = None
    top_k: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: OutputConfig | None = None
    metadata: dict[str, Any] | None = None  # `user_id`: accepted
    service_tier: str | None = None  # accepted: one tier here

    def to_chat(self, count_only: bool = False) -> tuple[ChatCompletionRequest, MessageFieldNames]:
        """The chat completion this body asks for, and how to name the chat body's fields back;
        FieldError naming this body's field where it asks for what is not served."""
        self._check_served(count_only)
        names = MessageFieldNames()
        messages: list[dict[str, Any]] = []
        if self.system is not None:
            messages.append({"role": "system", "content": _text(self.system, "system")})
            names.messages.append("system")
        for i, message in enumerate(self.messages):
            _add_message(messages, names, message, f"messages[{i}]")
        optional = {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop": self.stop_sequences,
        }
        body = chat_body(messages, self.stream and not count_only, self.model_extra, optional)
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and "tool_calls" not in last:
            body.update(add_generation_prompt=False, continue_final_message=True)  # Anthropic's prefill
        if self.output_config is not None and self.output_config.format is not None:
            schema = {"name": "output", "schema": self.output_config.format.schema_}
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
        if self.tools:
            body["tools"] = [_tool(tool, f"tools[{i}]") for i, tool in enumerate(self.tools)]
        if self.tool_choice is not None:
            body.update(_tool_choice(self.tool_choice))
        thinking = None if self.thinking is None else self.thinking.get("type")
        if thinking in ("enabled", "disabled"):
            kwargs = body.get("chat_template_kwargs")
            body["chat_template_kwargs"] = {
                "enable_thinking": thinking == "enabled",
                **(kwargs if isinstance(kwargs, dict) else {}),
            }
        return chat_request(body, names), names

    def _check_served(self, count_only: bool) -> None:
        if self.max_tokens is None and not count_only:
            raise FieldError("max_tokens", "required")
        extra = self.model_extra or {}
        for name, why in NOT_SERVED.items():
            if extra.get(name) is not None:
                raise FieldError(name, why)
        if self.thinking is not None and self.thinking.get("type") not in THINKING_SERVED:
            raise FieldError("thinking.type", f"must be one of {', '.join(THINKING_SERVED)}")
        if self.output_config is not None and self.output_config.effort is not None:
            raise FieldError("output_config.effort", "not served: no effort is steered here")

    def unknown_fields(self) -> list[str]:
        """Fields of the body no API documents (ignored, as the chat endpoint ignores them)."""
        known = (*CHAT_EXTRAS, *NOT_SERVED, *HINTS)
        return [name for name in self.model_extra or {} if name not in known]


def _add_message(messages: list[dict[str, Any]], names: MessageFieldNames, message: Any, at: str) -> None:
    """One turn as chat messages: a user turn's text, and a tool message for each of its
    `tool_result` blocks (in their order); an assistant turn's text and `tool_use` calls; a system
    turn's text."""
    role = message.get("role") if isinstance(message, dict) else None
    if role not in ("user", "assistant", "system"):
        raise FieldError(f"{at}.role", f"must be user, assistant or system, got {str(role)[:32]!r}")
    content = message.get("content")
    if role == "system":  # a string or text blocks, as the top-level `system`
        messages.append({"role": "system", "content": _text(content, f"{at}.content")})
        names.messages.append(at)
        return
    if isinstance(content, str):
        messages.append({"role": role, "content": content})
        names.messages.append(at)
        return
    if not isinstance(content, list):
        raise FieldError(f"{at}.content", "must be a string or a list of content blocks")
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        where = f"{at}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(string_field(block, "text", where))
        elif kind == "thinking" and role == "assistant":  # a reply's, given back: its reasoning
            thoughts.append(string_field(block, "thinking", where))
        elif kind == "redacted_thinking" and role == "assistant":
            continue  # another server's, encrypted: nothing to show the template
        elif kind == "tool_use" and role == "assistant":
            arguments = json.dumps(block.get("input", {}), ensure_ascii=False)
            if not isinstance(block.get("input", {}), dict):
                raise FieldError(f"{where}.input", "must be an object")
            names.calls[(len(messages), len(calls))] = where
            call = {"name": string_field(block, "name", where), "arguments": arguments}
            calls.append({"id": string_field(block, "id", where), "type": "function", "function": call})
        elif kind == "tool_result" and role == "user":
            if texts:  # what came before it, in its place
                messages.append({"role": "user", "content": "".join(texts)})
                names.messages.append(at)
                texts = []
            result = block.get("content", "")
            text = result if isinstance(result, str) else _text(result, f"{where}.content")
            messages.append(
                {"role": "tool", "tool_call_id": string_field(block, "tool_use_id", where), "content": text}
            )
            names.messages.append(where)
        else:
            served = SERVED_BLOCKS[role]
            raise FieldError(f"{where}.type", f"{str(kind)[:32]!r} is not served in {served} blocks are")
    if texts or calls or thoughts or not content:
        turn: dict[str, Any] = {"role": role, "content": "".join(texts) if texts or not calls else None}
        if calls:
            turn["tool_calls"] = calls
        if thoughts:
            turn["reasoning_content"] = "".join(thoughts)
        messages.append(turn)
        names.messages.append(at)


def _text(content: Any, at: str) -> str:
    """A string, or text blocks (their `cache_control` accepted): their texts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise FieldError(at, "must be a string or a list of text blocks")
    texts = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text":
            raise FieldError(f"{at}[{j}].type", f"only text blocks are served here, got {str(kind)[:32]!r}")
        texts.append(string_field(block, "text", f"{at}[{j}]"))
    return "".join(texts)


def _tool(tool: dict[str, Any], at: str) -> dict[str, Any]:
    """A client tool as chat's function tool; a server tool (`type` other than `custom`) is refused."""
    kind = tool.get("type", "custom")
    if kind != "custom":
        raise FieldError(
            f"{at}.type", f"server tools are not served, got {str(kind)[:48]!r}: pass client tools"
        )
    schema = tool.get("input_schema")
    if not isinstance(schema, dict):
        raise FieldError(f"{at}.input_schema", "required, a JSON schema object")
    if tool.get("input_examples"):  # they would be in the prompt Anthropic's models see
        raise FieldError(f"{at}.input_examples", "not served: describe the input in the description")
    if tool.get("defer_loading"):
        raise FieldError(f"{at}.defer_loading", "not served: every tool is loaded")
    function: dict[str, Any] = {"name": string_field(tool, "name", at), "parameters": schema}
    for key in ("description", "strict"):
        if (value := tool.get(key)) is not None:
            function[key] = value
    return {"type": "function", "function": function}


def _tool_choice(choice: dict[str, Any]) -> dict[str, Any]:
    kind = choice.get("type")
    fields: dict[str, Any] = {}
    if kind == "tool":
        fields["tool_choice"] = {
            "type": "function",
            "function": {"name": string_field(choice, "name", "tool_choice")},
        }
    elif kind in TOOL_CHOICES:
        fields["tool_choice"] = TOOL_CHOICES[kind]
    else:
        raise FieldError("tool_choice.type", f"must be auto, any, tool or none, got {str(kind)[:32]!r}")
    if choice.get("disable_parallel_tool_use"):
        fields["parallel_tool_calls"] = False
    return fields


class MessageFieldNames(FieldNames):
    """Where each chat message (and each call of one) came from in the Messages body."""

    RENAMES = (
        (re.compile(r"^max_completion_tokens"), "max_tokens"),
        (re.compile(r"^stop(?=$|[.\[])"), "stop_sequences"),
        (re.compile(r"^tools\[(\d+)\]\.function\.parameters"), r"tools[\1].input_schema"),
        (re.compile(r"^tools\[(\d+)\]\.function"), r"tools[\1]"),
        (re.compile(r"^tool_choice\.function\.name"), "tool_choice.name"),
        (re.compile(r"^response_format\.json_schema\.schema"), "output_config.format.schema"),
        (re.compile(r"^response_format"), "output_config.format"),
        (re.compile(r"^parallel_tool_calls"), "tool_choice.disable_parallel_tool_use"),
    )


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


# ---- the Message -----------------------------------------------------------------------------


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, _reasoning: int = 0
) -> dict[str, int]:
    """Anthropic's usage: the prompt's tokens found in the prefix cache are `cache_read_input_tokens`,
    the others `input_tokens` (nothing is written to a cache on request)."""
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached_tokens,
        "output_tokens": completion_tokens,
    }


def stop(
    finish: FinishReason | None, stop_reason: str | int | None, short: bool = False
) -> tuple[str | None, str | None]:
    """Anthropic's `stop_reason` and `stop_sequence` for how the completion finished; `short`: it
    made fewer tokens than `max_tokens` asked for (the context was full first)."""
    if finish == FinishReason.LENGTH:
        return ("model_context_window_exceeded" if short else "max_tokens"), None
    if finish == FinishReason.TOOL_CALLS:
        return "tool_use", None
    if finish == FinishReason.STOP:
        return ("stop_sequence", stop_reason) if isinstance(stop_reason, str) else ("end_turn", None)
    return None, None


@dataclass
class OpenBlock:
    index: int
    kind: str  # "thinking", "text" or "tool_use"


class MessageShape:
    """One message's content, whole or as the Messages API's stream events. Tool calls come after
    the text, as the chat path parses them out of the model's output."""

    def __init__(self, rid: str, model: str, max_tokens: int) -> None:
        """`max_tokens`: the body's (a cap: admitted with at most what the context leaves)."""
        self.rid, self.model, self.max_tokens = rid, model, max_tokens
        self._blocks = 0
        self._open: OpenBlock | None = None
        self._calls: dict[int, OpenBlock] = {}  # a call's index in the reply -> its block

    def message(
        self,
        content: list[dict[str, Any]],
        stop_reason: str | None,
        sequence: str | None,
        counts: dict[str, int],
    ) -> dict[str, Any]:
        return {
            "id": self.rid,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": sequence,
            "usage": counts,
        }

    # ---- whole ----

    def whole(
        self,
        text: str,
        calls: Sequence[tuple[str, str, str]],
        finish: FinishReason | None,
        stop_reason: str | int | None,
        counts: Counts,
        thinking: str = "",
    ) -> dict[str, Any]:
        """The whole message; `calls`: (call id, name, arguments) of each call made; `thinking`:
        a reasoning model's, a thinking block before the rest."""
        content: list[dict[str, Any]] = [_thinking(thinking)] if thinking else []
        if text:
            content.append({"type": "text", "text": text})
        for call_id, name, arguments in calls:
            content.append(_tool_use(call_id, name, arguments))
        short = counts[1] < self.max_tokens
        return self.message(content, *stop(finish, stop_reason, short), usage(*counts))

    # ---- streamed ----

    def started(self, prompt_tokens: int, cached_tokens: int) -> list[dict[str, Any]]:
        message = self.message([], None, None, usage(prompt_tokens, 0, cached_tokens))
        return [{"type": "message_start", "message": message}]

    def thinking(self, delta: str) -> list[dict[str, Any]]:
        """A piece of the thinking: in a thinking block, before the answer's."""
        return self._piece("thinking", delta)

    def text(self, delta: str) -> list[dict[str, Any]]:
        return self._piece("text", delta)

    def _piece(self, kind: Literal["thinking", "text"], delta: str) -> list[dict[str, Any]]:
        """A piece of a `kind` block's text: the open one's, or a new one's."""
        if not delta:
            return []
        events = []
        if self._open is None or self._open.kind != kind:
            events += self._close()
            events += self._start(kind, _thinking("") if kind == "thinking" else {"type": "text", "text": ""})
        assert self._open is not None
        events.append(_delta(self._open.index, {"type": f"{kind}_delta", kind: delta}))
        return events

    def calls(self, deltas: Sequence[CallDelta]) -> list[dict[str, Any]]:
        events = []
        for delta in deltas:
            block = self._calls.get(delta.index)
            if block is None:
                events += self._close()
                start = {"type": "tool_use", "id": delta.id, "name": delta.name, "input": {}}
                events += self._start("tool_use", start)
                assert self._open is not None
                block = self._calls[delta.index] = self._open
            if delta.arguments:
                events.append(
                    _delta(block.index, {"type": "input_json_delta", "partial_json": delta.arguments})
                )
        return events

    def finished(
        self, finish: FinishReason | None, stop_reason: str | int | None, counts: Counts
    ) -> list[dict[str, Any]]:
        reason, sequence = stop(finish, stop_reason, counts[1] < self.max_tokens)
        end = usage(*counts)
        return [
            *self._close(),
            {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": end,
            },
            {"type": "message_stop"},
        ]

    def _start(self, kind: str, block: dict[str, Any]) -> list[dict[str, Any]]:
        self._open = OpenBlock(self._blocks, kind)
        self._blocks += 1
        return [{"type": "content_block_start", "index": self._open.index, "content_block": block}]

    def _close(self) -> list[dict[str, Any]]:
        """The open block's end; a thinking block's signature first (none is made here: "")."""
        block, self._open = self._open, None
        if block is None:
            return []
        stop = {"type": "content_block_stop", "index": block.index}
        if block.kind == "thinking":
            return [_delta(block.index, {"type": "signature_delta", "signature": ""}), stop]
        return [stop]


def _thinking(text: str) -> dict[str, Any]:
    """A thinking block; its signature is empty: none is made here, and none is checked when a
    turn gives its thinking back."""
    return {"type": "thinking", "thinking": text, "signature": ""}


def _delta(index: int, delta: dict[str, Any]) -> dict[str, Any]:
    return {"type": "content_block_delta", "index": index, "delta": delta}


def _tool_use(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """A call as a `tool_use` block; arguments that are not a JSON object (a call cut short by
    max_tokens) are kept whole under `_arguments`, not dropped."""
    try:
        parsed = json.loads(arguments) if arguments else {}
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        parsed = {"_arguments": arguments}
    return {"type": "tool_use", "id": call_id, "name": name, "input": parsed}


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"
