"""python -m worker_svc --model tiny|sim|smollm2|PATH.gguf|DIR --port 50061 [--device cpu|cuda] [--tp N]"""

from __future__ import annotations

import argparse
import logging
import os
import signal
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
    metrics_endpoint,
    run_loop,
    server_credentials,
    set_serving,
    setup_logging,
    start_metrics,
    stop_event_on_signals,
    tls_files,
)
from stepahead.trace import Tracer
from worker_svc.backends import load_backend
from worker_svc.engine import EngineConfig, WorkerEngine
from worker_svc.launcher import Launcher
from worker_svc.loading import check_shardable
from worker_svc.ranks import RankPlace, TensorParallelRanks, join_group
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
    p.add_argument(
        "--kv-memory-mib",
        type=float,
        default=None,
        help="size the KV pool by memory instead: this many MiB on each rank (with --tp N a rank "
        "holds 1/N of the KV heads, so N times the token slots)",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=None,
        help="tensor-parallel ranks: start N processes, one GPU each on cuda, gloo on the CPU "
        "(default 1; under torchrun, its world size)",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        help="--tp N: start the group again this many times at most when a rank dies",
    )
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
    if args.tp is not None and args.tp < 1:
        p.error(f"--tp: must be >= 1, got {args.tp}")
    return args


def build_engine(args: argparse.Namespace, ranks: TensorParallelRanks | None = None) -> WorkerEngine:
    device_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    device = ranks.place.device(device_type) if ranks is not None else torch.device(device_type)
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    threads = args.threads or (_rank_threads(ranks.size) if ranks is not None and device.type == "cpu" else 0)
    if threads:
        torch.set_num_threads(threads)
    backend = load_backend(args.model, device, dtype, args.sim_step_ms, args.sim_token_us, ranks)
    config = EngineConfig(
        _kv_slots(args, backend.kv_bytes_per_slot), args.request_slots, args.check_invariants
    )
    tracer = Tracer(args.trace_file if ranks is None or ranks.is_leader else None, "worker")
    return WorkerEngine(backend, config, backend.make_streams(device), tracer, ranks)


def _rank_threads(size: int) -> int:
    """Ranks on one CPU share its cores (torch would give each rank all of them)."""
    return max(1, (os.cpu_count() or 1) // size)


def _kv_slots(args: argparse.Namespace, bytes_per_slot: int) -> int:
    if args.kv_memory_mib is None:
        return int(args.kv_slots)
    if not bytes_per_slot:
        raise ValueError(f"--kv-memory-mib: {args.model} keeps no KV; give --kv-slots")
    slots = int(args.kv_memory_mib * 2**20) // bytes_per_slot
    if slots < 1:
        raise ValueError(
            f"--kv-memory-mib {args.kv_memory_mib}: less than one token's KV ({bytes_per_slot} B)"
        )
    return slots


async def serve(args: argparse.Namespace, ranks: TensorParallelRanks | None = None) -> None:
    engine = build_engine(args, ranks)
    if ranks is not None:
        ranks.barrier()
    # First: a port in use stops nothing running.
    start_metrics(engine.metrics.registry, metrics_endpoint(args), "worker")
    access = WorkerAccess(server_credentials(tls_files(args)), args.worker_token, args.scheduler_timeout)
    serving = await build_server(engine, args.host, args.port, access)
    stop = stop_event_on_signals()
    await serving.server.start()
    await set_serving(serving.health, SERVICE_NAME, True)
    if ranks is not None:
        ranks.mark_up()
    info = engine.info
    log.info(
        "model %s on %s x%d, %d KV slots, %d request slots, %s",
        info.model,
        info.device,
        info.tensor_parallel_size,
        info.kv_slots,
        info.request_slots,
        describe_tls(tls_files(args)),
    )
    print(f"worker listening on {args.host}:{serving.port}", flush=True)
    await stop.wait()
    log.info("stopping: draining launched batches")
    await serving.health.enter_graceful_shutdown()
    await serving.servicer.drain(args.grace)
    await graceful_stop(serving.server, serving.health, args.grace)
    engine.shutdown()
    engine.tracer.close()


def follow(args: argparse.Namespace, ranks: TensorParallelRanks) -> None:
    """A rank other than 0: no port of its own; it runs what rank 0 hands it until rank 0 stops.

    NOTE: it ignores SIGINT and SIGTERM (a terminal's Ctrl-C or torchrun reaches every rank):
    rank 0 drains the launched batches, which needs every rank, then stops the others.
    """
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    engine = build_engine(args, ranks)
    ranks.barrier()
    engine.follow()


def run_rank(args: argparse.Namespace, place: RankPlace) -> None:
    ranks = join_group(place, args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if ranks.is_leader:
        run_loop(serve(args, ranks))
    else:
        follow(args, ranks)
    ranks.close()


def _rank_place(args: argparse.Namespace) -> RankPlace | None:
    """This process's place in a tensor-parallel group; None for a single-rank worker."""
    if "RANK" not in os.environ:
        return None
    place = RankPlace.from_env()
    if args.tp not in (None, place.size):
        raise ValueError(f"--tp {args.tp} but WORLD_SIZE is {place.size}")
    return place if place.size > 1 else None


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    setup_logging(args.log_level)
    try:
        place = _rank_place(args)
        if place is None and (args.tp or 1) > 1:  # start the ranks, each this same command
            check_shardable(args.model, args.tp)  # what no restart can fix fails before any rank starts
            sys.exit(Launcher(argv, args.tp, args.max_restarts, args.grace).run())
        if place is not None:
            run_rank(args, place)
        else:
            run_loop(serve(args))
    except (ValueError, OSError, PortInUse) as exc:  # a bad model, flag or port: say why, no traceback
        sys.exit(f"worker: {exc}")
