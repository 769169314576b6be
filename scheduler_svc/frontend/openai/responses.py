"""OpenAI's Responses API (`POST /v1/responses`), served over the chat path: a body is checked
and mapped onto a chat completion's (`ResponsesRequest.to_chat`), which the frontend admits as
any other, and its one completion is shaped as a Response: output items (an assistant message
of `output_text`, then one `function_call` item per tool call), usage in the Responses' names,
and, streamed, the typed server-sent events of the Responses API (`response.created` ...
`response.output_text.delta` ... `response.completed`), each with its `sequence_number`.

Stateless, as vLLM serves it without a store: no response is kept, so `previous_response_id`,
`conversation` and `background` are refused naming the field (send the whole conversation as
`input`); `store` is accepted and answered `false`. What Responses defines and the chat path does
not serve is refused by name too: hosted tools (web search, files, code), image and file inputs,
`truncation: "auto"`, `reasoning.effort`, `max_tool_calls`. The sampling extras vLLM takes (`seed`,
`top_k`, `stop`, `ignore_eos`, ...) pass on to the chat body as they are.

A check of the chat body names a field of the chat API (`messages[2].content`,
`max_completion_tokens`); `ChatFieldNames` renames it to the field of this body that holds it
(`input[1].content`, `max_output_tokens`).
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from scheduler_svc.contract import FinishReason
from scheduler_svc.frontend.openai.protocol import (
    STRICT,
    ChatCompletionRequest,
    Counts,
    FieldError,
    FunctionDef,
    field_path,
)
from scheduler_svc.frontend.openai.renames import FieldNames
from scheduler_svc.frontend.tools import CallDelta

LOGPROBS_INCLUDE = "message.output_text.logprobs"  # the one `include` value served
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on `top_logprobs`
# Extra fields passed on to the chat body as they are: the sampling extras both APIs of vLLM take.
CHAT_EXTRAS = (
    "seed",
    "top_k",
    "min_p",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "chat_template_kwargs",
)
# Responses fields that only a stateful or hosted server serves: refused unless absent (or the value).
NOT_SERVED: dict[str, tuple[object, str]] = {
    "previous_response_id": (None, "this server keeps no responses: send the whole conversation as input"),
    "conversation": (None, "this server keeps no conversations: send the whole conversation as input"),
    "background": (False, "responses are served in the foreground only"),
    "max_tool_calls": (None, "not served: the model makes the calls its tool_choice allows"),
    "prompt": (None, "stored prompt templates are not served: send the instructions and input"),
}
MESSAGE_ROLES = ("user", "system", "developer", "assistant")


class FunctionTool(FunctionDef):
    """A function tool as Responses defines it: chat's function definition, flat, typed."""

    type: Literal["function"]


