"""A client's view of one request in a frontend: its text state and its output stream."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc

from scheduler_svc.request import FinishReason, SamplingParams
from scheduler_svc.text import RequestText


@dataclass
class OutputChunk:
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    completion_tokens: int


class OutputStream:
    """Tokens not yet sent to the client, coalesced while the client lags.

    `interval` (--stream-interval): the stream wakes its reader once that many tokens
    are pending, or at the finish.
    """

    def __init__(self, interval: int = 1) -> None:
        self._ids: list[int] = []
        self._text: list[str] = []
        self._finish: FinishReason | None = None
        self._sent = 0
        self._interval = interval
        self.error: tuple[grpc.StatusCode, str] | None = None
        self.ready = asyncio.Event()

    def put(self, token_id: int, text: str) -> None:
        self._ids.append(token_id)
        if text:
            self._text.append(text)
        if len(self._ids) >= self._interval:
            self.ready.set()

    def put_text(self, text: str) -> None:
        if text:
            self._text.append(text)

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
class ClientRequest:
    """`handle` names the request on the link to the core."""

    handle: int
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    text: RequestText
    stream: OutputStream
    arrival_time: float = field(default_factory=time.time)
    last_token_time: float | None = None
    finish_reason: FinishReason | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.stream.error is not None
