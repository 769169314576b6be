"""Process plumbing both services share: health, reflection, signals, graceful stop."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from stepahead.metrics import serve_metrics


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


async def add_health_and_reflection(server: grpc.aio.Server, service_name: str) -> health.aio.HealthServicer:
    """Health (NOT_SERVING until `set_serving`) and reflection for `service_name`."""
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await set_serving(health_servicer, service_name, False)
    names = (service_name, health.SERVICE_NAME, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    return health_servicer


async def set_serving(health_servicer: health.aio.HealthServicer, service_name: str, serving: bool) -> None:
    """The overall ("") and the service's own status."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", service_name):
        await health_servicer.set(name, status)


def add_observability_args(parser: argparse.ArgumentParser, default_metrics_port: int) -> None:
    parser.add_argument("--metrics-host", default="127.0.0.1", help="address of the /metrics endpoint")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=default_metrics_port,
        help="Prometheus /metrics port (0: any free port, -1: off)",
    )
    parser.add_argument(
        "--trace-file",
        type=Path,
        default=None,
        help="write a Chrome trace-event JSON timeline of every step here",
    )


def start_metrics(registry: CollectorRegistry, args: argparse.Namespace, service: str) -> None:
    if args.metrics_port >= 0:
        port = serve_metrics(registry, args.metrics_host, args.metrics_port)
        print(f"{service} metrics on http://{args.metrics_host}:{port}/metrics", flush=True)


def stop_event_on_signals() -> asyncio.Event:
    """An event set by the first SIGINT or SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def graceful_stop(
    server: grpc.aio.Server, health_servicer: health.aio.HealthServicer, grace_s: float
) -> None:
    """Health goes NOT_SERVING first, then the server drains for `grace_s`."""
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace_s)
