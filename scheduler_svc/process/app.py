"""The scheduler's wiring: the engine core in this process, its frontends in N processes (or,
with --frontends 0, in this one), the client APIs, /metrics, signals and the drain. Everything
here reads a `SchedulerConfig` (see `cli` for the command line)."""

from __future__ import annotations

import asyncio
import logging
import tempfile
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1.health import aio as health_aio
from prometheus_client import CollectorRegistry, generate_latest

from scheduler_svc.engine.core import EngineCore
from scheduler_svc.engine.telemetry import SchedulerTelemetry
from scheduler_svc.engine.transport import WorkerTransport
from scheduler_svc.frontend.api_config import ClientApiConfig
from scheduler_svc.frontend.frontend import Frontend
from scheduler_svc.frontend.grpc_api import build_server, health_follows_worker
from scheduler_svc.process.config import SchedulerConfig, WorkerConnection
from scheduler_svc.process.frontend_metrics import FrontendMetrics, Merged, MetricSource, RemoteExposition
from scheduler_svc.process.grpc_transport import GrpcTransport
from scheduler_svc.process.link.local import LocalCore
from scheduler_svc.process.socket_transport import SocketTransport, socket_path
from scheduler_svc.process.supervisor import FrontendSupervisor
from stepahead import heap
from stepahead.metrics import labelled
from stepahead.serving import (
    announce,
    describe_tls,
    graceful_stop,
    start_metrics,
    stop_event_on_signals,
)
from stepahead.trace import Tracer

if TYPE_CHECKING:
    from scheduler_svc.frontend.openai.server import HttpServer

log = logging.getLogger("stepahead.scheduler")


async def serve(config: SchedulerConfig, transport: WorkerTransport | None = None) -> None:
    """The engine core, with its frontends in their own processes or (--frontends 0) in this one."""
    worker = config.worker
    transport = transport or worker_transport(worker)
    mode = config.core.mode
    telemetry = SchedulerTelemetry(mode, Tracer(config.observability.trace_file, f"scheduler ({mode})"))
    core = EngineCore(transport, config.core, telemetry)
    stop = stop_event_on_signals()
    loop_task = asyncio.create_task(core.run())
    try:
        if config.frontends == 0:
            await _serve_frontend_here(core, config, stop)
        else:
            await _serve_frontend_processes(core, config, stop)
    finally:
        await core.close()
        loop_task.cancel()
        await transport.close()
        telemetry.tracer.close()


async def _serve_frontend_here(core: EngineCore, config: SchedulerConfig, stop: asyncio.Event) -> None:
    api = config.api
    frontend = Frontend(config.frontend)
    registry, api_registry = service_registries(core, config, lambda: [frontend.telemetry.registry.collect()])
    LocalCore(core, frontend, lambda: generate_latest(api_registry))
    start_metrics(registry, config.observability.metrics, "scheduler")
    log_access(api, config.worker)
    server, port, health_servicer = await build_server(frontend, api)
    http = http_api(frontend, api, share_port=False)
    health_follows_worker(frontend, health_servicer)
    await server.start()
    if http is not None:
        await http.start()
    where = f"{api.host}:{port}{describe_http(http)}"
    worker = config.worker.address
    heap.settle("scheduler")
    announce(f"scheduler listening on {where} (mode {config.core.mode}, worker {worker})")
    await stop.wait()
    log.info("stopping: finishing in-flight requests for up to %.0fs", config.grace_s)
    await stop_apis(frontend, server, health_servicer, http, config.grace_s)


async def _serve_frontend_processes(core: EngineCore, config: SchedulerConfig, stop: asyncio.Event) -> None:
    log_access(config.api, config.worker)
    with tempfile.TemporaryDirectory(prefix="stepahead-core-") as private:  # mode 0700
        supervisor = FrontendSupervisor(
            core, config, f"{private}/core.sock", lambda: generate_latest(api_registry)
        )
        registry, api_registry = service_registries(core, config, supervisor.metric_sources)
        start_metrics(registry, config.observability.metrics, "scheduler")
        port, http_port = await supervisor.start()
        heap.settle("scheduler")
        http = f", HTTP on port {http_port}" if http_port else ""
        announce(
            f"scheduler listening on {config.api.host}:{port}{http} (mode {config.core.mode}, worker "
            f"{config.worker.address}, {config.frontends} frontend processes)"
        )
        await stop.wait()
        log.info("stopping: frontends finish in-flight requests for up to %.0fs", config.grace_s)
        await supervisor.stop(config.grace_s)


