"""Structured outputs on the worker: one grammar matcher per constrained request slot, next to
the sampler (llguidance). The worker sees token k the moment it samples it, so it advances the
row's matcher then and has the row's mask for step k+1 before that step samples, with no round
trip to the scheduler, at any overlap depth.

A constraint is JSON Schema, a regex, a choice among strings, or a Lark grammar; its compiled
form is cached by content (clients repeat their schemas). A matcher that has stopped (the
grammar finished) takes no more tokens: advancing it is an error, not a no-op. A recomputed
request replays its tokens into a fresh matcher.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import llguidance
import llguidance.torch
import torch

from stepahead.protocol import TokenizerSpec

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

ConstraintKind = Literal["json", "regex", "choice", "grammar"]
GRAMMAR_CACHE_SIZE = 256  # compiled constraints kept, by content
# JSON as `json.dumps` writes it: free whitespace would let a sampler emit whitespace without end
# (a vocabulary has thousands of whitespace tokens). A schema's `x-guidance` may say otherwise.
JSON_LAYOUT: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


class GrammarError(ValueError):
    """A constraint that does not compile; the message says why."""


@dataclass(frozen=True)
class Constraint:
    """`text`: a JSON Schema (JSON), a regex, the choices (a JSON list of strings), or a Lark grammar."""

    kind: ConstraintKind
    text: str


@functools.lru_cache(maxsize=GRAMMAR_CACHE_SIZE)
def compile_constraint(constraint: Constraint) -> str:
    """llguidance's grammar for `constraint`, checked; raises GrammarError naming what is wrong."""
    kind, text = constraint.kind, constraint.text
    try:
        if kind == "json":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.loads(text), defaults=JSON_LAYOUT)
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(text)
        elif kind == "choice":
            grammar = llguidance.LLMatcher.grammar_from_regex(_choice_regex(text))
        else:
            grammar = llguidance.LLMatcher.grammar_from_lark(text)
    except (ValueError, TypeError) as exc:  # json.loads, or the schema compiler
        raise GrammarError(f"{kind}: {exc}") from exc
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem and not problem.startswith("WARNING"):
        raise GrammarError(f"{kind}: {problem}")
    return grammar


def _choice_regex(text: str) -> str:
    choices = json.loads(text)
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError("the choices must be a non-empty JSON list of strings")
    return "|".join(f"({re.escape(choice)})" for choice in choices)


def grammar_tokenizer(
    spec: TokenizerSpec, vocab_size: int, eos_ids: tuple[int, ...]
) -> llguidance.LLTokenizer:
    """The model's tokenizer as llguidance sees it: from the `tokenizer.json`, or, for the
    byte-level one, from its 256 byte tokens (ids above them have no text)."""
    if spec.kind == "hf":
        return llguidance.LLTokenizer(spec.hf_json.decode(), n_vocab=vocab_size, eos_token=list(eos_ids))
    return llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(_ByteTokens(vocab_size, eos_ids)),
        n_vocab=vocab_size,
        eos_token=list(eos_ids),
    )


class _ByteTokens:
    """The byte-level tokenizer in the shape llguidance's TokenizerWrapper reads."""

    def __init__(self, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
        self.tokens = [bytes([i]) if i < 256 else b"" for i in range(vocab_size)]
        self.eos_token_id = eos_ids[0]
        self.bos_token_id: int | None = None
        self.special_token_ids = list(range(256, vocab_size))

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


class MatcherTable:
    """The live matchers, by request slot."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._matchers: dict[int, llguidance.LLMatcher] = {}

    def __len__(self) -> int:
        return len(self._matchers)

    def __contains__(self, slot: int) -> bool:
        return slot in self._matchers

    def start(self, slot: int, constraint: Constraint, tokens: list[int] | None = None) -> None:
        """A fresh matcher for `slot`; `tokens` replays what a recomputed request already has."""
        matcher = llguidance.LLMatcher(self._tokenizer, compile_constraint(constraint))
        if matcher.is_error():
            raise GrammarError(f"{constraint.kind}: {matcher.get_error()}")
        self._matchers[slot] = matcher
        for token in tokens or ():
            self.advance(slot, token)

    def advance(self, slot: int, token: int) -> bool:
        """`token` was sampled for `slot`; True when the grammar has finished with it."""
        matcher = self._matchers[slot]
        if matcher.is_stopped():
            raise GrammarError(f"slot {slot}: its grammar has finished; it takes no token ({token})")
        if not matcher.consume_token(token):
            raise GrammarError(f"slot {slot}: token {token} is outside its grammar: {matcher.get_error()}")
        return matcher.is_stopped()

    def finished(self, slot: int) -> bool:
        return self._matchers[slot].is_stopped()

    def fill_masks(self, slots: list[int], bitmask: torch.Tensor) -> None:
        """Row i of `bitmask` (int32, one bit per token, on the host) gets slot i's allowed tokens."""
        for row, slot in enumerate(slots):
            llguidance.torch.fill_next_token_bitmask(self._matchers[slot], bitmask, row)

    def release(self, slot: int) -> None:
        self._matchers.pop(slot, None)


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    return llguidance.torch.allocate_token_bitmask(rows, vocab_size)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Disallowed tokens of each row to -inf, in place."""
    llguidance.torch.apply_token_bitmask_inplace(logits, bitmask.to(logits.device))
