"""python -m scheduler_svc --worker 127.0.0.1:50061 --port 50051 --mode overlap|serial"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shlex
from collections.abc import Callable

import grpc

from scheduler_svc.late_pick import LatePickConfig
from scheduler_svc.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.server import DEFAULT_MAX_REQUEST_BYTES, ApiConfig, build_server, health_follows_worker
from scheduler_svc.telemetry import SchedulerTelemetry
from scheduler_svc.transport import GrpcTransport, InProcessTransport, WorkerTransport
from scheduler_svc.validation import DEFAULT_MAX_TEXT_BYTES, RequestLimits
from stepahead.serving import (
    API_KEY_ENV,
    add_observability_args,
    add_tls_server_args,
    check_tls_server_args,
    describe_tls,
    graceful_stop,
    pem_file,
    server_credentials,
    setup_logging,
    start_metrics,
    stop_event_on_signals,
)
from stepahead.trace import Tracer
from worker_svc import __main__ as worker_main

log = logging.getLogger("stepahead.scheduler")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m scheduler_svc", description="Stepahead scheduler")
    p.add_argument("--worker", default="127.0.0.1:50061", help="worker address host:port")
    p.add_argument(
        "--in-process-worker",
        metavar="WORKER_FLAGS",
        default=None,
        help="run the worker engine in this process instead (no gRPC to it), built from these "
        "worker flags, e.g. '--model sim --sim-step-ms 10': the baseline for the cost of the "
        "process boundary",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--mode", choices=("overlap", "serial"), default="overlap")
    p.add_argument(
        "--max-batch-tokens",
        type=int,
        default=512,
        help="token budget of one step; longer prompts are prefilled in chunks",
    )
    p.add_argument(
        "--max-running",
        type=int,
        default=0,
        help="concurrent requests at most (0: the worker's request slots)",
    )
    p.add_argument(
        "--max-waiting",
        type=int,
        default=1024,
        help="requests that may wait for admission; more get RESOURCE_EXHAUSTED at once",
    )
    p.add_argument(
        "--worker-retry-timeout",
        type=float,
        default=30.0,
        help="seconds live requests wait for a lost worker to come back before ending with UNAVAILABLE",
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
    p.add_argument("--grace", type=float, default=10.0, help="seconds in-flight requests get on SIGTERM")
    p.add_argument("--log-level", default="info")
    add_observability_args(p, default_metrics_port=9400)
    add_client_api_args(p)
    add_worker_link_args(p)
    args = p.parse_args(argv)
    check_tls_server_args(p, args, client_ca_required=False)
    check_worker_link_args(p, args)
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
    if args.worker_tls_ca is not None and args.in_process_worker is not None:
        p.error("--worker-tls-* apply to a worker reached over gRPC, not to --in-process-worker")


def _at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


async def serve(args: argparse.Namespace) -> None:
    config = SchedulerConfig(
        args.mode,
        args.max_batch_tokens,
        args.max_running,
        worker_retry_timeout_s=args.worker_retry_timeout,
        max_waiting=args.max_waiting,
        late_pick=LatePickConfig(enabled=args.late_pick),
    )
    transport, worker_name = make_transport(args)
    telemetry = SchedulerTelemetry(args.mode, Tracer(args.trace_file, f"scheduler ({args.mode})"))
    scheduler = Scheduler(transport, config, telemetry)
    server, port, health_servicer = await build_server(scheduler, args.host, args.port, api_config(args))
    health_follows_worker(scheduler, health_servicer)
    stop = stop_event_on_signals()
    await server.start()
    loop_task = asyncio.create_task(scheduler.run())
    start_metrics(telemetry.registry, args, "scheduler")
    print(f"scheduler listening on {args.host}:{port} (mode {args.mode}, worker {worker_name})", flush=True)
    await stop.wait()
    log.info("stopping: finishing in-flight requests for up to %.0fs", args.grace)
    await graceful_stop(server, health_servicer, args.grace)
    await scheduler.close()
    loop_task.cancel()
    await transport.close()
    telemetry.tracer.close()


def api_config(args: argparse.Namespace) -> ApiConfig:
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
        limits=RequestLimits(args.max_text_bytes, args.max_prompt_tokens),
        max_request_bytes=args.max_request_bytes,
    )


def worker_credentials(args: argparse.Namespace) -> grpc.ChannelCredentials | None:
    if args.worker_tls_ca is None:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=args.worker_tls_ca,
        private_key=args.worker_tls_key,
        certificate_chain=args.worker_tls_cert,
    )


def describe_worker_link(args: argparse.Namespace) -> str:
    if args.in_process_worker is not None:
        return "in-process"
    if args.worker_tls_ca is None:
        return "plaintext"
    return "mutual TLS" if args.worker_tls_cert is not None else "TLS without a client certificate"


def make_transport(args: argparse.Namespace) -> tuple[WorkerTransport, str]:
    if args.in_process_worker is None:
        return GrpcTransport(args.worker, credentials=worker_credentials(args)), args.worker
    worker_args = worker_main.parse_args(shlex.split(args.in_process_worker))
    engine = worker_main.build_engine(worker_args)
    start_metrics(engine.metrics.registry, worker_args, "worker")
    return InProcessTransport(engine), "in-process"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging(args.log_level)
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
