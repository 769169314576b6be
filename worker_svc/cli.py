"""The worker's command line: `parse_args` turns it into a frozen `WorkerConfig` (no
`argparse.Namespace` goes further), `main` serves it (`--tp N`: starts N ranks, each this same
command, as torchrun would).

python -m worker_svc --model tiny|sim|smollm2|PATH.gguf|DIR --port 50061 [--device cpu|cuda] [--tp N]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from stepahead.serving import (
    PortInUse,
    add_observability_args,
    add_tls_server_args,
    add_worker_token_arg,
    check_tls_server_args,
    metrics_endpoint,
    run_loop,
    setup_logging,
    tls_files,
)
from worker_svc.app import rank_place, run_rank, serve
from worker_svc.config import DEFAULT_METRICS_PORT, ModelPlacement, WorkerConfig
from worker_svc.dtypes import dtype_name, quantized_dtype_refusal
from worker_svc.launcher import Launcher
from worker_svc.loading import check_shardable
from worker_svc.quantization import QUANTIZATIONS


def parse_args(argv: list[str] | None = None) -> WorkerConfig:
    """Exits with a usage error naming the flag on a bad command line."""
    p = build_parser()
    args = p.parse_args(argv)
    check_tls_server_args(p, args, client_ca_required=True)
    if args.tp is not None and args.tp < 1:
        p.error(f"--tp: must be >= 1, got {args.tp}")
    refusal = None if args.quantization == "none" else quantized_dtype_refusal(args.quantization, args.dtype)
    if refusal is not None:
        p.error(refusal)
    if args.quantization != "none" and args.tp is not None and args.tp > 1:
        p.error(f"--quantization {args.quantization}: serves with --tp 1 only")
    if args.max_model_len is not None and args.max_model_len < 2:
        p.error(
            f"--max-model-len: must be >= 2 (a prompt token and one to generate), got {args.max_model_len}"
        )
    return config_from_args(args)


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    return WorkerConfig(
        ModelPlacement(
            args.model,
            args.device,
            args.dtype,
            args.threads,
            args.sim_step_ms,
            args.sim_token_us,
            args.tokenizer,
            args.max_model_len,
            args.quantization,
        ),
        args.host,
        args.port,
        tls_files(args),
        args.kv_slots,
        args.kv_memory_mib,
        args.request_slots,
        args.tp,
        args.max_restarts,
        args.check_invariants,
        args.grace,
        args.worker_token,
        args.scheduler_timeout,
        metrics_endpoint(args),
        args.trace_file,
        args.log_level,
        args.link_socket,
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m worker_svc", description="Stepahead worker")
    p.add_argument(
        "--model",
        default=ModelPlacement.model,
        help="tiny, sim, smollm2, a Llama .gguf file or checkpoint dir",
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="vLLM's: accepted; a checkpoint's own code is never run (the architectures served are built in)",
    )
    p.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        metavar="PATH",
        help="a tokenizer.json, or a directory with one (and its tokenizer_config.json): for a "
        "checkpoint that has none of its own",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        metavar="N",
        help="the longest prompt + completion served (default: the model's context length; at most that)",
    )
    p.add_argument("--host", default=WorkerConfig.host, help="address to bind (0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=WorkerConfig.port)
    add_tls_server_args(
        p,
        client_ca_help="CA that signs the schedulers' client certificates (PEM); required with "
        "--tls-cert: the worker serves only schedulers that present one (mutual TLS)",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if present")
    p.add_argument(
        "--dtype",
        type=_dtype,
        default=None,
        metavar="{float32,float64,bfloat16,float16,auto}",
        help="default (auto): float32 on cpu (exact), bfloat16 on cuda; the start-up log says which and "
        "why (vLLM's half and float are float16 and float32)",
    )
    p.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default=ModelPlacement.quantization,
        help="keep the weights quantized on the CPU: int4 (a GGUF's Q4_0/Q4_1/Q4_K weights as the file "
        "holds them, others grouped by 32) or int8; the output layer stays 8-bit. Computed in float32 "
        "by Stepahead's kernels (x86-64 AVX2, built on first use with the C compiler), else or with "
        "--dtype bfloat16 by torch's. Faster, not exact",
    )
    p.add_argument("--kv-slots", type=int, default=WorkerConfig.kv_slots, help="KV pool size in tokens")
    p.add_argument(
        "--kv-memory-mib",
        type=float,
        default=None,
        help="size the KV pool by memory instead: this many MiB on each rank (with --tp N a rank "
        "holds 1/N of the KV heads, so N times the token slots)",
    )
    p.add_argument(
        "--tp",
        "--tensor-parallel-size",  # vLLM's spelling
        "-tp",
        type=int,
        default=None,
        help="tensor-parallel ranks: start N processes, one GPU each on cuda, gloo on the CPU "
        "(default 1; under torchrun, its world size)",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=WorkerConfig.max_restarts,
        help="--tp N: start the group again this many times at most when a rank dies",
    )
    p.add_argument(
        "--request-slots", type=int, default=WorkerConfig.request_slots, help="concurrent requests at most"
    )
    p.add_argument(
        "--sim-step-ms", type=float, default=ModelPlacement.sim_step_ms, help="sim: fixed time per step"
    )
    p.add_argument(
        "--sim-token-us", type=float, default=ModelPlacement.sim_token_us, help="sim: extra time per token"
    )
    p.add_argument(
        "--threads", type=int, default=ModelPlacement.threads, help="torch CPU threads (0: torch default)"
    )
    p.add_argument(
        "--check-invariants",
        action="store_true",
        help="fail a step that reads an unwritten FutureMap entry (syncs the device)",
    )
    p.add_argument("--grace", type=float, default=WorkerConfig.grace_s, help="seconds to drain on SIGTERM")
    add_worker_token_arg(p, "require this shared secret from schedulers ('authorization: Bearer TOKEN')")
    p.add_argument(
        "--scheduler-timeout",
        type=float,
        default=WorkerConfig.scheduler_timeout_s,
        help="end a session whose scheduler sent nothing for this long with no step pending (a stopped "
        "or vanished scheduler), so that another can connect",
    )
    p.add_argument(
        "--link-socket",
        type=Path,
        default=None,
        metavar="PATH",
        help="also serve the scheduler link as frames on this unix socket (mode 0600), for a scheduler "
        "on this host (its --worker unix:PATH): less CPU per step than gRPC; --worker-token still "
        "applies, TLS does not",
    )
    add_observability_args(p, default_metrics_port=DEFAULT_METRICS_PORT)
    p.add_argument("--log-level", default=WorkerConfig.log_level)
    return p


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    config = parse_args(argv)
    setup_logging(config.log_level)
    try:
        place = rank_place(config)
        if place is None and config.tp is not None and config.tp > 1:  # start the ranks: this command
            check_shardable(config.placement.model, config.tp)  # what no restart can fix fails first
            sys.exit(Launcher(argv, config.tp, config.max_restarts, config.grace_s).run())
        if place is not None:
            run_rank(config, place)
        else:
            run_loop(serve(config))
    except (ValueError, OSError, PortInUse) as exc:  # a bad model, flag or port: say why, no traceback
        sys.exit(f"worker: {exc}")


def _dtype(value: str) -> str | None:
    try:
        return dtype_name(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
