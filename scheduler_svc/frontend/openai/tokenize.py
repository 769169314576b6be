"""/tokenize and /detokenize, with vLLM's request and response shapes.

/tokenize takes a `prompt` (text) or chat `messages` (rendered with the model's chat template,
as a chat completion's prompt is), and answers the ids, their count and the model's context
length (`max_model_len`), with each id's text when `return_token_strs`. /detokenize takes
`tokens` and answers the text they decode to (`prompt`).
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BaseModel, Field, model_validator

from scheduler_svc.frontend.openai.protocol import (
    STRICT,
    ChatMessageIn,
    FieldError,
    TokenId,
    ToolDef,
    chat_input,
    prefill,
)
from stepahead.v1 import generation_pb2 as pb

MAX_DETOKENIZE_IDS = 1 << 20  # a body of ids is bounded by --max-request-bytes first

# The gRPC request's field names in an error, as this body names them.
FIELDS = (
    (re.compile(r"^input\.text"), "prompt"),
    (re.compile(r"^input\.messages\.messages"), "messages"),
    (re.compile(r"^input\.messages\.tools"), "tools"),
    (re.compile(r"^input\.messages\.template_kwargs"), "chat_template_kwargs"),
    (re.compile(r"^input\.messages\.(add_generation_prompt|continue_final_message)"), r"\1"),
    (re.compile(r"^input\.messages"), "messages"),
    (re.compile(r"^input"), "prompt"),
)


class TokenizeRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    tools: list[ToolDef] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False

    @model_validator(mode="before")
    @classmethod
    def _one_input(cls, data: Any) -> Any:
        if isinstance(data, dict) and ("prompt" in data) == ("messages" in data):
            raise ValueError("send either prompt or messages")
        return data

    def to_proto(self) -> pb.GenerateRequest:
        if self.messages is None:
            assert self.prompt is not None
            return pb.GenerateRequest(text=self.prompt)
        if self.add_special_tokens:
            raise FieldError("add_special_tokens", "true is not served with messages: the template adds them")
        request = pb.GenerateRequest()
        chat_input(request.messages, self.messages, self.tools, self.chat_template_kwargs)
        prefill(request.messages, self.add_generation_prompt, self.continue_final_message)
        return request


class DetokenizeRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    tokens: Annotated[list[TokenId], Field(max_length=MAX_DETOKENIZE_IDS)]


def http_field(field: str) -> str:
    for pattern, name in FIELDS:
        if pattern.match(field):
            return pattern.sub(name, field, count=1)
    return field
