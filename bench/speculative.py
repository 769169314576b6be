"""python -m bench.speculative [--quick] [--kinds KIND ...] [--out DIR]: speculative decoding
(prompt lookup) on SmolLM2-135M-Instruct through the services, with and without it side by side.

Three kinds of chat prompt: copy-heavy (repeat or lightly edit a passage or a function given in
the prompt, where prompt lookup finds the output's next tokens), free text (open questions,
where it finds few), and structured extraction (fields of a passage as JSON under a JSON Schema,
whose drafts pass the grammar's matcher). Two pairs of services run at once, the same but
for `--speculative-config` on one; for each kind and concurrency (1, 4, 16), rounds of a closed
loop of greedy requests against each, in turns (which goes first alternates), so that the
machine's drifts of speed fall on both sides alike. Greedy outputs are the same either way, so
both runs generate the same tokens. Reports output tok/s over all rounds and each round's ratio,
time per output token after the first (median over requests, then over rounds), the draft
acceptance rate and mean acceptance length (the worker's `stepahead_spec_decode_*` counters),
and the ratio of tok/s. The machine's speed is printed as the time of a pure Python loop.
`--kinds` runs some kinds only. Writes
bench/results/<UTC date-time>-speculative.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import time
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

import grpc

from bench.machine import loop_calibration
from bench.promtext import scrape, total
from bench.save import RESULTS, command_line, publish
from stepahead.processes import Service, serving_pair
from stepahead.v1 import generation_pb2 as pb
from stepahead.v1 import generation_pb2_grpc

NAME = "speculative"
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
CALL_TIMEOUT_S = 600.0

PASSAGE = (
    "The committee met on Tuesday to review the budget for the coming year. After a long "
    "discussion, the members agreed to increase funding for the library by ten percent, to "
    "repair the roof of the community hall before winter, and to hire two more teachers for the "
    "primary school. The chair thanked everyone for their patience and closed the meeting at six."
)
FUNCTION = """def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax
"""
COPY = (
    f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
    f"Rewrite this Python function, renaming the variable `subtotal` to `amount`:\n\n{FUNCTION}",
    f"Correct any spelling mistakes in this text and return it in full:\n\n{PASSAGE}",
    f"Copy this code exactly, adding a docstring:\n\n{FUNCTION}",
)
FREE = (
    "Write a short story about a fox who learns to swim.",
    "Explain why the sky is blue to a ten-year-old.",
    "What are three good habits for staying healthy?",
    "Describe a day at the beach in a few sentences.",
)
MEETING = {
    "type": "object",
    "properties": {
        "day": {"type": "string"},
        "decisions": {"type": "array", "items": {"type": "string"}},
        "closed_at": {"type": "string"},
    },
    "required": ["day", "decisions", "closed_at"],
    "additionalProperties": False,
}
PRICE = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "parameters": {"type": "array", "items": {"type": "string"}},
        "lines": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "parameters", "lines"],
    "additionalProperties": False,
}
EXTRACT = (
    f"List the day, each decision and the closing time of this meeting as JSON with the keys "
    f"day, decisions and closed_at:\n\n{PASSAGE}",
    f"Give this function's name, its parameters and each line of its body, as JSON with the keys "
    f"name, parameters and lines:\n\n{FUNCTION}",
)
SCHEMAS = (json.dumps(MEETING), json.dumps(PRICE))
# Each kind's prompts, and the JSON Schema each prompt's output follows ("" for none).
KINDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "copy": (COPY, ("",) * len(COPY)),
    "free": (FREE, ("",) * len(FREE)),
    "json": (EXTRACT, SCHEMAS),
}


@dataclass(frozen=True)
class Plan:
    name: str
    concurrencies: tuple[int, ...]
    requests_per_slot: int  # requests per round: this x the concurrency, at least min_requests
    max_tokens: int
    min_requests: int = 4
    rounds: int = 1  # per point and side, the two sides in turns; a point's figures sum its rounds

    def requests(self, concurrency: int) -> int:
        return max(self.min_requests, self.requests_per_slot * concurrency)


FULL = Plan("full", (1, 4, 16), 1, 96, rounds=4)
QUICK = Plan("quick", (1, 4), 1, 48, rounds=2)


@dataclass(frozen=True)
class Point:
    kind: str
    concurrency: int
    speculative: bool
    tokens: int
    seconds: float
    tpot_p50_ms: float
    drafts: float
    draft_tokens: float
    accepted: float
    verify_rows: float  # the scheduler's: verify rows processed
    verify_tokens: float  # and the tokens they emitted
    round_tok_s: tuple[float, ...] = ()  # each round's

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.draft_tokens if self.draft_tokens else None

    @property
    def mean_length(self) -> float | None:
        return 1 + self.accepted / self.drafts if self.drafts else None


async def one_request(
    stub: generation_pb2_grpc.GenerationAsyncStub, rid: str, prompt: str, max_tokens: int, schema: str = ""
) -> tuple[int, float]:
    """Tokens generated, and seconds per token after the first (0 with one token); `schema`:
    the JSON Schema the output follows ("": none)."""
    sampling = pb.SamplingParams(max_new_tokens=max_tokens)
    if schema:
        sampling.json_schema = schema
    request = pb.GenerateRequest(
        request_id=rid,
        messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=prompt)]),
        sampling=sampling,
    )
    arrivals: list[tuple[float, int]] = []
    async for response in stub.Generate(request, timeout=CALL_TIMEOUT_S):
        if response.token_ids:
            arrivals.append((time.perf_counter(), len(response.token_ids)))
    tokens = sum(n for _, n in arrivals)
    if tokens < 2:
        return tokens, 0.0
    return tokens, (arrivals[-1][0] - arrivals[0][0]) / (tokens - arrivals[0][1])


async def closed_loop(
    address: str,
    prompts: tuple[str, ...],
    concurrency: int,
    count: int,
    max_tokens: int,
    schemas: tuple[str, ...] = (),
) -> tuple[int, float, list[float]]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub: generation_pb2_grpc.GenerationAsyncStub = generation_pb2_grpc.GenerationStub(channel)
        queue = list(range(count))
        results: list[tuple[int, float]] = []

        async def worker() -> None:
            while queue:
                i = queue.pop(0)
                rid, schema = f"r{i}-{time.monotonic_ns()}", schemas[i % len(schemas)] if schemas else ""
                results.append(await one_request(stub, rid, prompts[i % len(prompts)], max_tokens, schema))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.perf_counter() - start
    return sum(t for t, _ in results), seconds, [s for t, s in results if t > 1]


def spec_counters(worker_url: str, scheduler_url: str) -> tuple[float, ...]:
    """The worker's drafts, draft tokens and accepted tokens; the scheduler's verify rows and
    their tokens."""
    worker, scheduler = scrape(worker_url), scrape(scheduler_url)
    names = ("drafts", "draft_tokens", "accepted_tokens")
    counts = [total(worker, f"stepahead_spec_decode_num_{name}_total") for name in names]
    counts += [total(scheduler, f"stepahead_spec_verify_{name}_total") for name in ("rows", "tokens")]
    return tuple(counts)


def run(
    plan: Plan, threads: int, kinds: tuple[str, ...] = tuple(KINDS), model: str = "smollm2"
) -> list[Point]:
    """Two pairs of services at once, one speculating; at each point the two runs in turns
    (which goes first alternates), so that a drift of the machine's speed falls on both."""
    points: list[Point] = []
    worker = ["--model", model, "--threads", str(threads), "--kv-slots", "8192"]
    with contextlib.ExitStack() as stack:
        pairs = {}
        for speculative in (False, True):
            flags = ["--speculative-config", json.dumps(SPECULATIVE)] if speculative else []
            pairs[speculative] = stack.enter_context(serving_pair(worker, flags))
            asyncio.run(closed_loop(pairs[speculative][1].address, FREE, 1, 1, 8))  # warm up
        turn = 0
        for kind in kinds:
            prompts = KINDS[kind]
            for concurrency in plan.concurrencies:
                rounds: dict[bool, list[Point]] = {False: [], True: []}
                for _ in range(plan.rounds):
                    for speculative in (False, True) if turn % 2 == 0 else (True, False):
                        w, scheduler = pairs[speculative]
                        rounds[speculative].append(
                            measure(w, scheduler, kind, prompts, concurrency, speculative, plan)
                        )
                    turn += 1
                for speculative in (False, True):
                    point = summed(rounds[speculative])
                    print(
                        f"  {kind} c={concurrency} speculative={speculative}: {point.tok_s:.1f} tok/s "
                        f"(rounds {', '.join(f'{t:.1f}' for t in point.round_tok_s)}), "
                        f"{point.verify_rows:.0f} verify rows, {point.verify_tokens:.0f} of their tokens",
                        flush=True,
                    )
                    points.append(point)
    return points


