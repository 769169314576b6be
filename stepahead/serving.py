"""Process plumbing both services share: health, reflection, signals, graceful stop."""

from __future__ import annotations

import asyncio
import logging
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


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
