"""The speculative decoding configuration: vLLM's `--speculative-config` JSON, of which the
`ngram` method (prompt lookup: drafts copied from a request's own tokens, no draft model).

The scheduler parses it and announces it to the worker in each session's Hello; the worker
drafts and verifies (worker_svc/speculative.py), the scheduler reserves KV for the drafts and
learns with each result how many tokens a row emitted (docs/SPECULATIVE.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 16  # drafts a row verifies per step
MAX_PROMPT_LOOKUP = 16  # the longest n-gram looked up
# vLLM's defaults when neither n-gram bound is given (and each bound defaults to the other).
DEFAULT_PROMPT_LOOKUP = 5
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")


@dataclass(frozen=True)
class SpeculativeConfig:
    """`num_speculative_tokens` drafts per decode row and step; a row drafts the tokens that
    followed the earliest earlier occurrence of its last n tokens, for the longest n in
    [`prompt_lookup_min`, `prompt_lookup_max`] that occurs."""

    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    method: str = "ngram"

    def __post_init__(self) -> None:
        check_speculative(self)


def check_speculative(c: SpeculativeConfig) -> None:
    """ValueError naming the first field out of range."""
    if c.method not in METHODS:
        raise ValueError(f"method: one of {', '.join(METHODS)}, got {c.method!r}")
    k = c.num_speculative_tokens
    if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"num_speculative_tokens: must be in [1, {MAX_SPECULATIVE_TOKENS}], got {k}")
    for name in ("prompt_lookup_min", "prompt_lookup_max"):
        value = getattr(c, name)
        if not 1 <= value <= MAX_PROMPT_LOOKUP:
            raise ValueError(f"{name}: must be in [1, {MAX_PROMPT_LOOKUP}], got {value}")
    if c.prompt_lookup_min > c.prompt_lookup_max:
        raise ValueError(
            f"prompt_lookup_min: {c.prompt_lookup_min} is above prompt_lookup_max {c.prompt_lookup_max}"
        )


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """vLLM's JSON form; ValueError naming the field that is wrong."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"a JSON object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(KEYS))
    if unknown:
        raise ValueError(f"{unknown[0]}: not a field of the ngram method (fields: {', '.join(KEYS)})")
    method = raw.get("method")
    if method is None:
        raise ValueError(f"method: required, one of {', '.join(METHODS)}")
    if "num_speculative_tokens" not in raw:
        raise ValueError("num_speculative_tokens: required")
    for name in KEYS[1:]:
        value = raw.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise ValueError(f"{name}: an integer, got {value!r}")
    low: int | None = raw.get("prompt_lookup_min")
    high: int | None = raw.get("prompt_lookup_max")
    low = low if low is not None else high if high is not None else DEFAULT_PROMPT_LOOKUP
    high = high if high is not None else low
    return SpeculativeConfig(raw["num_speculative_tokens"], low, high, str(method))
