"""One frontend process of an engine core (started by the core with --frontends N).

It parses the scheduler's own flags (plus --core-socket and --frontend-index), serves the
client API on the shared public port, and attaches to the core. SIGTERM drains it; if the
core goes away it reports NOT_SERVING, ends its clients' requests with UNAVAILABLE and
exits.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

import grpc
from prometheus_client import generate_latest

from scheduler_svc.frontend.frontend import Frontend
from scheduler_svc.frontend.grpc_api import SERVICE_NAME, build_server, health_follows_worker
from scheduler_svc.frontend.telemetry import FrontendTelemetry
from scheduler_svc.process.app import api_config, frontend_config, http_api, parse_args, stop_apis
from scheduler_svc.process.link.frontend_side import RemoteCore
from stepahead.serving import run_service, set_serving, setup_logging

log = logging.getLogger("stepahead.frontend")


async def serve(args: argparse.Namespace) -> int:
    frontend = Frontend(frontend_config(args), FrontendTelemetry(args.mode, own_process=True))
    core = RemoteCore(args.core_socket, frontend, lambda: generate_latest(frontend.telemetry.registry))
    server, port, health_servicer = await build_server(
        frontend, args.host, args.port, api_config(args, share_port=True)
    )
    http = http_api(frontend, args, share_port=True)
    health_follows_worker(frontend, health_servicer)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await server.start()
    if http is not None:
        await http.start()
    attached = asyncio.create_task(core.attach(args.frontend_index, os.getpid(), port))
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({attached, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if stop.is_set():
        await stop_apis(frontend, server, health_servicer, http, args.grace)
        await core.close()
        return 0
    log.error("the engine core is gone: ending every request here and exiting")
    await set_serving(health_servicer, SERVICE_NAME, False)
    frontend.fail_all(grpc.StatusCode.UNAVAILABLE, "the engine core is gone")
    await stop_apis(frontend, server, health_servicer, http, 1.0)
    return 1


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the core, which stops us
    args = parse_args(sys.argv[1:])
    setup_logging(args.log_level)
    code: list[int] = []

    async def run() -> None:
        code.append(await serve(args))

    run_service(f"frontend {args.frontend_index}", run())
    sys.exit(code[0] if code else 1)


if __name__ == "__main__":
    main()
