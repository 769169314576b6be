"""python -m scheduler_svc --worker 127.0.0.1:50061 --port 50051 --mode overlap|serial --frontends N

The engine core (this process) and N frontend processes that serve the client API."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1.health import aio as health_aio
from prometheus_client import CollectorRegistry

from scheduler_svc.engine.core import CoreConfig, EngineCore
from scheduler_svc.engine.depth import MAX_DEPTH, DepthConfig, parse_depth
from scheduler_svc.engine.late_pick import LatePickConfig
from scheduler_svc.engine.policy import PolicyConfig
from scheduler_svc.engine.telemetry import SchedulerTelemetry
from scheduler_svc.engine.transport import WorkerTransport
from scheduler_svc.frontend.frontend import Frontend, FrontendConfig
from scheduler_svc.frontend.grpc_api import (
    DEFAULT_MAX_REQUEST_BYTES,
    ApiConfig,
    build_server,
    health_follows_worker,
)
from scheduler_svc.frontend.openai.config import HttpLimits, allowed_hosts
from scheduler_svc.frontend.validation import DEFAULT_MAX_TEXT_BYTES, RequestLimits
from scheduler_svc.process.frontend_metrics import FrontendMetrics, MetricSource
from scheduler_svc.process.grpc_transport import GrpcTransport, WorkerLinkConfig
from scheduler_svc.process.link.local import LocalCore
from scheduler_svc.process.supervisor import FrontendSupervisor
from stepahead.serving import (
    API_KEY_ENV,
    add_observability_args,
    add_tls_server_args,
    add_worker_token_arg,
    check_tls_server_args,
    describe_tls,
    graceful_stop,
    pem_file,
    run_service,
    server_credentials,
    setup_logging,
    start_metrics,
    stop_event_on_signals,
)
from stepahead.trace import Tracer

if TYPE_CHECKING:
    from scheduler_svc.frontend.openai.server import HttpServer

log = logging.getLogger("stepahead.scheduler")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m scheduler_svc", description="Stepahead scheduler")
    p.add_argument("--worker", default="127.0.0.1:50061", help="worker address host:port")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--mode", choices=("overlap", "serial"), default=CoreConfig.mode)
    p.add_argument(
        "--frontends",
        type=_at_least(0),
        default=1,
        help="frontend processes serving the client API on --port (SO_REUSEPORT); 0: serve it from "
        "the engine core's own process",
    )
    p.add_argument(
        "--stream-interval",
        type=_at_least(1),
        default=FrontendConfig.stream_interval,
        help="send a client its tokens every N tokens (and at the finish): coarser streaming, less CPU",
    )
    p.add_argument(
        "--max-batch-tokens",
        type=_at_least(1),
        default=PolicyConfig.max_batch_tokens,
        help="token budget of one step; longer prompts are prefilled in chunks",
    )
    p.add_argument(
        "--max-running",
        type=_at_least(0),
        default=PolicyConfig.max_running,
        help="concurrent requests at most (0: the worker's request slots)",
    )
    p.add_argument(
        "--max-waiting",
        type=_at_least(1),
        default=PolicyConfig.max_waiting,
        help="requests that may wait for admission (at least 1: every new request waits for the "
        "next step); more get RESOURCE_EXHAUSTED at once",
    )
    p.add_argument(
        "--no-prefix-cache",
        dest="prefix_cache",
        action="store_false",
        help="compute every prompt in full: no reuse of the KV of cached prefixes",
    )
    p.add_argument(
        "--worker-retry-timeout",
        type=float,
        default=CoreConfig.worker_retry_timeout_s,
        help="seconds live requests wait for a lost worker to come back before ending with UNAVAILABLE",
    )
    p.add_argument(
        "--worker-step-timeout",
        type=float,
        default=CoreConfig.worker_step_timeout_s,
        help="a worker that says nothing for this long while a step or the handshake is pending is hung "
        "(it sends keepalives while a step computes, so a slow step is not): the session is dropped "
        "and its requests recomputed on the next one",
    )
    p.add_argument(
        "--late-pick",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="overlap: pick batch k+1 shortly before forward k is expected to end rather than when it "
        "starts, so requests arriving meanwhile ride in k+1 (time to first token as in serial); the "
        "margin is steered to keep late wake-ups under 1%% of device time. Helps below saturation, "
        "hurts when the scheduler's CPU is the bottleneck (see docs/BENCHMARKS.md)",
    )
    p.add_argument(
        "--overlap-depth",
        type=_depth,
        default=DepthConfig.depth,
        metavar="N|auto",
        help="overlap: batches launched ahead of the one being processed (1: one step ahead). A slow "
        "worker link needs more: about (link round trip + scheduler CPU per step) / device step. "
        f"auto: chosen from those, measured, and adjusted as they change (1..{MAX_DEPTH})",
    )
    p.add_argument("--grace", type=float, default=10.0, help="seconds in-flight requests get on SIGTERM")
    p.add_argument("--core-socket", default=None, help=argparse.SUPPRESS)  # a frontend process: the core
    p.add_argument("--frontend-index", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--log-level", default="info")
    add_observability_args(p, default_metrics_port=9400)
    add_client_api_args(p)
    add_worker_link_args(p)
    args = p.parse_args(argv)
    check_tls_server_args(p, args, client_ca_required=False)
    check_worker_link_args(p, args)
    if args.overlap_depth != 1 and args.mode != "overlap":
        p.error("--overlap-depth: the serial loop launches one batch at a time (use --mode overlap)")
    if args.overlap_depth != 1 and args.late_pick:
        p.error("--overlap-depth: --late-pick holds the pick of k+1 for forward k; it needs depth 1")
    return args


def add_client_api_args(p: argparse.ArgumentParser) -> None:
    add_tls_server_args(
        p,
        client_ca_help="also require client certificates signed by this CA (PEM): mutual TLS on the "
        "client API; without it the API is server-authenticated TLS",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"require 'authorization: Bearer KEY' metadata on the Generation API (default: ${API_KEY_ENV}, "
        "which, unlike the flag, does not show in the process list)",
    )
    p.add_argument(
        "--http-port",
        type=_at_least(0),
        default=8000,
        help="port of the OpenAI-compatible HTTP API, on --host with the same TLS and API key (0: off)",
    )
    p.add_argument(
        "--http-head-timeout",
        type=float,
        default=HttpLimits.head_timeout_s,
        help="seconds an HTTP client has to send a whole request head (408 beyond: slowloris)",
    )
    p.add_argument(
        "--http-body-timeout",
        type=float,
        default=HttpLimits.body_pause_timeout_s,
        help="seconds an HTTP request body may pause (408 beyond)",
    )
    p.add_argument(
        "--allowed-hosts",
        type=allowed_hosts,
        default=(),
        help="comma-separated Host names the HTTP API answers to, e.g. 'localhost,127.0.0.1,"
        "*.example.com' (any other: 400; /health answers any): a guard against DNS rebinding "
        "(default: any host)",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model's name on the HTTP API (`model`, /v1/models); default: the worker's",
    )
    p.add_argument(
        "--chat-template",
        type=text_file,
        metavar="FILE",
        help="Jinja chat template used in place of the model's own (for models without one)",
    )
    p.add_argument(
        "--max-request-bytes",
        type=_at_least(1),
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="largest request message accepted; gRPC answers a larger one RESOURCE_EXHAUSTED",
    )
    p.add_argument(
        "--max-text-bytes",
        type=_at_least(1),
        default=DEFAULT_MAX_TEXT_BYTES,
        help="longest input.text in UTF-8 bytes, checked before it is tokenized",
    )
    p.add_argument(
        "--max-prompt-tokens",
        type=_at_least(0),
        default=0,
        help="longest prompt in tokens (0: the model's context length)",
    )


def add_worker_link_args(p: argparse.ArgumentParser) -> None:
    add_worker_token_arg(p, "present this shared secret to the worker (its --worker-token)")
    p.add_argument(
        "--worker-tls-ca",
        type=pem_file,
        metavar="PEM",
        help="reach the worker over TLS, trusting this CA (PEM) for the worker's certificate",
    )
    p.add_argument(
        "--worker-tls-cert",
        type=pem_file,
        metavar="PEM",
        help="client certificate (PEM) shown to the worker, which requires one signed by its --tls-ca",
    )
    p.add_argument("--worker-tls-key", type=pem_file, metavar="PEM", help="private key of --worker-tls-cert")


def check_worker_link_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if (args.worker_tls_cert is None) != (args.worker_tls_key is None):
        p.error("--worker-tls-cert and --worker-tls-key go together")
    if args.worker_tls_cert is not None and args.worker_tls_ca is None:
        p.error("--worker-tls-cert needs --worker-tls-ca")


def text_file(path: str) -> str:
    """argparse type: a text file's contents, read once at startup."""
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {exc}") from exc


