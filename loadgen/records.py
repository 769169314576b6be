"""What the load generator keeps of one request."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestRecord:
    """One measured request; every time is in seconds since the benchmark started.

    `message_times[i]` is the arrival of the i-th response message that carried tokens and
    `message_tokens[i]` how many it carried (several when the client lagged behind the server).
    Messages without tokens (a bare finish) only move `end_time`. `output_tokens` is the
    server's count of generated tokens where it reports one apart from the messages (the
    OpenAI usage chunk); it then is the output length, and `message_tokens` only weight the
    inter-token latencies.
    """

    index: int
    input_len: int
    send_time: float
    end_time: float
    message_times: tuple[float, ...] = ()
    message_tokens: tuple[int, ...] = ()
    output_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None  # gRPC status name or "HTTP 429"-like; None for a completed request
    error_detail: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def output_len(self) -> int:
        return sum(self.message_tokens) if self.output_tokens is None else self.output_tokens
