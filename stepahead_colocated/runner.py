"""python -m stepahead_colocated --worker-flags '--model sim --sim-step-ms 10' [scheduler flags]

The scheduler with the worker engine in its own process: no gRPC between them. The
baseline for what the process boundary costs (bench/) and a one-process deployment.
It lives outside both packages: the scheduler never imports torch or `worker_svc`.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys

from scheduler_svc.process import cli as scheduler_cli
from scheduler_svc.process.app import serve
from scheduler_svc.process.config import IN_PROCESS
from stepahead.serving import run_service, setup_logging, start_metrics
from worker_svc import cli as worker_cli
from worker_svc.app import build_engine
from worker_svc.inprocess import InProcessTransport


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m stepahead_colocated", add_help=False)
    p.add_argument("--worker-flags", required=True, help="the worker's flags, as one string")
    own, rest = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    config = scheduler_cli.parse_args(rest)
    if config.worker.tls.ca is not None:
        p.error("--worker-tls-* apply to a worker reached over gRPC")
    config = dataclasses.replace(config, worker=dataclasses.replace(config.worker, address=IN_PROCESS))
    setup_logging(config.observability.log_level)
    worker_config = worker_cli.parse_args(shlex.split(own.worker_flags))
    engine = build_engine(worker_config)
    start_metrics(engine.metrics.registry, worker_config.metrics, "worker")
    try:
        run_service("scheduler", serve(config, InProcessTransport(engine, config.core.policy.speculative)))
    finally:
        engine.shutdown()
