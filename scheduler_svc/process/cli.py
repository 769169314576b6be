"""The scheduler's command line: `parse_args` turns it into a frozen `SchedulerConfig` (no
`argparse.Namespace` goes further), `main` serves it.

python -m scheduler_svc --worker 127.0.0.1:50061 --port 50051 --mode overlap|serial --frontends N
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

from scheduler_svc.engine.core import CoreConfig
from scheduler_svc.engine.depth import MAX_DEPTH, DepthConfig, parse_depth
from scheduler_svc.engine.late_pick import LatePickConfig
from scheduler_svc.engine.policy import PolicyConfig
from scheduler_svc.frontend.api_config import ClientApiConfig
from scheduler_svc.frontend.frontend import FrontendConfig
from scheduler_svc.frontend.openai.config import HttpLimits, allowed_hosts
from scheduler_svc.frontend.reasoning import REASONING_PARSERS
from scheduler_svc.frontend.validation import RequestLimits
from scheduler_svc.process.app import serve
from scheduler_svc.process.config import (
    DEFAULT_GRACE_S,
    DEFAULT_METRICS_PORT,
    Observability,
    SchedulerConfig,
    WorkerConnection,
)
from scheduler_svc.process.socket_transport import socket_path
from scheduler_svc.process.worker_link import WorkerLinkConfig
from stepahead.serving import (
    API_KEY_ENV,
    add_observability_args,
    add_tls_server_args,
    add_worker_token_arg,
    check_tls_server_args,
    metrics_endpoint,
    pem_file,
    run_service,
    setup_logging,
    tls_files,
)
from stepahead.speculative import SpeculativeConfig, parse_speculative_config


def parse_args(argv: list[str] | None = None) -> SchedulerConfig:
    """Exits with a usage error naming the flag on a bad command line."""
    p = build_parser()
    args = p.parse_args(argv)
    check_tls_server_args(p, args, client_ca_required=False)
    check_worker_link_args(p, args)
    if args.overlap_depth != 1 and args.mode != "overlap":
        p.error("--overlap-depth: the serial loop launches one batch at a time (use --mode overlap)")
    if args.overlap_depth != 1 and args.late_pick:
        p.error("--overlap-depth: --late-pick holds the pick of k+1 for forward k; it needs depth 1")
    spec = args.speculative_config
    if spec is not None and args.max_batch_tokens < spec.num_speculative_tokens + 1:
        p.error(
            f"--max-batch-tokens: {args.max_batch_tokens} is below a verify row's "
            f"{spec.num_speculative_tokens + 1} tokens (--speculative-config num_speculative_tokens + 1)"
        )
    return config_from_args(args)


def config_from_args(args: argparse.Namespace) -> SchedulerConfig:
    limits = HttpLimits(head_timeout_s=args.http_head_timeout, body_pause_timeout_s=args.http_body_timeout)
    return SchedulerConfig(
        worker=WorkerConnection(
            args.worker,
            WorkerLinkConfig(
                args.worker_token,
                args.max_batch_tokens,
                args.worker_step_timeout,
                speculative=args.speculative_config,
            ),
            tls_files(args, "worker_tls"),
        ),
        core=CoreConfig(
            args.mode,
            PolicyConfig(
                args.max_batch_tokens,
                args.max_running,
                args.max_waiting,
                args.prefix_cache,
                args.speculative_config,
            ),
            worker_retry_timeout_s=args.worker_retry_timeout,
            worker_step_timeout_s=args.worker_step_timeout,
            late_pick=LatePickConfig(enabled=args.late_pick),
            depth=DepthConfig(args.overlap_depth),
        ),
        frontend=FrontendConfig(
            args.mode,
            RequestLimits(args.max_text_bytes, args.max_prompt_tokens),
            args.stream_interval,
            chat_template=args.chat_template,
        ),
        api=ClientApiConfig(
            args.host,
            args.port,
            args.http_port,
            tls_files(args),
            args.api_key,
            args.max_request_bytes,
            args.served_model_name,
            args.allowed_hosts,
            limits,
            access_log=args.access_log,
            separate_reasoning=args.reasoning_parser != "none",
        ),
        frontends=args.frontends,
        frontend_nice=args.frontend_nice,
        grace_s=args.grace,
        observability=Observability(
            metrics_endpoint(args), args.trace_file, args.log_level, args.worker_metrics_url
        ),
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m scheduler_svc", description="Stepahead scheduler")
    p.add_argument(
        "--worker",
        default=WorkerConnection.address,
        help="the worker: host:port (gRPC), or unix:PATH for a worker on this host serving "
        "--link-socket PATH (framed, less CPU per step)",
    )
    p.add_argument("--host", default=ClientApiConfig.host, help="address to bind (0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=ClientApiConfig.port)
    p.add_argument("--mode", choices=("overlap", "serial"), default=CoreConfig.mode)
    p.add_argument(
        "--frontends",
        type=_at_least(0),
        default=SchedulerConfig.frontends,
        help="frontend processes serving the client API on --port (SO_REUSEPORT); 0: serve it from "
        "the engine core's own process",
    )
    p.add_argument(
        "--frontend-nice",
        type=_at_least(0),
        default=SchedulerConfig.frontend_nice,
        help="niceness the frontend processes add to theirs, so that on a shared box the engine "
        "core's loop runs before them (0: the same priority)",
    )
    p.add_argument(
        "--stream-interval",
        type=_at_least(1),
        default=FrontendConfig.stream_interval,
        help="send a client its tokens every N tokens (and at the finish): coarser streaming, less CPU",
    )
    # The second spelling of a flag is vLLM's: a vLLM command line serves as it is.
    p.add_argument(
        "--max-batch-tokens",
        "--max-num-batched-tokens",
        type=_at_least(1),
        default=PolicyConfig.max_batch_tokens,
        help="token budget of one step; longer prompts are prefilled in chunks",
    )
    p.add_argument(
        "--max-running",
        "--max-num-seqs",
        type=_at_least(0),
        default=PolicyConfig.max_running,
        help="concurrent requests at most (0: the worker's request slots)",
    )
    p.add_argument(
        "--max-waiting",
        type=_at_least(1),
        default=PolicyConfig.max_waiting,
        help="requests that may wait for admission (at least 1: every new request waits for the "
        "next step); more get RESOURCE_EXHAUSTED at once",
    )
    p.add_argument(
        "--no-prefix-cache",
        "--no-enable-prefix-caching",
        dest="prefix_cache",
        action="store_false",
        help="compute every prompt in full: no reuse of the KV of cached prefixes",
    )
    p.add_argument(
        "--enable-prefix-caching",
        dest="prefix_cache",
        action="store_true",
        help="reuse the KV of cached prefixes (the default)",
    )
    p.add_argument(
        "--worker-retry-timeout",
        type=float,
        default=CoreConfig.worker_retry_timeout_s,
        help="seconds live requests wait for a lost worker to come back before ending with UNAVAILABLE",
    )
    p.add_argument(
        "--worker-step-timeout",
        type=float,
        default=CoreConfig.worker_step_timeout_s,
        help="a worker that says nothing for this long while a step or the handshake is pending is hung "
        "(it sends keepalives while a step computes, so a slow step is not): the session is dropped "
        "and its requests recomputed on the next one",
    )
    p.add_argument(
        "--speculative-config",
        type=_speculative,
        default=PolicyConfig.speculative,
        help='speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": K, '
        '"prompt_lookup_max": N, "prompt_lookup_min": M}: each decode row carries K drafts copied '
        "from its request's own tokens, verified in the same forward (the overlap loop; greedy "
        "and seeded output unchanged, with every sampling feature and grammar). Default: none",
    )
    p.add_argument(
        "--late-pick",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="overlap: pick batch k+1 shortly before forward k is expected to end rather than when it "
        "starts, so requests arriving meanwhile ride in k+1 (time to first token as in serial); the "
        "margin is steered to keep late wake-ups under 1%% of device time. Helps below saturation, "
        "hurts when the scheduler's CPU is the bottleneck (see docs/BENCHMARKS.md)",
    )
    p.add_argument(
        "--overlap-depth",
        type=_depth,
        default=DepthConfig.depth,
        metavar="N|auto",
        help="overlap: batches launched ahead of the one being processed (1: one step ahead). A slow "
        "worker link needs more: about (link round trip + scheduler CPU per step) / device step. "
        f"auto: chosen from those, measured, and adjusted as they change (1..{MAX_DEPTH})",
    )
    p.add_argument(
        "--grace", type=float, default=DEFAULT_GRACE_S, help="seconds in-flight requests get on SIGTERM"
    )
    p.add_argument("--log-level", default=Observability.log_level)
    add_observability_args(p, default_metrics_port=DEFAULT_METRICS_PORT)
    add_client_api_args(p)
    add_worker_link_args(p)
    return p


def add_client_api_args(p: argparse.ArgumentParser) -> None:
    add_tls_server_args(
        p,
        client_ca_help="also require client certificates signed by this CA (PEM): mutual TLS on the "
        "client API; without it the API is server-authenticated TLS",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"require 'authorization: Bearer KEY' metadata on the Generation API (default: ${API_KEY_ENV}, "
        "which, unlike the flag, does not show in the process list)",
    )
    p.add_argument(
        "--http-port",
        type=_at_least(0),
        default=ClientApiConfig.http_port,
        help="port of the OpenAI-compatible HTTP API, on --host with the same TLS and API key (0: off)",
    )
    p.add_argument(
        "--http-head-timeout",
        type=float,
        default=HttpLimits.head_timeout_s,
        help="seconds an HTTP client has to send a whole request head (408 beyond: slowloris)",
    )
    p.add_argument(
        "--http-body-timeout",
        type=float,
        default=HttpLimits.body_pause_timeout_s,
        help="seconds an HTTP request body may pause (408 beyond)",
    )
    p.add_argument(
        "--allowed-hosts",
        type=allowed_hosts,
        default=(),
        help="comma-separated Host names the HTTP API answers to, e.g. 'localhost,127.0.0.1,"
        "*.example.com' (any other: 400; /health answers any): a guard against DNS rebinding "
        "(default: any host)",
    )
    p.add_argument(
        "--worker-metrics-url",
        metavar="URL",
        help="also serve the worker's series on the HTTP API's /metrics: its exposition at URL "
        "(http://HOST:PORT/metrics), fetched at each scrape (stepahead serve sets it)",
    )
    p.add_argument(
        "--access-log",
        action="store_true",
        help="log a line for each HTTP request once its response has ended (logger stepahead.access, "
        "INFO): client, method, path, status, time, X-Request-Id",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default="auto",
        help="a reasoning model's thinking on the HTTP chat API: auto (default) splits it from the "
        "answer, as reasoning_content, where the chat template writes </think> (Qwen3, QwQ, "
        "DeepSeek-R1's distills, SmolLM3); deepseek_r1 and qwen3, vLLM's names for the same <think> "
        "split, are taken as auto; none leaves it in the content",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model's name on the HTTP API (`model`, /v1/models); default: the worker's",
    )
    p.add_argument(
        "--chat-template",
        type=text_file,
        metavar="FILE",
        help="Jinja chat template used in place of the model's own (for models without one)",
    )
    # vLLM's tool-calling flags, so that its command lines serve: here tools are always served
    # (`tool_choice` auto among them), their calls written as hermes's (scheduler_svc/frontend/tools.py).
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="vLLM's: accepted; tool_choice auto is always served",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=("hermes",),
        help="vLLM's: accepted for the one format served, hermes's <tool_call> JSON </tool_call>",
    )
    p.add_argument(
        "--max-request-bytes",
        type=_at_least(1),
        default=ClientApiConfig.max_request_bytes,
        help="largest request message accepted; gRPC answers a larger one RESOURCE_EXHAUSTED",
    )
    p.add_argument(
        "--max-text-bytes",
        type=_at_least(1),
        default=RequestLimits.max_text_bytes,
        help="longest input.text in UTF-8 bytes, checked before it is tokenized",
    )
    p.add_argument(
        "--max-prompt-tokens",
        type=_at_least(0),
        default=RequestLimits.max_prompt_tokens,
        help="longest prompt in tokens (0: the model's context length)",
    )


def add_worker_link_args(p: argparse.ArgumentParser) -> None:
    add_worker_token_arg(p, "present this shared secret to the worker (its --worker-token)")
    p.add_argument(
        "--worker-tls-ca",
        type=pem_file,
        metavar="PEM",
        help="reach the worker over TLS, trusting this CA (PEM) for the worker's certificate",
    )
    p.add_argument(
        "--worker-tls-cert",
        type=pem_file,
        metavar="PEM",
        help="client certificate (PEM) shown to the worker, which requires one signed by its --tls-ca",
    )
    p.add_argument("--worker-tls-key", type=pem_file, metavar="PEM", help="private key of --worker-tls-cert")


def check_worker_link_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if (args.worker_tls_cert is None) != (args.worker_tls_key is None):
        p.error("--worker-tls-cert and --worker-tls-key go together")
    if args.worker_tls_cert is not None and args.worker_tls_ca is None:
        p.error("--worker-tls-cert needs --worker-tls-ca")
    path = socket_path(args.worker)
    if path is not None and args.worker_tls_ca is not None:
        p.error("--worker-tls-ca: the worker's unix socket takes no TLS (--worker unix:PATH)")
    if path == "":
        p.error("--worker unix:PATH: the socket's path is missing")


def text_file(path: str) -> str:
    """argparse type: a text file's contents, read once at startup."""
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {exc}") from exc


def _speculative(text: str) -> SpeculativeConfig:
    try:
        return parse_speculative_config(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def _depth(value: str) -> int:
    try:
        return parse_depth(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv: list[str] | None = None) -> None:
    config = parse_args(sys.argv[1:] if argv is None else argv)
    setup_logging(config.observability.log_level)
    run_service("scheduler", serve(config))
