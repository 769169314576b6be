"""The worker's configuration: frozen dataclasses that `cli.parse_args` returns and the wiring
(`app.py`) reads; the flags take their defaults from here, each written once."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from stepahead.serving import MetricsEndpoint, TlsFiles
from worker_svc.server import DEFAULT_SCHEDULER_TIMEOUT_S

DEFAULT_METRICS_PORT = 9401


@dataclass(frozen=True)
class ModelPlacement:
    """Which model, on what device, in which dtype, with how many CPU threads."""

    model: str = "tiny"  # tiny, sim, smollm2, a Llama .gguf file or checkpoint dir
    device: str | None = None  # None: cuda if present
    dtype: str | None = None  # None: float32 on cpu, bfloat16 on cuda
    threads: int = 0  # torch CPU threads (0: torch's default, or the cores shared among ranks)
    sim_step_ms: float = 10.0  # sim: fixed time per step
    sim_token_us: float = 2.0  # sim: extra time per token
    # A tokenizer.json, or a directory holding one (and tokenizer_config.json), for a checkpoint
    # without one (None: the model's own)
    tokenizer: Path | None = None
    # The longest prompt + completion served, at most the model's (None: the model's)
    max_model_len: int | None = None
    # Weights kept as none, int8 or int4 on the CPU (worker_svc.quantization)
    quantization: str = "none"


@dataclass(frozen=True)
class WorkerConfig:
    placement: ModelPlacement = field(default_factory=ModelPlacement)
    host: str = "127.0.0.1"
    port: int = 50061
    tls: TlsFiles = field(default_factory=TlsFiles)  # `ca`: the CA schedulers' certificates are signed by
    kv_slots: int = 16384  # KV pool size in tokens
    kv_memory_mib: float | None = None  # instead: the pool sized by memory on each rank
    request_slots: int = 256  # concurrent requests at most
    tp: int | None = None  # tensor-parallel ranks (None: 1, or torchrun's world size)
    max_restarts: int = 3  # --tp N: the group is started again this many times at most
    check_invariants: bool = False  # fail a step that reads an unwritten FutureMap entry
    grace_s: float = 5.0  # draining on SIGTERM
    worker_token: str | None = None  # the schedulers' shared secret (None: none asked)
    scheduler_timeout_s: float = DEFAULT_SCHEDULER_TIMEOUT_S
    metrics: MetricsEndpoint = field(default_factory=lambda: MetricsEndpoint(port=DEFAULT_METRICS_PORT))
    trace_file: Path | None = None
    log_level: str = "info"
    # --link-socket: also serve sessions as frames on this unix socket (a scheduler on this host)
    link_socket: Path | None = None
