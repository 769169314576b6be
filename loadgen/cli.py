"""python -m loadgen: benchmark a Stepahead scheduler over its Generation API or its
OpenAI-compatible HTTP API."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path

from loadgen.backend import BACKENDS, GRPC_BACKENDS, BackendError, Constrained, SamplingFeatures
from loadgen.benchmark import (
    DEFAULT_BASE_URL,
    DEFAULT_CONNECTIONS,
    BenchmarkConfig,
    BenchmarkResult,
    run_benchmark,
)
from loadgen.progress import ProgressBar
from loadgen.report import format_summary, write_result
from loadgen.stats import parse_slos
from loadgen.workload import (
    Dataset,
    JsonlDataset,
    PrefixRepetitionDataset,
    RandomDataset,
    WorkloadError,
    load_workload,
)
from stepahead import event_loop

DEFAULT_NUM_PROMPTS = 1000
EXIT_INTERRUPTED = 130
EXIT_BAD_SETUP = 2
API_KEY_ENV = "OPENAI_API_KEY"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadgen",
        description="Load generator for stepahead.v1.Generation or an OpenAI-compatible HTTP API: "
        "throughput and latency (TTFT, TPOT, ITL, E2E) under a chosen arrival process.",
    )
    _add_backend_args(parser)
    _add_load_args(parser)
    _add_dataset_args(parser)
    _add_sampling_args(parser)
    _add_structured_args(parser)
    _add_output_args(parser)
    return parser


def _add_backend_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("backend")
    group.add_argument(
        "--backend",
        choices=BACKENDS,
        default="grpc",
        help="grpc (default): stepahead.v1.Generation, a Generate call a request; grpc-many: one "
        "GenerateMany call a connection, carrying all its requests; openai: streaming /v1/completions; "
        "openai-chat: streaming /v1/chat/completions (text prompts only)",
    )
    group.add_argument(
        "--server",
        default="127.0.0.1:50051",
        metavar="HOST:PORT[,HOST:PORT...]",
        help="grpc: the scheduler; replicas: several, comma-separated, or one target URI "
        "(dns:///NAME:PORT, ipv4:..., ipv6:...), each connection going round robin over them",
    )
    group.add_argument(
        "--base-url",
        default=DEFAULT_BASE_URL,
        metavar="URL[,URL...]",
        help=f"openai*: the server, without /v1 (default {DEFAULT_BASE_URL}); replicas: several, "
        "comma-separated, request i going to the (i mod n)-th",
    )
    group.add_argument(
        "--model", default=None, help="openai*: the model to name (default: the first of /v1/models)"
    )
    group.add_argument(
        "--api-key",
        default=None,
        help=f"openai*: sent as 'Authorization: Bearer KEY' (default: ${API_KEY_ENV})",
    )


def _add_load_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("load")
    group.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help=f"requests to send (default {DEFAULT_NUM_PROMPTS}, or unbounded with --duration)",
    )
    group.add_argument(
        "--duration",
        type=float,
        default=None,
        help="seconds to keep issuing requests; in-flight ones then finish",
    )
    group.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second; inf (default) sends all at once",
    )
    group.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the inter-arrival times: 1 is Poisson, <1 burstier, >1 steadier",
    )
    group.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    group.add_argument(
        "--connections",
        type=int,
        default=None,
        help="grpc: TCP connections to the server, request i goes over connection i mod N "
        f"(default {DEFAULT_CONNECTIONS}); openai*: at most N pooled HTTP connections, so at most N "
        "requests in flight (default: no cap)",
    )
    group.add_argument("--warmup", type=int, default=0, help="requests sent and awaited first, not measured")
    group.add_argument("--seed", type=int, default=0, help="seed of the workload and of the arrivals")


def _add_dataset_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--dataset", choices=("random", "jsonl", "prefix-repetition"), default="random")
    group.add_argument(
        "--dataset-path",
        type=Path,
        default=None,
        help='jsonl: one {"prompt": ..., "output_len": ...} object per line',
    )
    group.add_argument(
        "--default-output-len", type=int, default=128, help="jsonl: output length of lines without output_len"
    )
    group.add_argument("--random-input-len", type=int, default=1024)
    group.add_argument("--random-output-len", type=int, default=128)
    group.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="r: lengths uniform in [len*(1-r), len*(1+r)], 0 <= r < 1",
    )
    group.add_argument(
        "--prompt-as-text",
        action="store_true",
        help="random, prefix-repetition: send printable ASCII text instead of token ids",
    )
    _add_prefix_repetition_args(parser)


def _add_prefix_repetition_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("prefix-repetition workload (vllm bench serve's prefix_repetition)")
    d = PrefixRepetitionDataset()
    flags = (
        ("prefix-len", d.prefix_len, "tokens of each shared prefix"),
        ("suffix-len", d.suffix_len, "tokens of each request's own suffix, after its prefix"),
        ("num-prefixes", d.num_prefixes, "distinct prefixes; request i starts with prefix i mod N"),
        ("output-len", d.output_len, "new tokens per request"),
    )
    for name, default, meaning in flags:
        group.add_argument(
            f"--prefix-repetition-{name}",
            type=int,
            default=default,
            metavar="N",
            help=f"{meaning} (default {default})",
        )


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--ignore-eos", action="store_true", help="generate exactly the output length")
    group.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    group.add_argument("--top-p", type=float, default=None, help="nucleus mass in (0, 1]")
    group.add_argument("--top-k", type=int, default=0, help="0 (default) is off")
    group.add_argument("--repetition-penalty", type=float, default=None, help="> 0; 1 is off")
    group.add_argument("--presence-penalty", type=float, default=0.0, help="-2..2; 0 (default) is off")
    group.add_argument("--frequency-penalty", type=float, default=0.0, help="-2..2; 0 (default) is off")
    group.add_argument("--min-tokens", type=int, default=0, help="no EOS or stop before this many tokens")
    group.add_argument(
        "--logprobs", type=int, default=None, metavar="N", help="return log-probabilities with N alternatives"
    )
    group.add_argument(
        "--logit-bias",
        nargs="+",
        default=[],
        metavar="ID:BIAS",
        help="bias added to a token id's logit, e.g. 13:-100 42:5",
    )


def _add_structured_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("structured output")
    group.add_argument(
        "--constrained-fraction",
        type=float,
        default=None,
        metavar="F",
        help="the fraction of requests whose output is held to a JSON Schema (grpc: json_schema; "
        "openai*: response_format json_schema), spread evenly over them (default 0, or 1 with --json-schema)",
    )
    group.add_argument(
        "--json-schema",
        type=Path,
        default=None,
        metavar="FILE",
        help="the JSON Schema of the constrained requests (default: a small built-in one)",
    )


def _add_output_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("results")
    group.add_argument(
        "--goodput",
        nargs="+",
        default=[],
        metavar="METRIC:MS",
        help="SLOs for request goodput, any of ttft:MS tpot:MS e2el:MS",
    )
    group.add_argument(
        "--save-result", type=Path, default=None, metavar="FILE", help="write the results as JSON"
    )
    group.add_argument("--save-detailed", action="store_true", help="add per-request arrays to the JSON")
    group.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def config_from_args(args: argparse.Namespace) -> BenchmarkConfig:
    """Raises ValueError naming what is wrong with the arguments."""
    num_prompts = args.num_prompts
    if num_prompts is None and args.duration is None:
        num_prompts = DEFAULT_NUM_PROMPTS
    return BenchmarkConfig(
        backend=args.backend,
        server=args.server,
        base_url=args.base_url,
        model=args.model,
        api_key=api_key_from_args(args),
        dataset=dataset_from_args(args),
        num_prompts=num_prompts,
        duration_s=args.duration,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        connections=args.connections,
        seed=args.seed,
        warmup=args.warmup,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        features=features_from_args(args),
        constrained=constrained_from_args(args),
        slos=parse_slos(args.goodput),
    )


def features_from_args(args: argparse.Namespace) -> SamplingFeatures:
    return SamplingFeatures(
        top_p=args.top_p,
        top_k=args.top_k,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        min_tokens=args.min_tokens,
        logprobs=args.logprobs,
        logit_bias=parse_logit_bias(args.logit_bias),
    )


def constrained_from_args(args: argparse.Namespace) -> Constrained:
    """--json-schema without --constrained-fraction constrains every request."""
    fraction: float | None = args.constrained_fraction
    path: Path | None = args.json_schema
    if path is None:
        return Constrained() if fraction is None else Constrained(fraction)
    try:
        schema = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--json-schema: cannot read {path}: {exc}") from None
    try:
        return Constrained(1.0 if fraction is None else fraction, schema)
    except ValueError as exc:
        raise ValueError(f"--json-schema {path}: {exc}") from None


def parse_logit_bias(entries: list[str]) -> dict[int, float]:
    """`ID:BIAS` pairs; ValueError naming the bad one."""
    bias = {}
    for entry in entries:
        token, sep, value = entry.partition(":")
        try:
            bias[int(token)] = float(value)
        except ValueError:
            raise ValueError(f"--logit-bias: {entry!r} is not ID:BIAS") from None
        if not sep:
            raise ValueError(f"--logit-bias: {entry!r} is not ID:BIAS")
    return bias


def api_key_from_args(args: argparse.Namespace) -> str | None:
    if args.backend in GRPC_BACKENDS:
        return None
    key: str | None = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    return key or None


def dataset_from_args(args: argparse.Namespace) -> Dataset:
    if args.dataset == "random":
        return RandomDataset(
            args.random_input_len, args.random_output_len, args.random_range_ratio, args.prompt_as_text
        )
    if args.dataset == "prefix-repetition":
        return PrefixRepetitionDataset(
            args.prefix_repetition_prefix_len,
            args.prefix_repetition_suffix_len,
            args.prefix_repetition_num_prefixes,
            args.prefix_repetition_output_len,
            args.prompt_as_text,
        )
    if args.dataset_path is None:
        raise ValueError("--dataset jsonl needs --dataset-path")
    return JsonlDataset(args.dataset_path, args.default_output_len)


async def run_until_interrupted(config: BenchmarkConfig, progress: ProgressBar | None) -> BenchmarkResult:
    """The first Ctrl-C stops the run and keeps what completed; a second one aborts."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_sigint() -> None:
        stop.set()
        loop.remove_signal_handler(signal.SIGINT)

    loop.add_signal_handler(signal.SIGINT, on_sigint)
    print(describe(config), file=sys.stderr, flush=True)
    try:
        return await run_benchmark(config, stop, progress)
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        if progress is not None:
            await progress.close()


