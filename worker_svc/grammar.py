"""Grammar matchers on the worker: one per constrained request slot, next to the sampler
(llguidance), and the bitmasks they fill (one bit per token id, int32 words).

A matcher that has stopped (the grammar finished) takes no more tokens: advancing it is an
error, not a no-op. A recomputed request replays its tokens into a fresh matcher. Constraints
compile through `stepahead.grammars` (cached by content).
"""

from __future__ import annotations

from collections import OrderedDict

import llguidance
import torch

from stepahead.grammars import GRAMMAR_CACHE_SIZE, GrammarError, compile_constraint
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
    """The live matchers, by request slot. Without a tokenizer (one llguidance cannot read:
    `refusal` says why) it holds none: every grammar fails to start, naming the refusal."""

    def __init__(self, tokenizer: llguidance.LLTokenizer | None, vocab_size: int, refusal: str = "") -> None:
        self._tokenizer = tokenizer
        self.refusal = refusal
        self.vocab_size = vocab_size
        self._matchers: dict[int, llguidance.LLMatcher] = {}
        self._templates: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()  # by grammar, LRU first

    def __len__(self) -> int:
        return len(self._matchers)

    def __contains__(self, slot: int) -> bool:
        return slot in self._matchers

    def start(self, slot: int, constraint: Constraint, tokens: list[int] | None = None) -> None:
        """A fresh matcher for `slot`; `tokens` replays what a recomputed request already has.

        NOTE: building a matcher from its grammar takes 0.5 to 0.7 ms (a JSON Schema of a few
        fields); copying an unused one takes about 1 us, so each compiled grammar keeps one
        unused matcher to copy (as many as the compile cache keeps grammars)."""
        if self._tokenizer is None:
            raise GrammarError(f"{constraint.kind}: {self.refusal}")
        grammar = compile_constraint(constraint)
        template = self._templates.get(grammar)
        if template is None:
            template = llguidance.LLMatcher(self._tokenizer, grammar)
            if template.is_error():
                raise GrammarError(f"{constraint.kind}: {template.get_error()}")
            self._templates[grammar] = template
            if len(self._templates) > GRAMMAR_CACHE_SIZE:
                self._templates.popitem(last=False)
        else:
            self._templates.move_to_end(grammar)
        self._matchers[slot] = template.deep_copy()
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
        allowed tokens.

        NOTE: one row after the other on the calling thread: llguidance's parallel executor was
        5 to 9 times slower per row on a 2-core machine (byte tokenizer 18 vs 3.4 us a row at 64
        rows, SmolLM2's 182 vs 20 us at 16), and the mask is computed while the forward runs."""
        assert bitmask.dtype == torch.int32 and bitmask.is_contiguous() and bitmask.device.type == "cpu"
        row_bytes = bitmask.shape[1] * 4
        start = bitmask.data_ptr()
        for row, slot in enumerate(slots):
            self._matchers[slot].unsafe_compute_mask_ptr(start + row * row_bytes, row_bytes)

    def fill_mask(self, slot: int, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of `bitmask` (as `fill_masks`) gets `slot`'s allowed tokens."""
        assert bitmask.dtype == torch.int32 and bitmask.is_contiguous() and bitmask.device.type == "cpu"
        row_bytes = bitmask.shape[1] * 4
        self._matchers[slot].unsafe_compute_mask_ptr(bitmask.data_ptr() + row * row_bytes, row_bytes)

    def try_draft(self, slot: int, token: int) -> bool:
        """`slot`'s matcher takes draft `token` for now, if its grammar goes on and allows it
        (`rollback` undoes it); False, and nothing taken, otherwise.

        NOTE: a token the grammar refuses would leave the matcher in an error that no rollback
        clears, so it is validated first."""
        matcher = self._matchers[slot]
        if matcher.is_stopped() or matcher.validate_tokens([token]) != 1:
            return False
        if not matcher.consume_token(token):
            problem = matcher.get_error()
            raise GrammarError(f"slot {slot}: draft {token} was validated but not taken: {problem}")
        return True

    def forced(self, slot: int, limit: int) -> list[int]:
        """The tokens `slot`'s grammar forces next, up to `limit` (none once it has finished)."""
        matcher = self._matchers[slot]
        if matcher.is_stopped() or matcher.is_error():
            return []
        return list(matcher.compute_ff_tokens()[:limit])

    def rollback(self, slot: int, tokens: int) -> None:
        """`slot`'s matcher forgets its last `tokens` tokens (drafts taken for now)."""
        if tokens and not self._matchers[slot].rollback(tokens):
            raise GrammarError(f"slot {slot}: {tokens} drafts could not be rolled back")

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
