"""One frontend process of an engine core (started by the core with --frontends N).

It reads its `FrontendProcessConfig` from its stdin (the core wrote it there: no command line
to parse again, and no secret in the process list), serves the client API on the shared public
port, and attaches to the core. SIGTERM drains it; if the core goes away it reports
NOT_SERVING, ends its clients' requests with UNAVAILABLE and exits.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import signal
import sys

import grpc
from prometheus_client import generate_latest

from scheduler_svc.frontend.frontend import Frontend
from scheduler_svc.frontend.grpc_api import SERVICE_NAME, build_server, health_follows_worker
from scheduler_svc.frontend.telemetry import FrontendTelemetry
from scheduler_svc.process.app import http_api, stop_apis
from scheduler_svc.process.config import FrontendProcessConfig
from scheduler_svc.process.link.frontend_side import RemoteCore
from stepahead import heap
from stepahead.serving import run_service, set_serving, setup_logging

log = logging.getLogger("stepahead.frontend")


async def serve(config: FrontendProcessConfig) -> int:
    api = config.api
    frontend = Frontend(config.frontend, FrontendTelemetry(config.frontend.mode, own_process=True))
    core = RemoteCore(config.core_socket, frontend, lambda: generate_latest(frontend.telemetry.registry))
    server, port, health_servicer = await build_server(frontend, api, share_port=True)
    http = http_api(frontend, api, share_port=True)
    health_follows_worker(frontend, health_servicer)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await server.start()
    if http is not None:
        await http.start()
    heap.settle(f"frontend {config.frontend.index}")
    attached = asyncio.create_task(core.attach(config.frontend.index, os.getpid(), port))
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({attached, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if stop.is_set():
        await stop_apis(frontend, server, health_servicer, http, config.grace_s)
        await core.close()
        return 0
    log.error("the engine core is gone: ending every request here and exiting")
    await set_serving(health_servicer, SERVICE_NAME, False)
    frontend.fail_all(grpc.StatusCode.UNAVAILABLE, "the engine core is gone")
    await stop_apis(frontend, server, health_servicer, http, 1.0)
    return 1


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the core, which stops us
    config = pickle.load(sys.stdin.buffer)
    assert isinstance(config, FrontendProcessConfig)
    if config.nice:
        os.nice(config.nice)  # the core's loop before the frontends' on a shared box
    setup_logging(config.log_level)
    code: list[int] = []

    async def run() -> None:
        code.append(await serve(config))

    run_service(f"frontend {config.frontend.index}", run())
    sys.exit(code[0] if code else 1)


if __name__ == "__main__":
    main()
