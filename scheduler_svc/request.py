"""A request's state on the scheduler: tokens, progress, slots, output stream."""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field

import grpc

from scheduler_svc.text import RequestText


class FinishReason(enum.IntEnum):
    """Values match stepahead.v1.FinishReason."""

    LENGTH = 1
    STOP = 2
    ABORT = 3


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: frozenset[int]
    stop: tuple[str, ...]
    ignore_eos: bool


@dataclass
class OutputChunk:
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    completion_tokens: int


class OutputStream:
    """Tokens not yet sent to the client, coalesced while the client lags."""

    def __init__(self) -> None:
        self._ids: list[int] = []
        self._text: list[str] = []
        self._finish: FinishReason | None = None
        self._sent = 0
        self.error: tuple[grpc.StatusCode, str] | None = None
        self.ready = asyncio.Event()

    def put(self, token_id: int, text: str) -> None:
        self._ids.append(token_id)
        if text:
            self._text.append(text)
        self.ready.set()

    def put_text(self, text: str) -> None:
        if text:
            self._text.append(text)
            self.ready.set()

    def close(self, reason: FinishReason) -> None:
        self._finish = reason
        self.ready.set()

    def fail(self, code: grpc.StatusCode, message: str) -> None:
        self.error = (code, message)
        self.ready.set()

    def take(self) -> OutputChunk:
        """Everything pending, as one message."""
        self.ready.clear()
        self._sent += len(self._ids)
        chunk = OutputChunk(self._ids, "".join(self._text), self._finish, self._sent)
        self._ids, self._text = [], []
        return chunk


@dataclass(eq=False)
class Request:
    """NOTE: `output_ids` are the tokens the CPU has processed; up to
    `num_inflight` more are sampled on the device but not seen yet (the last
    one sits in the worker's FutureMap). KV covers `num_computed` tokens."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_seq: int
    text: RequestText
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_inflight: int = 0
    req_slot: int | None = None
    kv_slots: list[int] = field(default_factory=list)
    attempt: int = 0
    finish_reason: FinishReason | None = None
    stream: OutputStream = field(default_factory=OutputStream)
    arrival_time: float = field(default_factory=time.time)
    first_scheduled_time: float | None = None
    last_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_known(self) -> int:
        """Tokens the CPU knows: prompt plus processed output."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.num_known

    def known_ids(self, start: int, end: int) -> list[int]:
        prompt_len = len(self.prompt_ids)
        if end <= prompt_len:
            return self.prompt_ids[start:end]
        return (self.prompt_ids + self.output_ids)[start:end]

    def wants_decode(self) -> bool:
        """Its last token is sampled but not in KV, and more tokens are allowed.

        NOTE: counting in-flight tokens keeps a request whose pending results
        already reach max_new_tokens out of the next batch.
        """
        if self.finished or self.in_prefill:
            return False
        last_token_pending_kv = self.num_computed == self.num_known + self.num_inflight - 1
        return last_token_pending_kv and self.num_generated_or_inflight < self.params.max_new_tokens

    @property
    def num_generated_or_inflight(self) -> int:
        return len(self.output_ids) + self.num_inflight
