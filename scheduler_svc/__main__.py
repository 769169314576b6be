"""python -m scheduler_svc --worker 127.0.0.1:50061 --port 50051 --mode overlap|serial"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shlex

from scheduler_svc.late_pick import LatePickConfig
from scheduler_svc.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.server import build_server, health_follows_worker
from scheduler_svc.telemetry import SchedulerTelemetry
from scheduler_svc.transport import GrpcTransport, InProcessTransport, WorkerTransport
from stepahead.serving import (
    add_observability_args,
    graceful_stop,
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
        "--worker-retry-timeout",
        type=float,
        default=30.0,
        help="seconds live requests wait for a lost worker to come back before ending with UNAVAILABLE",
    )
    p.add_argument(
        "--late-pick",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="overlap: pick batch k+1 shortly before forward k ends rather than when it starts, so "
        "requests arriving meanwhile ride in k+1: time to first token closer to serial, paid for with "
        "device idle when the event loop wakes late (see docs/BENCHMARKS.md)",
    )
    p.add_argument("--grace", type=float, default=10.0, help="seconds in-flight requests get on SIGTERM")
    p.add_argument("--log-level", default="info")
    add_observability_args(p, default_metrics_port=9400)
    return p.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    config = SchedulerConfig(
        args.mode,
        args.max_batch_tokens,
        args.max_running,
        worker_retry_timeout_s=args.worker_retry_timeout,
        late_pick=LatePickConfig(enabled=args.late_pick),
    )
    transport, worker_name = make_transport(args)
    telemetry = SchedulerTelemetry(args.mode, Tracer(args.trace_file, f"scheduler ({args.mode})"))
    scheduler = Scheduler(transport, config, telemetry)
    server, port, health_servicer = await build_server(scheduler, args.host, args.port)
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


def make_transport(args: argparse.Namespace) -> tuple[WorkerTransport, str]:
    if args.in_process_worker is None:
        return GrpcTransport(args.worker), args.worker
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
