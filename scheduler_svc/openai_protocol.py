"""The OpenAI-compatible HTTP API's bodies: requests as pydantic models, mapped onto a
GenerateRequest so that one set of checks serves both APIs; responses and errors as dicts.

Fields OpenAI defines and Stepahead does not implement are refused with 400 naming them,
never silently ignored. `top_k`, `ignore_eos` and `stop_token_ids` are accepted as
the extra fields vLLM takes.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from scheduler_svc.request import FinishReason
from stepahead.v1 import generation_pb2 as pb

UINT64 = 1 << 64
MAX_OPENAI_STOPS = 4  # OpenAI's own bound on `stop`

FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort"}
# The GenerateRequest fields the checks name, as the HTTP API names them.
HTTP_FIELDS = {
    "input.text": "prompt",
    "input.input_ids.ids": "prompt",
    "input.messages.messages": "messages",
    "input.messages": "messages",
    "input": "prompt",
    "sampling.max_new_tokens": "max_tokens",
    "sampling.stop_token_ids": "stop_token_ids",
    "sampling.stop": "stop",
    "sampling": "",
}


class FieldError(ValueError):
    """A field whose value cannot be served: out of range, or asking for what is not implemented."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """What both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = Field(default=None, ge=-(1 << 63), lt=UINT64)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    top_k: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list)

    def check_supported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "only allowed when stream is true")
        if self.n != 1:
            raise FieldError("n", f"only 1 completion per request is served, got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0:
                raise FieldError(name, "penalties are not supported yet; leave it at 0")
        if self.logit_bias:
            raise FieldError("logit_bias", "not supported yet")

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def sampling(self, max_tokens: int | None, field: str) -> pb.SamplingParams:
        """`max_tokens` None is sent as 0: open-ended, the rest of the context (see `validate_request`)."""
        if max_tokens is not None and max_tokens < 1:
            raise FieldError(field, f"must be at least 1, got {max_tokens}")
        sampling = pb.SamplingParams(
            max_new_tokens=0 if max_tokens is None else min(max_tokens, 0xFFFFFFFF),
            temperature=1.0 if self.temperature is None else self.temperature,
            top_k=self.top_k,
            stop=self.stops(),
            ignore_eos=self.ignore_eos,
        )
        sampling.stop_token_ids.extend(self.stop_token_ids)
        if self.top_p is not None:
            sampling.top_p = self.top_p
        if self.seed is not None:
            sampling.seed = self.seed % UINT64
        return sampling

    @property
    def max_tokens_field(self) -> str:
        """The field the request bounded its answer with (chat has two names for it)."""
        return "max_tokens"

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise FieldError("echo", "not supported")
        if self.logprobs is not None:
            raise FieldError("logprobs", "not supported yet")
        if self.best_of not in (None, 1):
            raise FieldError("best_of", "only 1 is supported")
        if self.suffix:
            raise FieldError("suffix", "not supported")

    def to_proto(self) -> pb.GenerateRequest:
        self.check_supported()
        request = pb.GenerateRequest(sampling=self.sampling(self.max_tokens, "max_tokens"))
        prompt = self._single_prompt()
        if isinstance(prompt, str):
            request.text = prompt
        else:
            request.input_ids.ids.extend(_token_ids(prompt))
        return request

    def _single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
            return prompt  # type: ignore[return-value]
        if len(prompt) != 1:
            raise FieldError("prompt", f"one prompt per request is served, got {len(prompt)}")
        return prompt[0]


class TextPart(BaseModel):
    type: str
    text: str | None = None


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[TextPart] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessageIn]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    @property
    def max_tokens_field(self) -> str:
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs or self.top_logprobs:
            raise FieldError("logprobs", "not supported yet")
        if self.tools:
            raise FieldError("tools", "tool calls are not supported")
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            raise FieldError("response_format", "only type 'text' is supported")

    def to_proto(self) -> pb.GenerateRequest:
        self.check_supported()
        if self.max_completion_tokens is not None:
            sampling = self.sampling(self.max_completion_tokens, "max_completion_tokens")
        else:
            sampling = self.sampling(self.max_tokens, "max_tokens")
        request = pb.GenerateRequest(sampling=sampling)
        request.messages.messages.extend(
            pb.ChatMessage(role=_role(m.role), content=_content(m, i)) for i, m in enumerate(self.messages)
        )
        return request


def _role(role: str) -> str:
    return "system" if role == "developer" else role  # OpenAI's newer name for system


def _content(message: ChatMessageIn, index: int) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    texts = []
    for j, part in enumerate(message.content):
        if part.type != "text" or part.text is None:
            raise FieldError(
                f"messages[{index}].content[{j}]", f"only text parts are served, got {part.type!r}"
            )
        texts.append(part.text)
    return "".join(texts)


def _token_ids(ids: list[int]) -> list[int]:
    for i, token in enumerate(ids):
        if not 0 <= token < (1 << 32):
            raise FieldError(f"prompt[{i}]", f"{token} is not a token id")
    return ids


def http_field(field: str, body: SamplingFields) -> str:
    """The HTTP API's name of a GenerateRequest field path (`sampling.temperature` -> temperature)."""
    for path, name in HTTP_FIELDS.items():
        if field == path or field.startswith(path + "[") or field.startswith(path + "."):
            rest = field[len(path) :]
            if name == "prompt" and isinstance(body, ChatCompletionRequest):
                name = "messages"
            elif name == "max_tokens":
                name = body.max_tokens_field
            return (name + rest).lstrip(".") if name else rest.lstrip(".")
    return field


def http_message(message: str, field: str, body: SamplingFields) -> str:
    """A check's message with its field path renamed for the HTTP API."""
    renamed = http_field(field, body)
    if not message.startswith(field):
        return message
    return (renamed + message[len(field) :]).replace("max_new_tokens", body.max_tokens_field)


# ---- responses -----------------------------------------------------------------------------


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def finish_name(reason: FinishReason | None) -> str | None:
    return None if reason is None else FINISH_REASONS[reason]


class ResponseIds:
    """The id, object names and creation time every body and chunk of one response shares."""

    def __init__(self, rid: str, model: str, endpoint: Literal["completions", "chat"]) -> None:
        self.rid = rid
        self.model = model
        self.chat = endpoint == "chat"
        self.created = int(time.time())

    def head(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.rid, "object": kind, "created": self.created, "model": self.model}

    def choice(self, text: str, finish: FinishReason | None, chunk: bool) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_name(finish)}
        if not self.chat:
            choice["text"] = text
        elif chunk:
            choice["delta"] = {"content": text} if text else {}
        else:
            choice["message"] = {"role": "assistant", "content": text}
        return choice

    def body(self, text: str, finish: FinishReason | None, counts: tuple[int, int]) -> dict[str, Any]:
        return {**self.head(False), "choices": [self.choice(text, finish, False)], "usage": usage(*counts)}

    def chunk(self, text: str, finish: FinishReason | None) -> dict[str, Any]:
        return {**self.head(True), "choices": [self.choice(text, finish, True)]}

    def role_chunk(self) -> dict[str, Any]:
        """A chat stream's first chunk: the assistant's role."""
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
        return {**self.head(True), "choices": [{**choice, "finish_reason": None}]}

    def usage_chunk(self, counts: tuple[int, int]) -> dict[str, Any]:
        return {**self.head(True), "choices": [], "usage": usage(*counts)}
