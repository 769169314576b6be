"""python -m bench.frontend_stalls [--quick]: how long one large request stalls a frontend's event
loop (where every stream the frontend serves is written), done on the loop as before and as the
frontend does it now, side by side in one run.

A: tokenizing a 1 MiB prompt (words, digits, accents, CJK) with SmolLM2's tokenizer: called on
   the loop, and on the frontend's tokenizer thread (the library lets go of the GIL there).
B: building a whole (unstreamed) chat response of 12,000 tokens with 20 alternatives each
   (252,000 log-probabilities, just under the cap): formatted and encoded at once, and by
   `openai_api._whole_body`, a slice at a time.

The stall is the longest gap between turns of a task that only yields (`asyncio.sleep(0)`);
each figure is the best of --repeats. Prints the machine and a table.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from bench.machine import describe_machine
from scheduler_svc.contract import FinishReason, TokenLogprob
from scheduler_svc.frontend.openai import routes as openai_api
from scheduler_svc.frontend.openai.protocol import ChatLogprobs, ResponseIds
from scheduler_svc.frontend.tokenizer import HFTokenizer
from worker_svc.gguf import smollm2_path, tokenizer_from_gguf

WORDS = ["the", "quick", "brown", "fox", "jumps", "café", "naïve", "数据", "模型", "1234", "\n"]


@dataclass(frozen=True)
class Stall:
    total_s: float
    longest_stall_s: float


async def stalls(work: Callable[[], Awaitable[object]]) -> Stall:
    gaps: list[float] = []

    async def ticker() -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    task = asyncio.ensure_future(ticker())
    await asyncio.sleep(0)
    start = time.perf_counter()
    await work()
    total = time.perf_counter() - start
    task.cancel()
    return Stall(total, max(gaps, default=total))


def prompt(size: int, rng: random.Random) -> str:
    words: list[str] = []
    length = 0
    while length < size:
        words.append(rng.choice(WORDS))
        length += len(words[-1].encode()) + 1
    return " ".join(words)


def whole_choice(tokens: int, rng: random.Random) -> openai_api.Choice:
    choice = openai_api.Choice(0, ChatLogprobs(lambda t: b"tok%d" % t))
    choice.token_ids = [rng.randrange(49152) for _ in range(tokens)]
    choice.token_logprobs = [
        TokenLogprob(
            -0.5, tuple(rng.randrange(49152) for _ in range(20)), tuple(-rng.random() for _ in range(20))
        )
        for _ in range(tokens)
    ]
    choice.texts, choice.finish, choice.completion_tokens = ["x" * tokens], FinishReason.LENGTH, tokens
    return choice


async def measure(quick: bool, repeats: int) -> list[tuple[str, Stall, Stall]]:
    rng = random.Random(0)
    tokenizer = HFTokenizer(tokenizer_from_gguf(smollm2_path()).to_str().encode())
    text = prompt((64 << 10) if quick else (1 << 20), rng)
    threads = concurrent.futures.ThreadPoolExecutor(1)
    loop = asyncio.get_running_loop()

    async def on_loop() -> object:
        return tokenizer.encode(text)

    async def on_thread() -> object:
        return await loop.run_in_executor(threads, tokenizer.encode, text)

    tokens = 600 if quick else 12_000
    ids = ResponseIds("chatcmpl-bench", "bench", "chat")
    rows = []
    for name, before, after in [
        (f"tokenize a {len(text.encode()) / (1 << 20):.2f} MiB prompt", on_loop, on_thread),
        (f"build a whole response of {tokens * 21:,} log-probabilities", None, None),
    ]:
        best_before, best_after = None, None
        for _ in range(repeats):
            if before is None:
                at_once_choice, sliced_choice = whole_choice(tokens, rng), whole_choice(tokens, rng)

                async def at_once(c: openai_api.Choice = at_once_choice) -> object:
                    return json.dumps(ids.body([c.take(ids, chunk=False)], (1, tokens, 0, 0))).encode()

                async def sliced(c: openai_api.Choice = sliced_choice) -> object:
                    return await openai_api._whole_body(ids, [c], (1, tokens, 0, 0))

                b, a = await stalls(at_once), await stalls(sliced)
                del at_once_choice, sliced_choice
            else:
                assert after is not None
                b, a = await stalls(before), await stalls(after)
            best_before = (
                b if best_before is None or b.longest_stall_s < best_before.longest_stall_s else best_before
            )
            best_after = (
                a if best_after is None or a.longest_stall_s < best_after.longest_stall_s else best_after
            )
        assert best_before is not None and best_after is not None
        rows.append((name, best_before, best_after))
    threads.shutdown()
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.frontend_stalls", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a 64 KiB prompt and 600 tokens: a smoke run")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    machine = describe_machine()
    print(
        f"machine: {machine['nproc']} CPUs ({machine['cpu_model']}), Python {machine['python']}, "
        f"load {machine['load_average_1m']}, commit {str(machine['git_commit'])[:10]}"
    )
    rows = asyncio.run(measure(args.quick, args.repeats))
    print("| work | on the loop: total / longest stall | as served: total / longest stall | stall ratio |")
    print("|---|---|---|---|")
    for name, before, after in rows:
        ratio = before.longest_stall_s / max(after.longest_stall_s, 1e-6)
        print(
            f"| {name} | {before.total_s * 1e3:.0f} / {before.longest_stall_s * 1e3:.0f} ms | "
            f"{after.total_s * 1e3:.0f} / {after.longest_stall_s * 1e3:.0f} ms | {ratio:.1f}x |"
        )


if __name__ == "__main__":
    main()
