"""python -m worker_svc --model tiny|sim|smollm2|PATH.gguf|DIR --port 50061 [--device cpu|cuda]"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

import torch

from stepahead.serving import (
    PortInUse,
    add_observability_args,
    add_tls_server_args,
    add_worker_token_arg,
    check_tls_server_args,
    describe_tls,
    graceful_stop,
    server_credentials,
    set_serving,
    setup_logging,
    start_metrics,
    stop_event_on_signals,
)
from stepahead.trace import Tracer
from worker_svc.backends import load_backend
from worker_svc.engine import EngineConfig, WorkerEngine
from worker_svc.server import DEFAULT_SCHEDULER_TIMEOUT_S, SERVICE_NAME, WorkerAccess, build_server

log = logging.getLogger("stepahead.worker")

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m worker_svc", description="Stepahead worker")
    p.add_argument("--model", default="tiny", help="tiny, sim, smollm2, a Llama .gguf file or checkpoint dir")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=50061)
    add_tls_server_args(
        p,
        client_ca_help="CA that signs the schedulers' client certificates (PEM); required with "
        "--tls-cert: the worker serves only schedulers that present one (mutual TLS)",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if present")
    p.add_argument(
        "--dtype", choices=tuple(DTYPES), default=None, help="default: float32 on cpu, bfloat16 on cuda"
    )
    p.add_argument("--kv-slots", type=int, default=16384, help="KV pool size in tokens")
    p.add_argument("--request-slots", type=int, default=256, help="concurrent requests at most")
    p.add_argument("--sim-step-ms", type=float, default=10.0, help="sim: fixed time per step")
    p.add_argument("--sim-token-us", type=float, default=2.0, help="sim: extra time per token")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    p.add_argument(
        "--check-invariants",
        action="store_true",
        help="fail a step that reads an unwritten FutureMap entry (syncs the device)",
    )
    p.add_argument("--grace", type=float, default=5.0, help="seconds to drain on SIGTERM")
    add_worker_token_arg(p, "require this shared secret from schedulers ('authorization: Bearer TOKEN')")
    p.add_argument(
        "--scheduler-timeout",
        type=float,
        default=DEFAULT_SCHEDULER_TIMEOUT_S,
        help="end a session whose scheduler sent nothing for this long with no step pending (a stopped "
        "or vanished scheduler), so that another can connect",
    )
    add_observability_args(p, default_metrics_port=9401)
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    check_tls_server_args(p, args, client_ca_required=True)
    return args


def build_engine(args: argparse.Namespace) -> WorkerEngine:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    if args.threads:
        torch.set_num_threads(args.threads)
    backend = load_backend(args.model, device, dtype, args.sim_step_ms, args.sim_token_us)
    config = EngineConfig(args.kv_slots, args.request_slots, args.check_invariants)
    return WorkerEngine(backend, config, backend.make_streams(device), Tracer(args.trace_file, "worker"))


async def serve(args: argparse.Namespace) -> None:
    engine = build_engine(args)
    start_metrics(engine.metrics.registry, args, "worker")  # first: a port in use stops nothing running
    access = WorkerAccess(server_credentials(args), args.worker_token, args.scheduler_timeout)
    serving = await build_server(engine, args.host, args.port, access)
    stop = stop_event_on_signals()
    await serving.server.start()
    await set_serving(serving.health, SERVICE_NAME, True)
    info = engine.info
    log.info(
        "model %s on %s, %d KV slots, %d request slots, %s",
        info.model,
        info.device,
        info.kv_slots,
        info.request_slots,
        describe_tls(args),
    )
    print(f"worker listening on {args.host}:{serving.port}", flush=True)
    await stop.wait()
    log.info("stopping: draining launched batches")
    await serving.health.enter_graceful_shutdown()
    await serving.servicer.drain(args.grace)
    await graceful_stop(serving.server, serving.health, args.grace)
    engine.shutdown()
    engine.tracer.close()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging(args.log_level)
    try:
        asyncio.run(serve(args))
    except (ValueError, OSError, PortInUse) as exc:  # a bad model, flag or port: say why, no traceback
        sys.exit(f"worker: {exc}")


if __name__ == "__main__":
    main()
