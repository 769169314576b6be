"""A reasoning model's thinking, apart from its answer: the reply's text between `<think>` and
`</think>` is its reasoning (`reasoning_content` on the HTTP API, `reasoning_text` on gRPC), what
follows is its content.

Which models think: those whose chat template writes `</think>` (Qwen3, QwQ, DeepSeek-R1's
distills, SmolLM3, EXAONE 4, OLMo 3 Think, GLM-4.5), and only where the tokenizer's text keeps
the tags (`thinks`): a tokenizer that drops them as special tokens leaves nothing to split on.
Where the reply starts: inside its reasoning when the rendered prompt opened a `<think>` that it
did not close (DeepSeek-R1's and Qwen3.5's templates end the prompt with `<think>`; Qwen3's with
thinking disabled closes an empty one), else in its content unless the reply opens one itself.

One reasoning block, at the reply's start (the only place these models write one): a `<think>`
later in the text is content, and so is everything after the first `</think>`. The reasoning is
trimmed of the whitespace around it and the content of the whitespace that leads it (the
templates put newlines on both sides of the tags), so that a stream's pieces, joined, equal the
whole reply's fields.
"""

from __future__ import annotations

from scheduler_svc.frontend.tokenizer import Tokenizer

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# --reasoning-parser: auto splits where the template thinks; vLLM's names for the same split are
# taken as auto; none does not split.
REASONING_PARSERS = ("auto", "deepseek_r1", "qwen3", "none")


def thinks(template: str, tokenizer: Tokenizer) -> bool:
    """Whether a chat template is a reasoning model's (it writes `</think>`) whose tags the
    tokenizer's text keeps (decoded as a reply's text is, special tokens skipped)."""
    tags = (THINK_OPEN, THINK_CLOSE)
    return THINK_CLOSE in template and all(_round_trip(tokenizer, tag) == tag for tag in tags)


def tag_tokens(tokenizer: Tokenizer) -> tuple[int, int] | None:
    """The ids of `<think>` and `</think>` where both are tokens added to the vocabulary (as
    Qwen3's are), which a grammar names by id; None: they are text."""
    opening, closing = tokenizer.added_token(THINK_OPEN), tokenizer.added_token(THINK_CLOSE)
    return None if opening is None or closing is None else (opening, closing)


def _round_trip(tokenizer: Tokenizer, text: str) -> str:
    decoder = tokenizer.new_decoder()
    return decoder.push(tokenizer.encode(text, add_special_tokens=False)) + decoder.flush()


def starts_inside(prompt: str) -> bool:
    """Whether a rendered prompt leaves the reply inside a reasoning block it opened."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


class ReasoningSplit:
    """A reply's text, pushed as it comes, split into (reasoning, content) pieces; text that may
    be the start of a tag, or whitespace that may end the reasoning, is held until the next push
    or `finish` says what it is."""

    def __init__(self, inside: bool) -> None:
        self._state = "reasoning" if inside else "start"  # start -> reasoning -> content
        self._held = ""  # text not yet placed
        self._leading = True  # no non-whitespace of the current part sent yet

    @property
    def thinking(self) -> bool:
        """Whether the reply is inside its reasoning block."""
        return self._state == "reasoning"

    def push(self, text: str) -> tuple[str, str]:
        """(reasoning, content) now sure of `text` and what was held."""
        held = self._held + text
        self._held = ""
        reasoning = content = ""
        if self._state == "start":
            stripped = held.lstrip()
            if stripped.startswith(THINK_OPEN):
                self._state, held = "reasoning", stripped[len(THINK_OPEN) :]
            elif THINK_OPEN.startswith(stripped):  # nothing yet, or part of the tag
                self._held = held
                return "", ""
            else:
                self._state = "content"
                self._leading = False  # no reasoning: the reply is content as written
        if self._state == "reasoning":
            end = held.find(THINK_CLOSE)
            if end < 0:
                keep = _partial_tag(held, THINK_CLOSE)
                body, self._held = held[: len(held) - keep], held[len(held) - keep :]
                # whitespace at the end may be the reasoning's last: held until more follows
                trimmed = body.rstrip()
                self._held = body[len(trimmed) :] + self._held
                return self._part(trimmed), ""
            reasoning = self._part(held[:end].rstrip())
            self._state, self._leading = "content", True
            held = held[end + len(THINK_CLOSE) :]
        content = self._part(held)
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held, at the reply's end."""
        held, self._held = self._held, ""
        if self._state == "start":  # the reply was only whitespace, or part of a tag
            return "", held
        if self._state == "reasoning":
            return self._part(held.rstrip()), ""
        return "", self._part(held)

    def _part(self, text: str) -> str:
        """`text` of the current part, its leading whitespace dropped at the part's start."""
        if self._leading:
            text = text.lstrip()
            self._leading = not text
        return text


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (shorter than it)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