class FunctionChoice(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = STRICT

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = STRICT

    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the default; other values are not served


class Reasoning(BaseModel):
    model_config = STRICT

    effort: str | None = None  # no effort is steered here: one is refused by name
    summary: str | None = None


class ResponsesRequest(BaseModel):
    """A Responses body: `input` a string or a list of items (messages, function calls and their
    outputs), checked item by item in `to_chat`."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool | None = None  # accepted; nothing is stored (the response says `store: false`)
    truncation: Literal["disabled"] | None = None
    reasoning: Reasoning | None = None
    service_tier: str | None = None  # accepted and ignored, as by vLLM
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    stream_options: dict[str, Any] | None = None  # `include_obfuscation`: nothing to obfuscate

    def check_served(self) -> None:
        extra = self.model_extra or {}
        for name, (served, why) in NOT_SERVED.items():
            if extra.get(name, served) not in (served, None):
                raise FieldError(name, why)
        if self.reasoning is not None and self.reasoning.effort not in (None, "none"):
            raise FieldError("reasoning.effort", "not served: no reasoning effort is steered here")
        for i, name in enumerate(self.include or []):
            if name != LOGPROBS_INCLUDE:
                raise FieldError(f"include[{i}]", f"only {LOGPROBS_INCLUDE!r} is served, got {name[:64]!r}")

    @property
    def logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or [])

    def to_chat(self) -> tuple[ChatCompletionRequest, ChatFieldNames]:
        """The chat completion this body asks for, and how to name the chat body's fields back;
        FieldError naming this body's field where it asks for what is not served."""
        self.check_served()
        names = ChatFieldNames()
        messages: list[dict[str, Any]] = []
        if self.instructions is not None:
            messages.append({"role": "system", "content": self.instructions})
            names.messages.append("instructions")
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
            names.messages.append("input")
        else:
            for i, item in enumerate(self.input):
                _add_item(messages, names, item, f"input[{i}]")
        optional = {
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "parallel_tool_calls": self.parallel_tool_calls,
        }
        body = chat_body(messages, self.stream, self.model_extra, optional)
        if self.tools:
            body["tools"] = [_tool(tool, f"tools[{i}]") for i, tool in enumerate(self.tools)]
        if isinstance(self.tool_choice, FunctionChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        if self.logprobs:
            body["logprobs"] = True
            body["top_logprobs"] = self.top_logprobs or 0
        if (fmt := self.text_format) is not None:
            body["response_format"] = fmt
        return chat_request(body, names), names

    def unknown_fields(self) -> list[str]:
        """Fields of the body no API documents (ignored, as the chat endpoint ignores them)."""
        return [name for name in self.model_extra or {} if name not in CHAT_EXTRAS and name not in NOT_SERVED]

    @property
    def text_format(self) -> dict[str, Any] | None:
        """`text.format` as chat's `response_format`; None: plain text."""
        fmt = None if self.text is None else self.text.format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"type": "json_object"}
        if fmt.name is None:
            raise FieldError("text.format.name", "required when type is 'json_schema'")
        schema: dict[str, Any] = {"name": fmt.name}
        if fmt.schema_ is not None:
            schema["schema"] = fmt.schema_
        return {"type": "json_schema", "json_schema": schema}

    def echoed(self) -> dict[str, Any]:
        """The request's settings, as a Response repeats them."""
        fmt = (
            {"type": "text"}
            if self.text is None or self.text.format is None
            else self.text.format.model_dump(by_alias=True, exclude_none=True)
        )
        choice = self.tool_choice
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "metadata": self.metadata or {},
            "parallel_tool_calls": True if self.parallel_tool_calls is None else self.parallel_tool_calls,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_logprobs": self.top_logprobs or 0,
            "tool_choice": choice.model_dump() if isinstance(choice, FunctionChoice) else choice or "auto",
            "tools": list(self.tools or []),
            "text": {"format": fmt, "verbosity": "medium"},
            "truncation": "disabled",
            "reasoning": {"effort": None, "summary": None},
            "user": self.user,
            "store": False,
            "background": False,
            "previous_response_id": None,
            "max_tool_calls": None,
            "service_tier": "default",
        }


def _add_item(messages: list[dict[str, Any]], names: ChatFieldNames, item: dict[str, Any], at: str) -> None:
    """One input item as chat messages: a message; a function call, joined to the assistant
    turn just before it (a reply's calls are one chat message); a call's output, a tool message;
    a reasoning item (a reply's thinking, as this API returned it), an assistant turn's
    `reasoning_content`, which the message or calls after it join."""
    kind = item.get("type", "message")
    last = messages[-1] if messages else None
    thinking = (
        last is not None
        and last["role"] == "assistant"
        and last["content"] is None
        and "tool_calls" not in last
    )
    if kind == "message":
        role = item.get("role")
        if role not in MESSAGE_ROLES:
            raise FieldError(
                f"{at}.role", f"must be one of {', '.join(MESSAGE_ROLES)}, got {str(role)[:32]!r}"
            )
        content = _text(item.get("content"), f"{at}.content")
        if role == "assistant" and thinking and last is not None:
            last["content"] = content  # the answer its thinking led to
            return
        messages.append({"role": role, "content": content})
        names.messages.append(at)
    elif kind == "reasoning":
        messages.append(
            {"role": "assistant", "content": None, "reasoning_content": _reasoning_text(item, at)}
        )
        names.messages.append(at)
    elif kind == "function_call":
        call = {
            "id": string_field(item, "call_id", at),
            "type": "function",
            "function": {
                "name": string_field(item, "name", at),
                "arguments": string_field(item, "arguments", at),
            },
        }
        if last is not None and last["role"] == "assistant":
            calls = last.setdefault("tool_calls", [])
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": []})
            names.messages.append(at)
            calls = messages[-1]["tool_calls"]
        names.calls[(len(messages) - 1, len(calls))] = at
        calls.append(call)
    elif kind == "function_call_output":
        output = item.get("output")
        content = output if isinstance(output, str) else _text(output, f"{at}.output")
        messages.append(
            {"role": "tool", "tool_call_id": string_field(item, "call_id", at), "content": content}
        )
        names.messages.append(at)
    else:
        raise FieldError(
            f"{at}.type",
            f"not served: {str(kind)[:32]!r} (only message, reasoning, function_call and "
            "function_call_output items)",
        )


