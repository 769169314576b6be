"""python -m bench.tool_masks [--quick] [--out DIR]: what tool calling costs per token, on the
worker (the grammar's masks) and in the frontend (`CallStream`'s split of the text), beside the
costs it is compared with, in one run.

Worker: a `MatcherTable` over SmolLM2's tokenizer (49,152 ids) fills the masks of B = 16 rows
as the grammar thread does each step, the rows walking a text a token a step (a state filled
before would come from llguidance's cache); per row and step, the best of R walks:
  json schema        a response_format JSON Schema (the weather tool's), through a string value;
  auto, free text    `tool_choice: auto` through 80 characters of text (no call begun);
  auto, in a call    `auto` through a call's arguments, after text;
  required, in call  `required` through a call's arguments.
Frontend: the text of a reply (40 characters of content, then two calls) in SmolLM2's tokens,
pushed a token's text at a time through `CallStream`, against the same text through the
incremental detokenizer and stop-string matcher every request has (`RequestText`); microseconds
per token, best of R.

Writes bench/results/<UTC date-time>-tool_masks.{json,md} and prints the table.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import gguf

from bench.machine import describe_machine, measured_on
from bench.save import RESULTS, command_line, publish
from scheduler_svc.frontend.text import RequestText
from scheduler_svc.frontend.tokenizer import load_tokenizer
from scheduler_svc.frontend.tools import CallStream, Tool, ToolCall, ToolChoice, render_call, tool_constraint
from stepahead.protocol import Constraint, TokenizerSpec
from worker_svc.gguf import config_from_gguf, smollm2_path, tokenizer_from_gguf
from worker_svc.grammar import MatcherTable, grammar_tokenizer, new_bitmask

ROWS = 16
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [Tool("get_weather", "weather", json.dumps(WEATHER)), Tool("add", "a + b", json.dumps(ADD))]
CONTENT = "Let me look that up for you, one moment. "
CALLS = render_call(ToolCall("get_weather", '{"city": "Paris", "unit": "celsius"}')) + render_call(
    ToolCall("add", '{"a": 17, "b": 25}')
)


def states() -> list[tuple[str, Constraint, str, str]]:
    """(name, constraint, the text before, the text the rows then walk through)."""
    auto = tool_constraint(TOOLS, ToolChoice("auto"))
    required = tool_constraint(TOOLS, ToolChoice("required"))
    assert auto is not None and required is not None
    in_call = '<tool_call>{"name": "get_weather", "arguments": {"city": "'
    city = 'Saint-Remy-de-Provence", "unit": "celsius"}}</tool_call>'
    return [
        ("json schema", Constraint("json", json.dumps(WEATHER)), '{"city": "', city[: -len("}</tool_call>")]),
        ("auto, free text", auto, "", CONTENT + CONTENT),
        ("auto, in a call", auto, CONTENT + in_call, city),
        ("required, in a call", required, in_call, city),
    ]


def best_us(work: Callable[[], float], repeats: int, per: int) -> float:
    """The least of `repeats` runs of `work` (which times itself), per `per`, in microseconds."""
    return min(work() for _ in range(repeats)) / per * 1e6


def timed(work: Callable[[], object]) -> Callable[[], float]:
    def run() -> float:
        start = time.perf_counter()
        work()
        return time.perf_counter() - start

    return run


def mask_costs(spec: TokenizerSpec, vocab: int, eos: tuple[int, ...], repeats: int) -> dict[str, float]:
    """Each row walks the state's text a token a step, its mask filled before each token (as
    the grammar thread does; a state seen before would be llguidance's cache, not a fill)."""
    table = MatcherTable(grammar_tokenizer(spec, vocab, eos), vocab)
    tokenizer = load_tokenizer(spec.kind, spec.hf_json, vocab, None, eos)
    bitmask = new_bitmask(ROWS, vocab)
    rows = list(range(ROWS))
    costs = {}
    for name, constraint, before, walk in states():
        prefix = tokenizer.encode(before, add_special_tokens=False)
        steps = tokenizer.encode(before + walk, add_special_tokens=False)[len(prefix) :]

        def fill_along(
            constraint: Constraint = constraint, prefix: list[int] = prefix, steps: list[int] = steps
        ) -> float:
            for row in rows:
                table.start(row, constraint, prefix)
            spent = 0.0
            for token in steps:
                start = time.perf_counter()
                table.fill_masks(rows, bitmask)
                spent += time.perf_counter() - start
                for row in rows:
                    table.advance(row, token)
            table.clear()
            return spent

        costs[name] = best_us(fill_along, repeats, ROWS * len(steps))
    return costs


def split_costs(spec: TokenizerSpec, vocab: int, eos: tuple[int, ...], repeats: int) -> dict[str, float]:
    tokenizer = load_tokenizer(spec.kind, spec.hf_json, vocab, None, eos)
    ids = tokenizer.encode(CONTENT + CALLS, add_special_tokens=False)

    def texts() -> list[str]:
        text = RequestText(tokenizer, ("\n\n",))
        return [text.push(token)[0] for token in ids]

    pieces = texts()

    def split() -> None:
        stream = CallStream()
        for piece in pieces:
            stream.push(piece)
        assert stream.complete and stream.named == 2

    return {
        "detokenize + stop strings": best_us(timed(texts), repeats, len(ids)),
        "CallStream": best_us(timed(split), repeats, len(ids)),
    }


def markdown(command: str, machine: dict[str, Any], masks: dict[str, float], split: dict[str, float]) -> str:
    base = masks["json schema"]
    lines = [
        "# Tool calling: per-token costs",
        "",
        f"{measured_on(command, None, machine)}.",
        "",
        f"Worker: mask fill per row and step, SmolLM2's vocabulary, {ROWS} rows a fill, along a walk.",
        "",
        "| grammar state | us/row | x json schema |",
        "|---|---|---|",
        *(f"| {name} | {us:.1f} | {us / base:.2f} |" for name, us in masks.items()),
        "",
        "Frontend: per token of a reply (content, then two calls), SmolLM2's tokens.",
        "",
        "| step | us/token |",
        "|---|---|",
        *(f"| {name} | {us:.2f} |" for name, us in split.items()),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.tool_masks")
    p.add_argument("--quick", action="store_true", help="few repeats (a smoke run)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    started = datetime.now(UTC)
    repeats = 3 if args.quick else 200
    reader = gguf.GGUFReader(smollm2_path())
    config = config_from_gguf(reader, "smollm2")
    spec = TokenizerSpec("hf", tokenizer_from_gguf(smollm2_path(), reader).to_str().encode())
    masks = mask_costs(spec, config.vocab_size, config.eos_token_ids, repeats)
    split = split_costs(spec, config.vocab_size, config.eos_token_ids, repeats)
    machine = describe_machine()
    command = command_line("bench.tool_masks", argv)
    document = {
        "command": command,
        "machine": machine,
        "mask_us_per_row": masks,
        "frontend_us_per_token": split,
    }
    publish("tool_masks", started, document, markdown(command, machine, masks, split), args.out)


if __name__ == "__main__":
    main()
