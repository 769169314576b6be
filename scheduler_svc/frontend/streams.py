"""A client's view of one request in a frontend: its completions' text state and output
streams. A request asks for `n` completions of its prompt; each is a `ClientRequest` of its
own in the core, and their streams wake the one reader of the call (`Completions`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from scheduler_svc.contract import FinishReason, SamplingParams, TokenLogprob
from scheduler_svc.frontend.reasoning import ReasoningSplit
from scheduler_svc.frontend.text import RequestText
from scheduler_svc.frontend.tools import CallDelta, CallStream


@dataclass
class OutputChunk:
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    completion_tokens: int
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, when asked
    tool_calls: list[CallDelta] = field(default_factory=list)  # the calls' pieces, in order
    # With sampling.prompt_logprobs, in the chunk of the first token: one per prompt token
    # after the first.
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    # With a STOP finish: the stop string or stop token id that ended the text (vLLM's
    # stop_reason); None for an EOS token, a grammar's end and every other finish.
    stop_reason: str | int | None = None
    # With separate_reasoning, of a reasoning model: the thinking new since the last chunk
    # (never in `text`), and of completion_tokens, the thinking's so far.
    reasoning: str = ""
    reasoning_tokens: int = 0


class OutputStream:
    """Tokens not yet sent to the client, coalesced while the client lags.

    `interval` (--stream-interval): the stream is due to wake its reader (`ready`, shared by the
    completions of one request) once that many tokens are pending (its frontend's pacer wakes
    it, at once or a few steps later), and wakes it at the finish.
    """

    def __init__(self, interval: int = 1, ready: asyncio.Event | None = None) -> None:
        self._ids: list[int] = []
        self._text: list[str] = []
        self._reasoning: list[str] = []
        self._logprobs: list[TokenLogprob] = []
        self._calls: list[CallDelta] = []
        self._prompt_logprobs: tuple[TokenLogprob, ...] | None = None
        self._finish: FinishReason | None = None
        self._stop_reason: str | int | None = None
        self._decoded = 0  # of _ids, those with their text made: the rest get it at the next take
        self._decode: Callable[[list[int]], str] | None = None
        self._sent = 0
        self._interval = interval
        self.reasoning_tokens = 0  # of the tokens put, those of the thinking (its tags included)
        self.done = False  # the finish has been taken
        self.error: tuple[grpc.StatusCode, str] | None = None
        self.ready = ready or asyncio.Event()

    @property
    def decodes_later(self) -> bool:
        return self._decode is not None

    @property
    def due(self) -> bool:
        """A message's worth of tokens is pending (the finish and a failure wake it themselves)."""
        return len(self._ids) >= self._interval

    @property
    def has_news(self) -> bool:
        return not self.done and bool(
            self._ids or self._text or self._reasoning or self._calls or self._finish is not None
        )

    def put(self, token_id: int, text: str, logprob: TokenLogprob | None = None) -> bool:
        """Whether the stream is due a wake (its reader is the pacer's to wake, `StreamPacer`).
        Its text is `text`, after that of the tokens put with `put_id` (`catch_up` first)."""
        self._ids.append(token_id)
        self._decoded = len(self._ids)
        if logprob is not None:
            self._logprobs.append(logprob)
        if text:
            self._text.append(text)
        return self.due

    def decode_later(self, decode: Callable[[list[int]], str]) -> None:
        """Tokens put with `put_id` get their text from `decode`, all of a message's at once, when
        the message is taken (or `catch_up` is called): a request whose text nothing reads as it
        comes (no stop strings, no tool calls) is detokenized once a message, not once a token."""
        self._decode = decode

    def put_id(self, token_id: int, logprob: TokenLogprob | None = None) -> bool:
        """`put`, the text to come (`decode_later`)."""
        ids = self._ids
        ids.append(token_id)
        if logprob is not None:
            self._logprobs.append(logprob)
        return len(ids) >= self._interval

    def catch_up(self) -> None:
        """The text of the tokens put with `put_id` so far."""
        if len(self._ids) > self._decoded and self._decode is not None:
            text = self._decode(self._ids[self._decoded :])
            if text:
                self._text.append(text)
        self._decoded = len(self._ids)

    def put_text(self, text: str) -> None:
        if text:
            self._text.append(text)

    def put_reasoning(self, text: str) -> None:
        if text:
            self._reasoning.append(text)

    def put_calls(self, deltas: list[CallDelta]) -> None:
        self._calls += deltas

    def put_prompt_logprobs(self, prompt: tuple[TokenLogprob, ...]) -> None:
        """The prompt's log-probabilities: they go with the next message (the first token's)."""
        self._prompt_logprobs = prompt

    def close(self, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        self._finish, self._stop_reason = reason, stop_reason
        self.ready.set()

    def fail(self, code: grpc.StatusCode, message: str) -> None:
        self.error = (code, message)
        self.ready.set()

    def take(self) -> OutputChunk:
        """Everything pending, as one message."""
        self.catch_up()
        self.ready.clear()
        self._sent += len(self._ids)
        text = "".join(self._text)
        chunk = OutputChunk(
            self._ids,
            text,
            self._finish,
            self._sent,
            self._logprobs,
            self._calls,
            self._prompt_logprobs,
            self._stop_reason if self._finish is not None else None,
            "".join(self._reasoning),
            self.reasoning_tokens,
        )
        self._ids, self._text, self._reasoning, self._logprobs, self._calls = [], [], [], [], []
        self._prompt_logprobs = None
        self._decoded = 0
        self.done = self._finish is not None
        return chunk


@dataclass(eq=False)
class ClientRequest:
    """One completion; `handle` names it on the link to the core."""

    handle: int
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    text: RequestText
    stream: OutputStream
    index: int = 0
    arrival_time: float = field(default_factory=time.time)
    last_token_time: float | None = None
    finish_reason: FinishReason | None = None
    num_generated: int = 0
    cached_tokens: int = 0  # prompt tokens its admission found in the prefix cache
    calls: CallStream | None = None  # with tools: its text split into content and calls
    reasoning: ReasoningSplit | None = None  # of a reasoning model: its thinking apart from its text

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.stream.error is not None


@dataclass(eq=False)
class Completions:
    """The `n` completions of one client request, read by one reader: wait for `ready`, then
    `take()` what is new. The call fails as a whole when any completion fails (`error`)."""

    rid: str
    prompt_ids: list[int]
    ready: asyncio.Event
    clients: list[ClientRequest] = field(default_factory=list)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens found in the prefix cache, as the first completion's admission found them."""
        return self.clients[0].cached_tokens

    @property
    def error(self) -> tuple[grpc.StatusCode, str] | None:
        return next((c.stream.error for c in self.clients if c.stream.error is not None), None)

    @property
    def done(self) -> bool:
        """Every completion's finish has been taken."""
        return all(c.stream.done for c in self.clients)

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.clients)

    def take(self) -> list[tuple[int, OutputChunk]]:
        """(index, chunk) of every completion with news, in index order."""
        self.ready.clear()
        return [(c.index, c.stream.take()) for c in self.clients if c.stream.has_news]


@dataclass(eq=False)
class PromptGroup:
    """Several prompts' completions read as one (an HTTP completion with a list of prompts):
    completion j of prompt i is choice i x n + j, every part shares one `ready` event, the usage
    is the parts' summed, and the call fails as a whole when any part fails."""

    parts: list[Completions]
    ready: asyncio.Event

    @property
    def clients(self) -> list[ClientRequest]:
        return [c for part in self.parts for c in part.clients]

    @property
    def prompt_tokens(self) -> int:
        return sum(part.prompt_tokens for part in self.parts)

    @property
    def cached_tokens(self) -> int:
        return sum(part.cached_tokens for part in self.parts)

    @property
    def error(self) -> tuple[grpc.StatusCode, str] | None:
        return next((part.error for part in self.parts if part.error is not None), None)

    @property
    def done(self) -> bool:
        return all(part.done for part in self.parts)

    def take(self) -> list[tuple[int, OutputChunk]]:
        self.ready.clear()
        taken, base = [], 0
        for part in self.parts:
            taken += [(base + index, chunk) for index, chunk in part.take()]
            base += len(part.clients)
        return taken