def _reasoning_text(item: dict[str, Any], at: str) -> str:
    """A reasoning item's thinking: its `reasoning_text` parts (else its summary's text)."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list):
        raise FieldError(f"{at}.content", "must be a list of reasoning_text parts")
    texts = []
    for j, part in enumerate(parts):
        text = part.get("text") if isinstance(part, dict) else None
        if not isinstance(text, str):
            raise FieldError(f"{at}.content[{j}].text", "required, a string")
        texts.append(text)
    return "".join(texts)


def chat_body(
    messages: list[dict[str, Any]], stream: bool, extra: dict[str, Any] | None, optional: dict[str, Any]
) -> dict[str, Any]:
    """The chat body of a body mapped onto chat: its messages, the stream with its usage, the chat
    extras it passes on (`extra`, its fields beyond its own API's), and the `optional` fields it
    sets (None: not)."""
    body: dict[str, Any] = {"messages": messages, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    extra = extra or {}
    body.update({name: extra[name] for name in CHAT_EXTRAS if name in extra})
    body.update({name: value for name, value in optional.items() if value is not None})
    return body


def chat_request(body: dict[str, Any], names: FieldNames) -> ChatCompletionRequest:
    """`body` checked as a chat completion's; FieldError naming the mapped body's field."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise FieldError(names.rename(field_path(first["loc"])), first["msg"]) from exc


def string_field(item: dict[str, Any], key: str, at: str) -> str:
    """`item[key]`, a string; FieldError naming `at.key` where it is not one."""
    value = item.get(key)
    if not isinstance(value, str):
        raise FieldError(f"{at}.{key}", "required, a string")
    return value


def _text(content: Any, at: str) -> str:
    """A message's content: a string, or text parts (`input_text`, or `output_text` in an
    assistant turn of the history); other parts (images, files, audio) are refused by name."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise FieldError(at, "must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get("text") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(text, str):
            raise FieldError(f"{at}[{j}]", f"only text parts are served, got {str(kind)[:32]!r}")
        texts.append(text)
    return "".join(texts)


def _tool(tool: dict[str, Any], at: str) -> dict[str, Any]:
    kind = tool.get("type")
    if kind != "function":
        raise FieldError(f"{at}.type", f"only function tools are served, got {str(kind)[:32]!r}")
    try:
        function = FunctionTool.model_validate(tool)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise FieldError(f"{at}.{field_path(first['loc'])}", first["msg"]) from exc
    return {"type": "function", "function": function.model_dump(exclude={"type"}, exclude_none=True)}


class ChatFieldNames(FieldNames):
    """Where each chat message (and each call of one) came from in the Responses body."""

    RENAMES = (
        (re.compile(r"^max_completion_tokens"), "max_output_tokens"),
        (re.compile(r"^max_tokens"), "max_output_tokens"),
        (re.compile(r"^response_format\.json_schema\.schema"), "text.format.schema"),
        (re.compile(r"^response_format\.json_schema"), "text.format"),
        (re.compile(r"^response_format"), "text.format"),
        (re.compile(r"^tools\[(\d+)\]\.function"), r"tools[\1]"),
        (re.compile(r"^tool_choice\.function\.name"), "tool_choice.name"),
        (re.compile(r"^logprobs"), "include"),
    )
    MESSAGES = "input"
    MAX_TOKENS = "max_output_tokens"


# ---- the Response ----------------------------------------------------------------------------


def _hex() -> str:
    return uuid.uuid4().hex


@dataclass
class OpenItem:
    """An output item being streamed: the message's text so far, or a call's arguments."""

    index: int  # its output_index
    item: dict[str, Any]
    text: list[str] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)


class ResponseShape:
    """One response's output, whole or as the Responses API's stream events. Calls come after
    the assistant's text, as the chat path parses them out of the model's output."""

    def __init__(self, rid: str, model: str, body: ResponsesRequest) -> None:
        self.rid, self.model = rid, model
        self.created = int(time.time())
        self._settings = body.echoed()
        self._sequence = 0
        self._output: list[dict[str, Any]] = []
        self._open: OpenItem | None = None
        self._calls: dict[int, OpenItem] = {}  # a call's index in the reply -> its item

    def response(
        self,
        status: str,
        usage: dict[str, Any] | None = None,
        incomplete: str | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": error,
            "incomplete_details": None if incomplete is None else {"reason": incomplete},
            "model": self.model,
            "output": list(self._output),
            "usage": usage,
            **self._settings,
        }

    # ---- whole ----

    def whole(
        self,
        text: str,
        logprobs: list[dict[str, Any]],
        calls: Sequence[tuple[str, str, str]],
        finish: FinishReason | None,
        counts: Counts,
        reasoning: str = "",
    ) -> dict[str, Any]:
        """The whole response; `calls`: (call id, name, arguments) of each call made;
        `reasoning`: a reasoning model's thinking, a reasoning item before the rest."""
        status, incomplete = _status(finish)
        if reasoning:
            self._output.append(
                _reasoning(f"rs_{_hex()}", status if not (text or calls) else "completed", reasoning)
            )
        if text or not (calls or reasoning):
            self._output.append(_message(f"msg_{_hex()}", status, text, logprobs))
        for i, (call_id, name, arguments) in enumerate(calls):  # the last may be cut by the length
            self._output.append(
                _function_call(call_id, name, arguments, status if i == len(calls) - 1 else "completed")
            )
        return self.response(status, responses_usage(*counts), incomplete)

    # ---- streamed ----

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self._sequence += 1
        return {"type": kind, "sequence_number": self._sequence - 1, **fields}

    def started(self) -> list[dict[str, Any]]:
        response = self.response("in_progress")
        return [
            self.event("response.created", response=response),
            self.event("response.in_progress", response=response),
        ]

    def text(self, delta: str, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """A piece of the answer's text. Log-probabilities without text (a finishing token's)
        join the message's, as its whole response has them; no delta carries them."""
        if not delta:
            if self._open is not None and self._open.item["type"] == "message":
                self._open.logprobs += logprobs
            return []
        events = []
        if self._open is None or self._open.item["type"] != "message":
            events += self._close()
            events += self._open_message()
        assert self._open is not None
        self._open.text.append(delta)
        self._open.logprobs += logprobs
        where = self._where()
        events.append(self.event("response.output_text.delta", **where, delta=delta, logprobs=logprobs))
        return events

    def reasoning(self, delta: str) -> list[dict[str, Any]]:
        """A piece of the thinking: in a reasoning item, before the answer."""
        if not delta:
            return []
        events = []
        if self._open is None or self._open.item["type"] != "reasoning":
            events += self._close()
            item = {
                "id": f"rs_{_hex()}",
                "type": "reasoning",
                "summary": [],
                "content": [],
                "status": "in_progress",
            }
            self._open = OpenItem(len(self._output), item)
            self._output.append(item)
            events += [
                self.event("response.output_item.added", output_index=self._open.index, item=item),
                self.event("response.content_part.added", **self._where(), part=_reasoning_part("")),
            ]
        assert self._open is not None
        self._open.text.append(delta)
        events.append(self.event("response.reasoning_text.delta", **self._where(), delta=delta))
        return events

    def _open_message(self) -> list[dict[str, Any]]:
        item = {
            "id": f"msg_{_hex()}",
            "type": "message",
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        self._open = OpenItem(len(self._output), item)
        self._output.append(item)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            self.event("response.output_item.added", output_index=self._open.index, item=item),
            self.event("response.content_part.added", **self._where(), part=part),
        ]

    def calls(self, deltas: Sequence[CallDelta]) -> list[dict[str, Any]]:
        events = []
        for delta in deltas:
            open_call = self._calls.get(delta.index)
            if open_call is None:
                events += self._close()
                item = _function_call(delta.id, delta.name, "", "in_progress")
                open_call = self._open = self._calls[delta.index] = OpenItem(len(self._output), item)
                self._output.append(item)
                events.append(
                    self.event("response.output_item.added", output_index=open_call.index, item=item)
                )
            if delta.arguments:
                open_call.text.append(delta.arguments)
                events.append(
                    self.event(
                        "response.function_call_arguments.delta",
                        item_id=open_call.item["id"],
                        output_index=open_call.index,
                        delta=delta.arguments,
                    )
                )
        return events

    def finished(self, finish: FinishReason | None, counts: Counts) -> list[dict[str, Any]]:
        status, incomplete = _status(finish)
        events = [] if self._output else self._open_message()  # an empty answer is an empty message
        events += self._close(status)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
            status, "response.failed"
        )
        error = None if status != "failed" else {"code": "server_error", "message": "the request was aborted"}
        response = self.response(status, responses_usage(*counts), incomplete, error)
        return [*events, self.event(kind, response=response)]

    def failed(self, message: str) -> list[dict[str, Any]]:
        """The stream's end after an error of the engine (its HTTP status is sent already)."""
        error = {"code": "server_error", "message": message}
        return [self.event("response.failed", response=self.response("failed", error=error))]

    def _where(self) -> dict[str, Any]:
        """Where the open message's text goes."""
        assert self._open is not None
        return {**self._where_of(self._open), "content_index": 0}

    def _close(self, status: str = "completed") -> list[dict[str, Any]]:
        """The open item's closing events; it gets its whole text or arguments, and `status`
        (the response's, for the item the answer ends in)."""
        item, self._open = self._open, None
        if item is None:
            return []
        text = "".join(item.text)
        if item.item["type"] == "function_call":
            done = _function_call(item.item["call_id"], item.item["name"], text, status)
            done["id"] = item.item["id"]
            self._output[item.index] = done
            where = {"item_id": done["id"], "output_index": item.index}
            return [
                self.event(
                    "response.function_call_arguments.done", **where, name=done["name"], arguments=text
                ),
                self.event("response.output_item.done", output_index=item.index, item=done),
            ]
        if item.item["type"] == "reasoning":
            done = _reasoning(item.item["id"], status, text)
            self._output[item.index] = done
            where = {**self._where_of(item), "content_index": 0}
            return [
                self.event("response.reasoning_text.done", **where, text=text),
                self.event("response.content_part.done", **where, part=_reasoning_part(text)),
                self.event("response.output_item.done", output_index=item.index, item=done),
            ]
        message = _message(item.item["id"], status, text, item.logprobs)
        self._output[item.index] = message
        where = {**self._where_of(item), "content_index": 0}
        part = message["content"][0]
        return [
            self.event("response.output_text.done", **where, text=text, logprobs=item.logprobs),
            self.event("response.content_part.done", **where, part=part),
            self.event("response.output_item.done", output_index=item.index, item=message),
        ]

    @staticmethod
    def _where_of(item: OpenItem) -> dict[str, Any]:
        return {"item_id": item.item["id"], "output_index": item.index}


def _status(finish: FinishReason | None) -> tuple[str, str | None]:
    """A Response's status (and the reason it is incomplete) for how its completion finished."""
    if finish == FinishReason.LENGTH:
        return "incomplete", "max_output_tokens"
    if finish == FinishReason.ABORT:
        return "failed", None
    return "completed", None


def _message(item_id: str, status: str, text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": [part]}


def _reasoning(item_id: str, status: str, text: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "content": [_reasoning_part(text)],
        "status": status,
    }


def _reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def _function_call(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "id": f"fc_{_hex()}",
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


def responses_usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, reasoning_tokens: int = 0
) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt_tokens + completion_tokens,
    }
