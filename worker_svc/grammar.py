"""Grammar matchers on the worker: one per constrained request slot, next to the sampler
(llguidance), and the bitmasks they fill (one bit per token id, int32 words).

A matcher that has stopped (the grammar finished) takes no more tokens: advancing it is an
error, not a no-op. A recomputed request replays its tokens into a fresh matcher. Constraints
compile through `stepahead.grammars` (cached by content).
"""

from __future__ import annotations

import llguidance
import torch

from stepahead.grammars import GrammarError, compile_constraint
from stepahead.protocol import Constraint, TokenizerSpec

__all__ = [
    "Constraint",
    "GrammarError",
    "MatcherTable",
    "apply_bitmask",
    "compile_constraint",
    "grammar_tokenizer",
    "new_bitmask",
]


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
        self._parallel: llguidance.LLExecutor | None = None

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
        """Row i of `bitmask` (int32, one bit per token, on the host, contiguous) gets slot i's
        allowed tokens; several rows are filled in parallel (llguidance's own threads)."""
        assert bitmask.dtype == torch.int32 and bitmask.is_contiguous() and bitmask.device.type == "cpu"
        row_bytes = bitmask.shape[1] * 4
        if len(slots) == 1:
            self._matchers[slots[0]].unsafe_compute_mask_ptr(bitmask.data_ptr(), row_bytes)
            return
        matchers = [(self._matchers[slot], row) for row, slot in enumerate(slots)]
        self._executor().unsafe_compute_mask_ptr(matchers, bitmask.data_ptr(), row_bytes, len(slots))

    def _executor(self) -> llguidance.LLExecutor:
        if self._parallel is None:
            self._parallel = llguidance.LLExecutor()
        return self._parallel

    def release(self, slot: int) -> None:
        self._matchers.pop(slot, None)

    def clear(self) -> None:
        self._matchers.clear()


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def new_bitmask(rows: int, vocab_size: int, pin: bool = False) -> torch.Tensor:
    """[rows, words] int32 on the host, every token allowed (pinned, for a non-blocking copy)."""
    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32, pin_memory=pin)


def allowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, vocab_size] bool from a bitmask [rows, words] int32 (on any device; no transfer)."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    unpacked = bitmask[:, :, None].bitwise_right_shift(bits).bitwise_and_(1)
    return unpacked.flatten(1)[:, :vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Disallowed tokens of each row of `logits` [rows, V] to -inf, in place (plain tensor ops;
    `bitmask` on the logits' device)."""
    mask = allowed(bitmask, logits.shape[1])
    logits.masked_fill_(~mask, float("-inf"))
