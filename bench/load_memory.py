"""python -m bench.load_memory: the worker's peak memory while it loads a GGUF, in each
quantization, for this checkout and (`--baseline REF`) another commit side by side.

A random Llama-architecture model of the given sizes is written as a GGUF (matrices Q8_0 or
Q4_0, as llama.cpp writes them) in a temporary directory; each code then loads it as the worker
does (`load_backend`: the model laid out for serving, quantized where asked), each load in a
fresh process, which prints its peak resident memory (`ru_maxrss`) and its time. The peak counts
the file's pages the load read (the file is memory-mapped; the kernel can drop those pages
again), so `file MiB` is printed beside it. Writes bench/results/<UTC date-time>-load-memory.{json,md}.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, quantize
from tokenizers import pre_tokenizers

from bench.baseline import checkout
from bench.machine import REPO, describe_machine, loop_calibration
from bench.save import RESULTS, command_line, publish

MODES = ("none", "int8", "int4")
TYPES = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}
# Run in a fresh process by each code: the load, then the peak and the time, as one line.
LOAD = """
import resource, sys, time, torch
from worker_svc.backends import load_backend
start = time.perf_counter()
backend = load_backend(sys.argv[1], torch.device("cpu"), torch.float32, 1.0, 0.0, quantization=sys.argv[2])
seconds = time.perf_counter() - start
status = open("/proc/self/status").read()
after = int(status.split("VmRSS:")[1].split()[0]) / 1024
peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, after)  # the high-water mark lags
tensors = [*backend.model.parameters(), *backend.model.buffers()]
held = sum(t.numel() * t.element_size() for t in tensors) / 2**20
print(peak, after, held, seconds)
"""


@dataclass(frozen=True)
class Sizes:
    hidden: int = 2048
    intermediate: int = 5632
    layers: int = 16
    heads: int = 32
    kv_heads: int = 4
    context: int = 2048
    vocab: int = 32000


@dataclass(frozen=True)
class LoadRow:
    code: str  # "this" or the baseline's short hash
    quantization: str
    peak_mib: float
    after_mib: float  # resident once loaded (the file's pages read, and the heap's free room, included)
    model_mib: float  # the served model's own weights and buffers, as laid out for serving
    seconds: float


def write_model(
    path: Path, sizes: Sizes, weights: GGMLQuantizationType, seed: int = 0, tied: bool = False
) -> int:
    """A random model as a GGUF at `path` (its tokenizer: bytes and one merge; `tied`: no output
    layer of its own, its embeddings are its head); returns its parameters."""
    rng = np.random.default_rng(seed)
    head_dim = sizes.hidden // sizes.heads
    tokens = ["<s>", "</s>", *sorted(pre_tokenizers.ByteLevel.alphabet()), "ab"]
    tokens += [f"<unused{i}>" for i in range(sizes.vocab - len(tokens))]
    writer = GGUFWriter(path, "llama")
    writer.add_block_count(sizes.layers)
    writer.add_context_length(sizes.context)
    writer.add_embedding_length(sizes.hidden)
    writer.add_feed_forward_length(sizes.intermediate)
    writer.add_head_count(sizes.heads)
    writer.add_head_count_kv(sizes.kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    kv = sizes.kv_heads * head_dim
    shapes = {"token_embd.weight": (len(tokens), sizes.hidden), "output_norm.weight": (sizes.hidden,)}
    if not tied:
        shapes["output.weight"] = (len(tokens), sizes.hidden)
    for i in range(sizes.layers):
        block = {
            "attn_norm": (sizes.hidden,),
            "attn_q": (sizes.hidden, sizes.hidden),
            "attn_k": (kv, sizes.hidden),
            "attn_v": (kv, sizes.hidden),
            "attn_output": (sizes.hidden, sizes.hidden),
            "ffn_norm": (sizes.hidden,),
            "ffn_gate": (sizes.intermediate, sizes.hidden),
            "ffn_up": (sizes.intermediate, sizes.hidden),
            "ffn_down": (sizes.hidden, sizes.intermediate),
        }
        shapes.update({f"blk.{i}.{name}.weight": shape for name, shape in block.items()})
    parameters = 0
    for name, shape in shapes.items():
        values = rng.normal(0.0, 0.02, size=shape).astype(np.float32)
        parameters += values.size
        if len(shape) == 1:
            writer.add_tensor(name, values + 1.0)
        else:
            writer.add_tensor(name, quantize(values, weights), raw_dtype=weights)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return parameters


def load_peak(code: Path, model: Path, quantization: str) -> tuple[float, float, float, float]:
    """Peak resident MiB, resident MiB once loaded, the model's own MiB, and the seconds of one
    load by the code at `code`, in a fresh process."""
    out = subprocess.run(
        [sys.executable, "-c", LOAD, str(model), quantization],
        cwd=code,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    return float(out[-4]), float(out[-3]), float(out[-2]), float(out[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.load_memory", description=__doc__)
    p.add_argument("--baseline", default=None, help="a commit to load beside this checkout")
    p.add_argument("--weights", choices=sorted(TYPES), default="q8_0", help="the file's matrices")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--layers", type=int, default=Sizes.layers)
    p.add_argument("--hidden", type=int, default=Sizes.hidden)
    p.add_argument("--intermediate", type=int, default=Sizes.intermediate)
    p.add_argument("--vocab", type=int, default=Sizes.vocab)
    p.add_argument("--tied", action="store_true", help="a tied model: its embeddings are its head")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    started_at = datetime.now(UTC)
    print(f"machine: loop calibration {loop_calibration():.2f} s", file=sys.stderr)
    sizes = Sizes(hidden=args.hidden, intermediate=args.intermediate, layers=args.layers, vocab=args.vocab)
    codes = {"this": REPO}
    if args.baseline is not None:
        baseline = checkout(args.baseline)
        codes = {baseline.commit[:12]: baseline.path, **codes}
    rows: list[LoadRow] = []
    with tempfile.TemporaryDirectory() as directory:
        model = Path(directory) / "model.gguf"
        parameters = write_model(model, sizes, TYPES[args.weights], tied=args.tied)
        file_mib = model.stat().st_size / 2**20
        for quantization in args.modes:
            for code, path in codes.items():
                rows.append(LoadRow(code, quantization, *load_peak(path, model, quantization)))
    lines = [
        f"# Peak memory of a GGUF load ({parameters / 1e6:.0f}M parameters, {args.weights}, "
        f"{'tied, ' if args.tied else ''}file {file_mib:,.0f} MiB)",
        "",
        f"`{command_line('bench.load_memory', argv)}`",
        "",
        "| quantization | code | peak MiB | resident after MiB | model MiB | load s | peak / first code's |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        first = next(r for r in rows if r.quantization == row.quantization)
        lines.append(
            f"| {row.quantization} | {row.code} | {row.peak_mib:,.0f} | {row.after_mib:,.0f} "
            f"| {row.model_mib:,.0f} | {row.seconds:.1f} | {row.peak_mib / first.peak_mib:.2f} |"
        )
    document = {
        "machine": describe_machine(),
        "sizes": asdict(sizes),
        "weights": args.weights,
        "parameters": parameters,
        "tied": args.tied,
        "file_mib": file_mib,
        "rows": [asdict(r) for r in rows],
    }
    publish("load-memory", started_at, document, "\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
