"""The scheduler's configuration: frozen dataclasses that `cli.parse_args` returns and the
wiring reads. Each default is written here or in the dataclass of the part that uses it, once;
the flags take their defaults from these.

A frontend process is handed a `FrontendProcessConfig` by the core (on its stdin), not the
command line to parse again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from scheduler_svc.engine.core import CoreConfig
from scheduler_svc.frontend.api_config import ClientApiConfig
from scheduler_svc.frontend.frontend import FrontendConfig
from scheduler_svc.process.worker_link import WorkerLinkConfig
from stepahead.serving import MetricsEndpoint, TlsFiles

DEFAULT_GRACE_S = 10.0  # --grace: in-flight requests get this long on SIGTERM
DEFAULT_METRICS_PORT = 9400
IN_PROCESS = "in-process"  # the worker's address when its engine runs in the core's process


@dataclass(frozen=True)
class WorkerConnection:
    """Where the worker is and how the core reaches it."""

    address: str = "127.0.0.1:50061"  # gRPC; or unix:PATH (the worker's --link-socket), or IN_PROCESS
    link: WorkerLinkConfig = field(default_factory=WorkerLinkConfig)
    # `ca`: the CA trusted for the worker's certificate; `cert`/`key`: the core's own, if it asks one
    tls: TlsFiles = field(default_factory=TlsFiles)

    def describe(self) -> str:
        if self.address.startswith("unix:"):
            return "unix socket"
        if self.tls.ca is None:
            return "plaintext"
        return "mutual TLS" if self.tls.cert is not None else "TLS without a client certificate"


@dataclass(frozen=True)
class Observability:
    metrics: MetricsEndpoint = field(default_factory=lambda: MetricsEndpoint(port=DEFAULT_METRICS_PORT))
    trace_file: Path | None = None
    log_level: str = "info"
    # The worker's exposition, fetched at each scrape of the HTTP API's /metrics and served there
    # with the scheduler's (`stepahead serve` sets it); None: the scheduler's series only.
    worker_metrics_url: str | None = None


@dataclass(frozen=True)
class SchedulerConfig:
    worker: WorkerConnection = field(default_factory=WorkerConnection)
    core: CoreConfig = field(default_factory=CoreConfig)
    frontend: FrontendConfig = field(default_factory=FrontendConfig)  # `index`: set per process
    api: ClientApiConfig = field(default_factory=ClientApiConfig)
    frontends: int = 1  # frontend processes; 0: the frontend runs in the core's process
    # Niceness the frontend processes add to theirs: on a shared box the core's loop runs first
    frontend_nice: int = 5
    grace_s: float = DEFAULT_GRACE_S
    observability: Observability = field(default_factory=Observability)


@dataclass(frozen=True)
class FrontendProcessConfig:
    """What one frontend process is given by its core."""

    frontend: FrontendConfig
    api: ClientApiConfig  # its ports: the ones the core reserved (shared by every frontend)
    core_socket: str  # the core's link
    grace_s: float
    log_level: str
    nice: int = 0  # added to the process's niceness as it starts (SchedulerConfig.frontend_nice)
