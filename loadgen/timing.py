"""What one request's stream told us while it ran, whatever the backend, frozen into a record."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from loadgen.records import RequestRecord
from loadgen.workload import PromptSpec

Clock = Callable[[], float]
CANCELLED = "CANCELLED"


@dataclass
class RequestTiming:
    """Filled in while a request runs; `record` freezes it, as cancelled if it has not closed."""

    index: int
    spec: PromptSpec
    send_time: float | None = None
    end_time: float | None = None
    closed: bool = False
    message_times: list[float] = field(default_factory=list)
    message_tokens: list[int] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int | None = None  # the server's own count, where it gives one
    finish_reason: str | None = None
    error: str | None = None
    error_detail: str = ""

    def sent(self, now: float) -> None:
        self.send_time = now

    def heard(self, now: float) -> None:
        """A message arrived, with or without tokens."""
        self.end_time = now

    def arrived(self, now: float, tokens: int) -> None:
        """A message carrying `tokens` tokens arrived."""
        self.end_time = now
        self.message_times.append(now)
        self.message_tokens.append(tokens)

    def ended(self, now: float) -> None:
        """The stream closed normally; the request ended at its last message, if it had one."""
        self.closed = True
        if self.end_time is None:
            self.end_time = now

    def failed(self, now: float, status: str, detail: str) -> None:
        self.closed = True
        self.end_time, self.error, self.error_detail = now, status, detail

    def record(self, now: float) -> RequestRecord:
        if not self.closed:
            self.failed(now, CANCELLED, "stopped by the client")
        return RequestRecord(
            index=self.index,
            input_len=self.spec.known_input_len if self.prompt_tokens is None else self.prompt_tokens,
            send_time=now if self.send_time is None else self.send_time,
            end_time=now if self.end_time is None else self.end_time,
            message_times=tuple(self.message_times),
            message_tokens=tuple(self.message_tokens),
            output_tokens=self.output_tokens,
            finish_reason=self.finish_reason,
            error=self.error,
            error_detail=self.error_detail,
        )