def describe(config: BenchmarkConfig) -> str:
    count = "unbounded" if config.num_prompts is None else str(config.num_prompts)
    limit = "" if config.duration_s is None else f" for {config.duration_s:g} s"
    concurrency = "" if config.max_concurrency is None else f", at most {config.max_concurrency} in flight"
    fraction = config.constrained.fraction
    constrained = f", {fraction * 100:g}% of them held to a JSON Schema" if fraction else ""
    return (
        f"Starting benchmark: {count} requests{limit} to {config.target} ({_api(config)}) over "
        f"{_connections(config)} at {config.request_rate:g} req/s (burstiness {config.burstiness:g})"
        f"{concurrency}{constrained}"
    )


def _api(config: BenchmarkConfig) -> str:
    if config.backend in GRPC_BACKENDS:
        return config.backend
    return f"{config.backend}, model {config.model or 'from /v1/models'}"


def _connections(config: BenchmarkConfig) -> str:
    limit = config.connection_limit
    if config.backend in GRPC_BACKENDS:
        return f"{limit} connections"
    return "an uncapped connection pool" if limit is None else f"a pool of at most {limit} connections"


def run(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        load_workload(config.dataset, config.seed)  # a bad dataset stops us before any request
    except WorkloadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_SETUP
    show_progress = not args.no_progress and sys.stderr.isatty()
    progress = ProgressBar(sys.stderr, config.num_prompts, config.duration_s) if show_progress else None
    try:
        result = event_loop.run(run_until_interrupted(config, progress))
    except BackendError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_SETUP
    print(format_summary(result), flush=True)
    if args.save_result is not None and not save(args.save_result, result, args.save_detailed):
        return 1
    return EXIT_INTERRUPTED if result.interrupted else 0


def save(path: Path, result: BenchmarkResult, detailed: bool) -> bool:
    try:
        write_result(path, result, detailed)
    except OSError as exc:
        print(f"error: cannot write {path}: {exc.strerror}", file=sys.stderr)
        return False
    print(f"Saved the result to {path}", file=sys.stderr)
    return True


def main(argv: list[str] | None = None) -> None:
    sys.exit(run(argv))