def summed(rounds: list[Point]) -> Point:
    """One point of a side's rounds: tokens, seconds and counts summed, the TPOT median of the
    rounds' medians."""
    first = rounds[0]
    return replace(
        first,
        tokens=sum(r.tokens for r in rounds),
        seconds=sum(r.seconds for r in rounds),
        tpot_p50_ms=statistics.median(r.tpot_p50_ms for r in rounds),
        drafts=sum(r.drafts for r in rounds),
        draft_tokens=sum(r.draft_tokens for r in rounds),
        accepted=sum(r.accepted for r in rounds),
        verify_rows=sum(r.verify_rows for r in rounds),
        verify_tokens=sum(r.verify_tokens for r in rounds),
        round_tok_s=tuple(r.tok_s for r in rounds),
    )


def measure(
    worker: Service,
    scheduler: Service,
    kind: str,
    prompts: tuple[tuple[str, ...], tuple[str, ...]],
    concurrency: int,
    speculative: bool,
    plan: Plan,
) -> Point:
    count = plan.requests(concurrency)
    before = spec_counters(worker.metrics_url, scheduler.metrics_url)
    texts, schemas = prompts
    tokens, seconds, tpots = asyncio.run(
        closed_loop(scheduler.address, texts, concurrency, count, plan.max_tokens, schemas)
    )
    after = spec_counters(worker.metrics_url, scheduler.metrics_url)
    drafts, draft_tokens, accepted, verify_rows, verify_tokens = (
        b - a for a, b in zip(before, after, strict=True)
    )
    tpot = statistics.median(tpots) * 1e3
    return Point(
        kind,
        concurrency,
        speculative,
        tokens,
        seconds,
        tpot,
        drafts,
        draft_tokens,
        accepted,
        verify_rows,
        verify_tokens,
        round_tok_s=(tokens / seconds,),
    )


