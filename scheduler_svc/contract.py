"""What the engine core and the frontends exchange, and nothing else: a request as the core
gets it (`CoreRequestSpec`, `SamplingParams`), what comes back each step (`StepOutputs`,
`TokenLogprob`, `FinishReason`), and how each side sees the other (`CoreClient`,
`FrontendLink`). The engine and the frontends both import this module; neither imports the
other. The bounds on sampling parameters are here because both sides hold to them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Literal, Protocol

from stepahead.protocol import Constraint, WorkerInfo
from stepahead.v1 import generation_pb2

# How the engine core runs its steps: overlap (launch k+1, then process k) or serial. The frontends
# label their metrics with it.
Mode = Literal["overlap", "serial"]
DEFAULT_MODE: Mode = "overlap"


class FinishReason(enum.IntEnum):
    """Values match stepahead.v1.FinishReason."""

    LENGTH = 1
    STOP = 2
    ABORT = 3
    TOOL_CALLS = 4  # a frontend's: a reply that made tool calls and ended (STOP in the core)


MAX_COMPLETIONS = 16  # `n`: completions of one prompt in one call
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries, as OpenAI bounds it
# A positive temperature below this samples at it: logits divided by less overflow float32 (and
# float32, the wire's type, rounds 1e-50 to 0, which would turn a sampled request greedy).
MIN_TEMPERATURE = 1e-2


@dataclass(frozen=True)
class SamplingParams:
    """`stop` strings are matched by the frontend; everything else acts in the core or the worker."""

    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: frozenset[int]
    stop: tuple[str, ...]
    ignore_eos: bool
    logprobs: bool = False
    top_logprobs: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids ascending
    # Structured output (compiled and checked by the frontend); the worker masks each draw with
    # it, and the core ends the request (STOP) once it is finished.
    constraint: Constraint | None = None
    skip_special_tokens: bool = True  # the frontend's: special tokens left out of the text
    include_stop_str: bool = False  # the frontend's: a stop string that ends the text is in it
    min_p: float = 0.0  # 0: off
    # Each prompt token's log-probability (after the first), with this many alternatives: the
    # worker scores the prompt as it computes it (no prefix-cache reuse). None: not asked.
    prompt_logprobs: int | None = None

    @property
    def processes_logits(self) -> bool:
        """Whether the worker must do more than sample: logits processing or log-probabilities."""
        return (
            self.logprobs
            or self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.min_tokens > 0
            or bool(self.logit_bias)
        )

    @property
    def penalized(self) -> bool:
        """Whether the worker's penalties read the request's tokens."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def computes_prompt(self) -> bool:
        """Whether the worker must compute the whole prompt, reusing no cached prefix: its
        penalties' token history is filled from prefill rows, and prompt log-probabilities are
        scored as the prompt is computed."""
        return self.penalized or self.prompt_logprobs is not None

    def stop_finishes(self, num_generated: int) -> bool:
        """EOS, stop tokens and stop strings end the request only after min_tokens tokens (a
        finished grammar ends it whatever min_tokens says: no other token can follow)."""
        return num_generated >= self.min_tokens


NO_TOKEN = -1


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability and the most likely alternatives, most likely first."""

    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass
class StepOutputs:
    """Entry i: request `handles[i]` got token `token_ids[i]` (NO_TOKEN: none) and, when
    `finish_reasons[i]` is not 0, ended for that reason. `errors` end requests with a
    status instead: (handle, gRPC status name, message). Entries `logprob_entries[j]` carry
    `logprobs[j]` (only requests that asked for them)."""

    handles: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reasons: list[int] = field(default_factory=list)
    errors: list[tuple[int, str, str]] = field(default_factory=list)
    logprob_entries: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    cached_entries: list[int] = field(default_factory=list)  # entries of first tokens, with
    cached_tokens: list[int] = field(default_factory=list)  # the prompt tokens found cached
    # Entries of first tokens whose request asked for its prompt's log-probabilities, with them:
    # one per prompt token after the first, in order.
    prompt_entries: list[int] = field(default_factory=list)
    prompt_logprobs: list[tuple[TokenLogprob, ...]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.handles or self.errors)

    def add(
        self,
        handle: int,
        token: int,
        finish: FinishReason | None,
        logprob: TokenLogprob | None = None,
        cached: int | None = None,
        prompt: tuple[TokenLogprob, ...] | None = None,
    ) -> None:
        self.note(len(self.handles), cached, prompt)
        if logprob is not None:
            self.logprob_entries.append(len(self.handles))
            self.logprobs.append(logprob)
        self.handles.append(handle)
        self.token_ids.append(token)
        self.finish_reasons.append(int(finish or 0))

    def note(self, entry: int, cached: int | None, prompt: tuple[TokenLogprob, ...] | None) -> None:
        """Entry `entry` (the last one, or one being added) carries the prompt tokens found cached
        (None: not a first output token) and the prompt's log-probabilities (None: none), in
        entry order."""
        if cached is not None:
            self.cached_entries.append(entry)
            self.cached_tokens.append(cached)
        if prompt is not None:
            self.prompt_entries.append(entry)
            self.prompt_logprobs.append(prompt)

    def entry_logprobs(self) -> list[TokenLogprob | None]:
        """Per entry: its log-probabilities, or None."""
        per_entry: list[TokenLogprob | None] = [None] * len(self.handles)
        if not self.logprobs:
            return per_entry
        for entry, logprob in zip(self.logprob_entries, self.logprobs, strict=True):
            per_entry[entry] = logprob
        return per_entry


class OutputSink(Protocol):
    """Where a frontend's outputs go: the frontend itself, or the link to its process.
    Sinks are compared by identity (the outbox groups outputs by sink)."""

    def send(self, outputs: StepOutputs) -> None:
        """Must not block the core's loop."""


@dataclass(frozen=True)
class CoreRequestSpec:
    """What the core gets of a request: tokens and token-level parameters."""

    handle: int
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float
    index: int = 0  # which completion of `rid`


class CoreClient(Protocol):
    """The engine core as a frontend sees it."""

    def add(self, spec: CoreRequestSpec) -> None:
        """Queue the request; a refusal comes back as an error output."""

    def abort(self, handle: int) -> None:
        """End one of this frontend's requests in the core (no output follows)."""

    async def abort_request(self, rid: str) -> bool:
        """End a request that any frontend admitted."""

    async def server_info(self) -> generation_pb2.GetServerInfoResponse: ...

    async def exposition(self) -> bytes:
        """The whole service's Prometheus exposition (the core's series and every frontend's)."""


class Intake(Protocol):
    """The frontends' messages to the core, as the core's loop reads them. While a step's result
    is awaited they are held unread (`hold`), and read together when it is back (`release`),
    before the next pick: a request that arrives meanwhile is picked at the same step as if it
    had been read at once, and the core's loop wakes once a step, for the result, not once more
    for each frontend's message (as SGLang's scheduler receives requests once an iteration)."""

    def hold(self) -> None: ...

    def release(self) -> None:
        """Read what was held, its requests added to the core before this returns."""


class FrontendLink(OutputSink, Protocol):
    """A frontend as the core sees it: where its outputs and the worker's state go."""

    def worker_state(self, info: WorkerInfo | None, connected: bool) -> None: ...
