"""Process plumbing both services share: logging, signals, graceful stop."""

from __future__ import annotations

import asyncio
import logging
import signal

import grpc
from grpc_health.v1 import health, health_pb2


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


async def mark_serving(health_servicer: health.aio.HealthServicer, service_name: str) -> None:
    for name in ("", service_name):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)


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
