"""OpenAI's streaming completions on the wire, without I/O: request bodies, server-sent events,
stream chunks and error bodies."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from loadgen.backend import Sampling
from loadgen.workload import PromptSpec

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
MODELS_PATH = "/v1/models"
DONE = "[DONE]"
DETAIL_CHARS = 200  # of a non-JSON error body


class StreamError(ValueError):
    """A stream that does not follow the format."""


def completion_body(spec: PromptSpec, model: str, sampling: Sampling, index: int = 0) -> dict[str, object]:
    """Request `index` of the run. A token-id prompt goes as a list of ids, which /v1/completions
    accepts as well as text."""
    prompt = spec.prompt if isinstance(spec.prompt, str) else list(spec.prompt)
    body = {"model": model, "prompt": prompt, "max_tokens": spec.output_len, **_common(sampling, index)}
    return {**body, **sampling.features.openai_fields(chat=False)}


def chat_body(spec: PromptSpec, model: str, sampling: Sampling, index: int = 0) -> dict[str, object]:
    if not isinstance(spec.prompt, str):
        raise ValueError("a chat message must be text, not token ids")
    messages = [{"role": "user", "content": spec.prompt}]
    return {
        "model": model,
        "messages": messages,
        "max_completion_tokens": spec.output_len,
        **_common(sampling, index),
        **sampling.features.openai_fields(chat=True),
    }


def _common(sampling: Sampling, index: int) -> dict[str, object]:
    common: dict[str, object] = {
        "temperature": sampling.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": sampling.ignore_eos,
    }
    if sampling.constrained.applies(index):
        common["response_format"] = sampling.constrained.response_format
    return common


class SseDecoder:
    """Server-sent events from the bytes of a stream as they come: `feed` returns the data of
    every event completed so far (its `data:` lines joined by newlines); other fields and
    comments are skipped."""

    def __init__(self) -> None:
        self.pending = b""
        self.data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        *lines, self.pending = (self.pending + chunk).split(b"\n")
        return [event for line in lines if (event := self._line(line.removesuffix(b"\r"))) is not None]

    def finish(self) -> list[str]:
        """At the end of the stream: an event the server did not close with a blank line."""
        events = self.feed(b"\n\n") if self.pending or self.data else []
        self.pending = b""
        return events

    def _line(self, line: bytes) -> str | None:
        if not line:
            return self._dispatch()
        name, _, value = line.decode("utf-8", errors="replace").partition(":")
        if name == "data":
            self.data.append(value.removeprefix(" "))
        return None

    def _dispatch(self) -> str | None:
        if not self.data:
            return None
        event, self.data = "\n".join(self.data), []
        return event


@dataclass(frozen=True)
class OpenAIError:
    message: str
    type: str | None = None
    param: str | None = None
    code: str | int | None = None


@dataclass(frozen=True)
class StreamChunk:
    text: str = ""  # choices[0].text, or choices[0].delta.content for chat
    finish_reason: str | None = None
    prompt_tokens: int | None = None  # from the usage, where the chunk carries one
    completion_tokens: int | None = None
    error: OpenAIError | None = None  # an error reported inside the stream


def parse_chunk(payload: str, chat: bool) -> StreamChunk:
    """One event's data, other than [DONE]; raises StreamError if it is not a JSON object."""
    data = _json_object(payload)
    if data is None:
        raise StreamError(f"not a JSON object: {payload[:DETAIL_CHARS]!r}")
    error = error_of(data)
    if error is not None:
        return StreamChunk(error=error)
    choice = _first_choice(data)
    usage = _dict(data.get("usage"))
    return StreamChunk(
        text=_choice_text(choice, chat),
        finish_reason=_str(choice.get("finish_reason")),
        prompt_tokens=_int(usage.get("prompt_tokens")),
        completion_tokens=_int(usage.get("completion_tokens")),
    )


def _first_choice(data: dict[str, Any]) -> dict[str, Any]:
    choices = data.get("choices")
    return _dict(choices[0]) if isinstance(choices, list) and choices else {}


def _choice_text(choice: dict[str, Any], chat: bool) -> str:
    text = _dict(choice.get("delta")).get("content") if chat else choice.get("text")
    return text if isinstance(text, str) else ""


def error_of(data: dict[str, Any]) -> OpenAIError | None:
    """{"error": {"message", "type", "param", "code"}}, or the same fields at the top level
    with "object": "error" as some servers send them."""
    body = _dict(data.get("error")) or (data if data.get("object") == "error" else {})
    if not body:
        return None
    code = body.get("code")
    return OpenAIError(
        message=str(body.get("message", "")),
        type=_str(body.get("type")),
        param=_str(body.get("param")),
        code=code if isinstance(code, str | int) and not isinstance(code, bool) else None,
    )


def http_failure(status: int, body: bytes) -> tuple[str, str]:
    """The status and detail of a refused request: "HTTP 429" and the error's message, or the
    start of the body when it is not an OpenAI error."""
    data = _json_object(body.decode("utf-8", errors="replace"))
    error = None if data is None else error_of(data)
    if error is not None and error.message:
        return f"HTTP {status}", error.message
    return f"HTTP {status}", body.decode("utf-8", errors="replace").strip()[:DETAIL_CHARS]


def first_model_id(body: bytes) -> str | None:
    """The first model of a /v1/models answer: {"data": [{"id": ...}, ...]}."""
    data = _json_object(body.decode("utf-8", errors="replace")) or {}
    models = data.get("data")
    first = _dict(models[0]) if isinstance(models, list) and models else {}
    return _str(first.get("id")) or None


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None


def _dict(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _str(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
