"""What the benchmark runner needs of an API it drives: connect, send one request, close."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

from loadgen.timing import Clock, RequestTiming

BackendName = Literal["grpc", "openai", "openai-chat"]
BACKENDS: tuple[BackendName, ...] = ("grpc", "openai", "openai-chat")


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
class Sampling:
    temperature: float
    ignore_eos: bool
    features: SamplingFeatures = field(default_factory=SamplingFeatures)


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
