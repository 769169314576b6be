"""How much an HTTP client may hold of a frontend: the limits a connection and a request body
are held to (enforced in `http_limits` and `openai_api`). No HTTP import here: the scheduler
parses its flags without loading the HTTP stack."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HttpLimits:
    max_head_bytes: int = 32 * 1024  # request line and headers together: 431 beyond
    max_headers: int = 100  # header fields: 431 beyond
    # From the connection (or the end of the last response) to a whole request head: 408 beyond
    # (slowloris); an idle kept-alive connection is closed.
    head_timeout_s: float = 10.0
    body_pause_timeout_s: float = 30.0  # a request body that sends nothing this long: 408
