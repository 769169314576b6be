"""What every frontend serves clients on, both APIs at once: where, with which TLS and API key,
and the bounds of a request. No HTTP or gRPC import: the command line builds it without them."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_svc.frontend.openai.config import HttpLimits
from scheduler_svc.frontend.validation import DEFAULT_MAX_REQUEST_BYTES
from stepahead.serving import TlsFiles


@dataclass(frozen=True)
class ClientApiConfig:
    """What every frontend serves clients on: the gRPC API, and the HTTP API unless its port is 0."""

    host: str = "127.0.0.1"
    port: int = 50051
    http_port: int = 8000  # 0: no HTTP API
    tls: TlsFiles = field(default_factory=TlsFiles)  # the same on both APIs
    api_key: str | None = None  # None: no key asked
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    served_model_name: str | None = None  # None: the worker's model name
    allowed_hosts: tuple[str, ...] = ()  # Host names the HTTP API answers; (): any
    http_limits: HttpLimits = field(default_factory=HttpLimits)
    # Log-probabilities (each token's own and its alternatives) a whole, unstreamed HTTP response
    # may hold: some 100 bytes of JSON each, so ~26 MB; a stream has no such bound.
    max_whole_logprobs: int = 1 << 18
    access_log: bool = False  # one log line a finished HTTP request (--access-log)
    # A reasoning model's thinking apart from its answer on the HTTP chat API (--reasoning-parser)
    separate_reasoning: bool = True
