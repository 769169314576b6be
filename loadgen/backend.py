"""What the benchmark runner needs of an API it drives: connect, send one request, close."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal, Protocol

from loadgen.timing import Clock, RequestTiming

GrpcBackendName = Literal["grpc", "grpc-many"]
BackendName = Literal[GrpcBackendName, "openai", "openai-chat"]
BACKENDS: tuple[BackendName, ...] = ("grpc", "grpc-many", "openai", "openai-chat")
GRPC_BACKENDS: tuple[GrpcBackendName, ...] = ("grpc", "grpc-many")
# What a constrained request's output is held to unless --json-schema gives a schema: small, so
# that a model fills it in a few dozen tokens.
SMALL_SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }
)
SCHEMA_NAME = "loadgen"  # response_format.json_schema.name, which OpenAI requires


class BackendError(RuntimeError):
    """The backend cannot start the run (the server cannot say which model it serves, ...)."""


@dataclass(frozen=True)
class SamplingFeatures:
    """What every request asks for beyond temperature (each left at its "off" value by default),
    named as vllm's `bench serve` names them."""

    top_p: float | None = None
    top_k: int = 0
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    logprobs: int | None = None  # None: none; N: the sampled token's and N alternatives
    logit_bias: dict[int, float] = field(default_factory=dict)

    def openai_fields(self, chat: bool) -> dict[str, object]:
        """The OpenAI body fields that are not at their "off" values."""
        candidates: list[tuple[str, object, object]] = [
            ("top_p", self.top_p, None),
            ("top_k", self.top_k, 0),
            ("repetition_penalty", self.repetition_penalty, None),
            ("presence_penalty", self.presence_penalty, 0.0),
            ("frequency_penalty", self.frequency_penalty, 0.0),
            ("min_tokens", self.min_tokens, 0),
            ("logit_bias", {str(token): bias for token, bias in self.logit_bias.items()}, {}),
        ]
        fields = {name: value for name, value, off in candidates if value != off}
        if self.logprobs is not None:
            logprobs = (
                {"logprobs": True, "top_logprobs": self.logprobs} if chat else {"logprobs": self.logprobs}
            )
            fields.update(logprobs)
        return fields


@dataclass(frozen=True)
class Constrained:
    """Which requests ask for structured output, held to the JSON Schema `schema`: a `fraction` of
    them, spread evenly over the indices (request i is when floor((i + 1) f) > floor(i f)), so
    that request i is constrained or not whatever the load."""

    fraction: float = 0.0
    schema: str = SMALL_SCHEMA

    def __post_init__(self) -> None:
        if not (math.isfinite(self.fraction) and 0 <= self.fraction <= 1):
            raise ValueError(f"constrained fraction must be in [0, 1], got {self.fraction}")
        try:
            parsed = json.loads(self.schema)
        except ValueError as exc:
            raise ValueError(f"the JSON Schema is not valid JSON: {exc}") from None
        if not isinstance(parsed, dict):
            raise ValueError("a JSON Schema is a JSON object")

    def applies(self, index: int) -> bool:
        return math.floor((index + 1) * self.fraction) > math.floor(index * self.fraction)

    @cached_property
    def response_format(self) -> dict[str, Any]:
        """OpenAI's `response_format` for a constrained request."""
        schema = {"name": SCHEMA_NAME, "schema": json.loads(self.schema)}
        return {"type": "json_schema", "json_schema": schema}


@dataclass(frozen=True)
class Sampling:
    temperature: float
    ignore_eos: bool
    features: SamplingFeatures = field(default_factory=SamplingFeatures)
    constrained: Constrained = field(default_factory=Constrained)


class Backend(Protocol):
    @property
    def model(self) -> str | None:
        """The model the requests name; None for an API that names none."""
        ...

    async def connect(self) -> None:
        """Before the first request; raises BackendError when the run cannot go on."""
        ...

    async def send(self, timing: RequestTiming, clock: Clock) -> None:
        """Runs one request to its end, recording into `timing`; a failure is recorded, never raised."""
        ...

    async def close(self) -> None: ...