def markdown(points: list[Point], command: str, calibration: float) -> str:
    def find(kind: str, c: int, spec: bool) -> Point:
        return next(p for p in points if (p.kind, p.concurrency, p.speculative) == (kind, c, spec))

    lines = [
        f"`{command}`, loop calibration {calibration:.2f} s, speculative config `{json.dumps(SPECULATIVE)}`",
        "",
        "| prompts | concurrency | tok/s without | tok/s with | ratio | rounds' ratios | TPOT p50 ms without "
        "| with | acceptance | mean acceptance length | verify rows | tokens per verify row |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for kind in dict.fromkeys(p.kind for p in points):
        for c in sorted({p.concurrency for p in points}):
            off, on = find(kind, c, False), find(kind, c, True)
            acceptance = "-" if on.acceptance is None else f"{on.acceptance:.2f}"
            length = "-" if on.mean_length is None else f"{on.mean_length:.2f}"
            per_row = f"{on.verify_tokens / on.verify_rows:.2f}" if on.verify_rows else "-"
            paired = zip(off.round_tok_s, on.round_tok_s, strict=True)
            ratios = ", ".join(f"{b / a:.2f}" for a, b in paired)
            lines.append(
                f"| {kind} | {c} | {off.tok_s:.1f} | {on.tok_s:.1f} | {on.tok_s / off.tok_s:.2f}x | "
                f"{ratios} | "
                f"{off.tpot_p50_ms:.1f} | {on.tpot_p50_ms:.1f} | {acceptance} | {length} | "
                f"{on.verify_rows:.0f} | {per_row} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.speculative", description=__doc__)
    p.add_argument("--quick", action="store_true", help="concurrency 1 and 4, shorter outputs")
    p.add_argument("--threads", type=int, default=2, help="the worker's torch threads (default 2)")
    p.add_argument(
        "--kinds", nargs="+", choices=tuple(KINDS), default=tuple(KINDS), help="prompt kinds (default: all)"
    )
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    plan = QUICK if args.quick else FULL
    started = datetime.now(UTC)
    calibration = loop_calibration()
    print(f"loop calibration: {calibration:.2f} s", flush=True)
    points = run(plan, args.threads, tuple(args.kinds))
    command = command_line("bench.speculative", argv)
    document = {
        "plan": asdict(plan),
        "calibration_s": calibration,
        "speculative": SPECULATIVE,
        "points": [asdict(p) for p in points],
    }
    publish(NAME, started, document, markdown(points, command, calibration), args.out)


if __name__ == "__main__":
    main()