def _at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def _depth(value: str) -> int:
    try:
        return parse_depth(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def core_config(args: argparse.Namespace) -> CoreConfig:
    return CoreConfig(
        args.mode,
        PolicyConfig(args.max_batch_tokens, args.max_running, args.max_waiting, args.prefix_cache),
        worker_retry_timeout_s=args.worker_retry_timeout,
        worker_step_timeout_s=args.worker_step_timeout,
        late_pick=LatePickConfig(enabled=args.late_pick),
        depth=DepthConfig(args.overlap_depth),
    )


def frontend_config(args: argparse.Namespace) -> FrontendConfig:
    return FrontendConfig(
        args.mode,
        RequestLimits(args.max_text_bytes, args.max_prompt_tokens),
        args.stream_interval,
        args.frontend_index,
        args.chat_template,
    )


async def serve(args: argparse.Namespace, transport: WorkerTransport | None = None) -> None:
    """The engine core, with its frontends in their own processes or (--frontends 0) in this one."""
    link = WorkerLinkConfig(args.worker_token, args.max_batch_tokens, args.worker_step_timeout)
    transport = transport or GrpcTransport(args.worker, worker_credentials(args), link)
    telemetry = SchedulerTelemetry(args.mode, Tracer(args.trace_file, f"scheduler ({args.mode})"))
    core = EngineCore(transport, core_config(args), telemetry)
    stop = stop_event_on_signals()
    loop_task = asyncio.create_task(core.run())
    try:
        if args.frontends == 0:
            await _serve_frontend_here(core, args, stop)
        else:
            await _serve_frontend_processes(core, args, stop)
    finally:
        await core.close()
        loop_task.cancel()
        await transport.close()
        telemetry.tracer.close()


async def _serve_frontend_here(core: EngineCore, args: argparse.Namespace, stop: asyncio.Event) -> None:
    frontend = Frontend(frontend_config(args))
    LocalCore(core, frontend)
    start_metrics(core_registry(core, lambda: [frontend.telemetry.registry.collect()]), args, "scheduler")
    server, port, health_servicer = await build_server(frontend, args.host, args.port, api_config(args))
    http = http_api(frontend, args, share_port=False)
    health_follows_worker(frontend, health_servicer)
    await server.start()
    if http is not None:
        await http.start()
    where = f"{args.host}:{port}{describe_http(http)}"
    print(f"scheduler listening on {where} (mode {args.mode}, worker {args.worker})", flush=True)
    await stop.wait()
    log.info("stopping: finishing in-flight requests for up to %.0fs", args.grace)
    await stop_apis(frontend, server, health_servicer, http, args.grace)


async def _serve_frontend_processes(core: EngineCore, args: argparse.Namespace, stop: asyncio.Event) -> None:
    with tempfile.TemporaryDirectory(prefix="stepahead-core-") as private:  # mode 0700
        supervisor = FrontendSupervisor(core, args, f"{private}/core.sock")
        start_metrics(core_registry(core, supervisor.metric_sources), args, "scheduler")
        port, http_port = await supervisor.start()
        http = f", HTTP on port {http_port}" if http_port else ""
        print(
            f"scheduler listening on {args.host}:{port}{http} (mode {args.mode}, worker {args.worker}, "
            f"{args.frontends} frontend processes)",
            flush=True,
        )
        await stop.wait()
        log.info("stopping: frontends finish in-flight requests for up to %.0fs", args.grace)
        await supervisor.stop(args.grace)


def core_registry(core: EngineCore, frontend_sources: MetricSource) -> CollectorRegistry:
    """The core's metrics plus every frontend's, summed: one endpoint for the service."""
    registry = core.telemetry.registry
    registry.register(FrontendMetrics(frontend_sources))
    return registry


def api_config(args: argparse.Namespace, share_port: bool = False) -> ApiConfig:
    log.info(
        "client API: %s, %s; worker link: %s",
        describe_tls(args),
        "API key required" if args.api_key else "no API key",
        describe_worker_link(args),
    )
    if args.api_key and args.tls_cert is None:
        log.warning("--api-key without --tls-cert: the key crosses the network in clear text")
    return ApiConfig(
        credentials=server_credentials(args),
        api_key=args.api_key,
        max_request_bytes=args.max_request_bytes,
        share_port=share_port,
    )


def http_api(frontend: Frontend, args: argparse.Namespace, share_port: bool) -> HttpServer | None:
    """The OpenAI-compatible API on --http-port (None when it is 0), bound at once.

    The HTTP stack (FastAPI, pydantic, uvicorn) is imported only here: about half the start-up
    CPU of a scheduler or frontend process that serves gRPC alone.
    """
    if args.http_port == 0:
        return None
    from scheduler_svc.frontend.openai.routes import HttpApiConfig, build_app
    from scheduler_svc.frontend.openai.server import HttpServer, HttpTls

    limits = HttpLimits(head_timeout_s=args.http_head_timeout, body_pause_timeout_s=args.http_body_timeout)
    config = HttpApiConfig(
        args.api_key,
        args.max_request_bytes,
        args.served_model_name,
        limits.body_pause_timeout_s,
        allowed_hosts=args.allowed_hosts,
    )
    app = build_app(frontend, config)
    tls = None if args.tls_cert is None else HttpTls(args.tls_cert, args.tls_key, args.tls_ca)
    return HttpServer(app, args.host, args.http_port, tls, share_port, limits)


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


def worker_credentials(args: argparse.Namespace) -> grpc.ChannelCredentials | None:
    if args.worker_tls_ca is None:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=args.worker_tls_ca,
        private_key=args.worker_tls_key,
        certificate_chain=args.worker_tls_cert,
    )


def describe_worker_link(args: argparse.Namespace) -> str:
    if args.worker_tls_ca is None:
        return "plaintext"
    return "mutual TLS" if args.worker_tls_cert is not None else "TLS without a client certificate"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    args.argv = argv  # frontend processes parse the same flags
    setup_logging(args.log_level)
    run_service("scheduler", serve(args))
