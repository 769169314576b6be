"""The worker's wiring: the engine (model, KV pool, streams) behind its gRPC server, health,
/metrics and the drain; a tensor-parallel rank leads (rank 0) or follows. Everything here reads
a `WorkerConfig` (see `cli` for the command line)."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import signal

import torch

from stepahead import heap
from stepahead.serving import (
    announce,
    describe_tls,
    graceful_stop,
    run_loop,
    server_credentials,
    set_serving,
    start_metrics,
    stop_event_on_signals,
)
from stepahead.trace import Tracer
from worker_svc.backends import load_backend
from worker_svc.config import WorkerConfig
from worker_svc.dtypes import choose_dtype
from worker_svc.engine import EngineConfig, WorkerEngine
from worker_svc.forward_thread import forward_thread
from worker_svc.link_socket import LinkSocket
from worker_svc.ranks import RankPlace, TensorParallelRanks, join_group
from worker_svc.server import SERVICE_NAME, WorkerAccess, build_server

log = logging.getLogger("stepahead.worker")


def build_engine(config: WorkerConfig, ranks: TensorParallelRanks | None = None) -> WorkerEngine:
    """Built on the engine's forward thread, which alone runs torch's parallel work
    (worker_svc/forward_thread.py)."""
    forward = forward_thread()
    return forward.submit(_build_engine, config, ranks, forward).result()


def _build_engine(
    config: WorkerConfig, ranks: TensorParallelRanks | None, forward: concurrent.futures.ThreadPoolExecutor
) -> WorkerEngine:
    where = config.placement
    device_type = where.device or ("cuda" if torch.cuda.is_available() else "cpu")
    device = ranks.place.device(device_type) if ranks is not None else torch.device(device_type)
    dtype, why = choose_dtype(where.dtype, device, where.quantization)
    log.info("dtype: %s", why)
    shared_cpu = ranks is not None and device.type == "cpu"
    threads = where.threads or (_rank_threads(ranks.size) if ranks is not None and shared_cpu else 0)
    if threads:
        torch.set_num_threads(threads)
    backend = load_backend(
        where.model,
        device,
        dtype,
        where.sim_step_ms,
        where.sim_token_us,
        ranks,
        where.tokenizer,
        where.max_model_len,
        where.quantization,
    )
    engine_config = EngineConfig(
        _kv_slots(config, backend.kv_bytes_per_slot), config.request_slots, config.check_invariants
    )
    tracer = Tracer(config.trace_file if ranks is None or ranks.is_leader else None, "worker")
    return WorkerEngine(backend, engine_config, backend.make_streams(device), tracer, ranks, forward)


def _rank_threads(size: int) -> int:
    """Ranks on one CPU share its cores (torch would give each rank all of them)."""
    return max(1, (os.cpu_count() or 1) // size)


def _kv_slots(config: WorkerConfig, bytes_per_slot: int) -> int:
    if config.kv_memory_mib is None:
        return config.kv_slots
    if not bytes_per_slot:
        raise ValueError(f"--kv-memory-mib: {config.placement.model} keeps no KV; give --kv-slots")
    slots = int(config.kv_memory_mib * 2**20) // bytes_per_slot
    if slots < 1:
        raise ValueError(
            f"--kv-memory-mib {config.kv_memory_mib}: less than one token's KV ({bytes_per_slot} B)"
        )
    return slots


async def serve(config: WorkerConfig, ranks: TensorParallelRanks | None = None) -> None:
    engine = build_engine(config, ranks)
    if ranks is not None:
        ranks.barrier()
    # First: a port in use stops nothing running.
    start_metrics(engine.metrics.registry, config.metrics, "worker")
    access = WorkerAccess(server_credentials(config.tls), config.worker_token, config.scheduler_timeout_s)
    serving = await build_server(engine, config.host, config.port, access)
    link = (
        None
        if config.link_socket is None
        else LinkSocket(serving.servicer, config.link_socket, config.worker_token)
    )
    stop = stop_event_on_signals()
    if link is not None:  # first: once the gRPC port listens, the socket does too
        await link.start()
    await serving.server.start()
    heap.settle("worker")
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
        describe_tls(config.tls),
    )
    if link is not None:
        log.info("scheduler link also on unix:%s", link.path)
    announce(f"worker listening on {config.host}:{serving.port}")
    await stop.wait()
    log.info("stopping: draining launched batches")
    await serving.health.enter_graceful_shutdown()
    await serving.servicer.drain(config.grace_s)
    if link is not None:
        await link.stop()
    await graceful_stop(serving.server, serving.health, config.grace_s)
    engine.shutdown()
    engine.tracer.close()


def follow(config: WorkerConfig, ranks: TensorParallelRanks) -> None:
    """A rank other than 0: no port of its own; it runs what rank 0 hands it until rank 0 stops.

    NOTE: it ignores SIGINT and SIGTERM (a terminal's Ctrl-C or torchrun reaches every rank):
    rank 0 drains the launched batches, which needs every rank, then stops the others.
    """
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    engine = build_engine(config, ranks)
    heap.settle(f"worker rank {ranks.place.rank}")
    ranks.barrier()
    engine.follow()


def run_rank(config: WorkerConfig, place: RankPlace) -> None:
    ranks = join_group(place, config.placement.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if ranks.is_leader:
        run_loop(serve(config, ranks))
    else:
        follow(config, ranks)
    ranks.close()


def rank_place(config: WorkerConfig) -> RankPlace | None:
    """This process's place in a tensor-parallel group; None for a single-rank worker."""
    if "RANK" not in os.environ:
        return None
    place = RankPlace.from_env()
    if config.tp not in (None, place.size):
        raise ValueError(f"--tp {config.tp} but WORLD_SIZE is {place.size}")
    return place if place.size > 1 else None
