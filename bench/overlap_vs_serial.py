"""Serial vs overlap over gRPC, side by side in one run, on the same workload.

    python -m bench.overlap_vs_serial [--model sim|tiny|both] [--concurrency 64]

Each configuration gets a fresh worker + scheduler pair on 127.0.0.1; clients
send the same prompts (ignore_eos, fixed output length) with a fixed number of
streams in flight; output tokens/s is tokens received / wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from dataclasses import dataclass

import grpc

from stepahead.processes import serving_pair
from stepahead.v1 import generation_pb2 as pb
from stepahead.v1 import generation_pb2_grpc


@dataclass(frozen=True)
class Workload:
    num_requests: int
    concurrency: int
    prompt_len: int
    output_len: int


@dataclass(frozen=True)
class Outcome:
    output_tokens: int
    seconds: float
    ttft_p50_ms: float

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


WORKER_ARGS = {
    "sim": ["--model", "sim", "--sim-step-ms", "10", "--sim-token-us", "0"],
    "tiny": ["--model", "tiny"],
}
WORKLOADS = {
    "sim": Workload(num_requests=512, concurrency=64, prompt_len=32, output_len=64),
    "tiny": Workload(num_requests=96, concurrency=32, prompt_len=32, output_len=48),
}


async def one_request(
    stub: generation_pb2_grpc.GenerationAsyncStub, prompt: list[int], n: int
) -> tuple[int, float]:
    started = time.perf_counter()
    first = 0.0
    tokens = 0
    req = pb.GenerateRequest(
        input_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(max_new_tokens=n, ignore_eos=True)
    )
    async for response in stub.Generate(req):
        if not tokens:
            first = time.perf_counter() - started
        tokens += len(response.token_ids)
    return tokens, first


async def drive(address: str, work: Workload, seed: int) -> Outcome:
    rng = random.Random(seed)
    prompts = [[rng.randrange(32, 127) for _ in range(work.prompt_len)] for _ in range(work.num_requests)]
    limit = asyncio.Semaphore(work.concurrency)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def bounded(prompt: list[int]) -> tuple[int, float]:
            async with limit:
                return await one_request(stub, prompt, work.output_len)

        await bounded(prompts[0])  # warm-up
        started = time.perf_counter()
        results = await asyncio.gather(*(bounded(p) for p in prompts))
        seconds = time.perf_counter() - started
    ttft = statistics.median(first for _, first in results) * 1e3
    return Outcome(sum(tokens for tokens, _ in results), seconds, ttft)


def run_config(model: str, mode: str, work: Workload) -> Outcome:
    with serving_pair(WORKER_ARGS[model], ["--mode", mode]) as (_, scheduler):
        return asyncio.run(drive(scheduler.address, work, seed=0))


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.overlap_vs_serial")
    p.add_argument("--model", choices=("sim", "tiny", "both"), default="both")
    p.add_argument("--concurrency", type=int, default=0, help="override the workload's concurrency")
    args = p.parse_args()
    models = ("sim", "tiny") if args.model == "both" else (args.model,)
    print("| model | mode | requests x tokens | concurrency | output tok/s | TTFT p50 ms |")
    print("|---|---|---|---|---|---|")
    for model in models:
        work = WORKLOADS[model]
        if args.concurrency:
            work = Workload(work.num_requests, args.concurrency, work.prompt_len, work.output_len)
        got = {}
        for mode in ("serial", "overlap"):
            got[mode] = run_config(model, mode, work)
            o = got[mode]
            print(
                f"| {model} | {mode} | {work.num_requests} x {work.output_len} | {work.concurrency} "
                f"| {o.tokens_per_s:,.0f} | {o.ttft_p50_ms:.1f} |",
                flush=True,
            )
        ratio = got["overlap"].tokens_per_s / got["serial"].tokens_per_s
        print(f"| {model} | overlap/serial | | | {ratio:.3f} | |", flush=True)


if __name__ == "__main__":
    main()