def service_registries(
    core: EngineCore, config: SchedulerConfig, frontend_sources: MetricSource
) -> tuple[CollectorRegistry, CollectorRegistry]:
    """The core's metrics plus every frontend's, summed: one exposition for the service, every
    series labelled `model_name` (the served model's name, as the OpenAI API names it) once a
    worker has said which it is. Two views of it: --metrics-port's, and the HTTP API's
    /metrics, which with --worker-metrics-url (`stepahead serve`) holds the worker's too."""
    registry = core.telemetry.registry
    registry.register(FrontendMetrics(frontend_sources))

    def model_name() -> dict[str, str]:
        name = config.api.served_model_name or (core.info.model if core.info is not None else None)
        return {} if name is None else {"model_name": name}

    view = labelled(registry, model_name)
    url = config.observability.worker_metrics_url
    return view, view if url is None else labelled(Merged(registry, RemoteExposition(url)), model_name)


def log_access(api: ClientApiConfig, worker: WorkerConnection) -> None:
    log.info(
        "client API: %s, %s; worker link: %s",
        describe_tls(api.tls),
        "API key required" if api.api_key else "no API key",
        worker.describe(),
    )
    if api.api_key and api.tls.cert is None:
        log.warning("--api-key without --tls-cert: the key crosses the network in clear text")


def http_api(frontend: Frontend, api: ClientApiConfig, share_port: bool) -> HttpServer | None:
    """The OpenAI-compatible API on --http-port (None when it is 0), bound at once.

    The HTTP stack (FastAPI, pydantic, uvicorn) is imported only here: about half the start-up
    CPU of a scheduler or frontend process that serves gRPC alone.
    """
    if api.http_port == 0:
        return None
    from scheduler_svc.frontend.openai.routes import build_app
    from scheduler_svc.frontend.openai.server import HttpServer, HttpTls

    app = build_app(frontend, api)
    cert, key = api.tls.cert, api.tls.key
    tls = None if cert is None or key is None else HttpTls(cert, key, api.tls.ca)
    return HttpServer(app, api.host, api.http_port, tls, share_port, api.http_limits)


def describe_http(http: HttpServer | None) -> str:
    return "" if http is None else f", HTTP on port {http.port}"


# Requests still open this long before --grace ends are ended with UNAVAILABLE, so that their
# error (a stream's error event and [DONE], a 503 body) is written before the servers cut them.
END_BEFORE_GRACE_S = 0.5


async def stop_apis(
    frontend: Frontend,
    server: grpc.aio.Server,
    health_servicer: health_aio.HealthServicer,
    http: HttpServer | None,
    grace_s: float,
) -> None:
    """Both APIs drain at once for up to `grace_s`; what is still open by then ends with
    UNAVAILABLE (gRPC) or 503 and an OpenAI error (HTTP; an error event and [DONE] mid-stream)."""

    async def end_the_rest() -> None:
        await asyncio.sleep(max(grace_s - END_BEFORE_GRACE_S, grace_s / 2))
        if frontend.clients:
            log.warning(
                "--grace %gs is over: %d open requests end with UNAVAILABLE", grace_s, len(frontend.clients)
            )
        frontend.fail_all(
            grpc.StatusCode.UNAVAILABLE, f"the server is shutting down (--grace {grace_s:g}s is over)"
        )

    ender = asyncio.create_task(end_the_rest())
    drains = [graceful_stop(server, health_servicer, grace_s)]
    if http is not None:
        drains.append(http.stop(grace_s))
    try:
        await asyncio.gather(*drains)
    finally:
        ender.cancel()


def worker_transport(worker: WorkerConnection) -> WorkerTransport:
    """The framed link for `unix:PATH`, gRPC for host:port."""
    path = socket_path(worker.address)
    if path is not None:
        return SocketTransport(path, worker.link)
    return GrpcTransport(worker.address, worker_credentials(worker), worker.link)


def worker_credentials(worker: WorkerConnection) -> grpc.ChannelCredentials | None:
    if worker.tls.ca is None:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=worker.tls.ca,
        private_key=worker.tls.key,
        certificate_chain=worker.tls.cert,
    )
