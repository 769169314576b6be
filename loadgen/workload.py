"""Datasets: what each request asks for.

Request `index` of a workload is always the same prompt for the same seed, whatever the
arrival process or concurrency, so runs that differ only in load are comparable.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Protocol

import numpy as np

# Printable ASCII: valid ids in a byte-level vocabulary and valid single-byte text.
PRINTABLE_LOW = 32
PRINTABLE_HIGH = 126
MEASURED_STREAM = 0
WARMUP_STREAM = 1
PREFIX_STREAM = 3  # the prefixes' draws: apart from every request stream and from the arrivals (2)


class WorkloadError(ValueError):
    """A dataset that cannot be used as given; the message names the file and line."""


@dataclass(frozen=True)
class PromptSpec:
    prompt: str | tuple[int, ...]  # text, or token ids sent as input_ids
    output_len: int  # max_new_tokens

    @property
    def known_input_len(self) -> int:
        """Prompt tokens as far as the client knows them (text is tokenized by the server)."""
        return 0 if isinstance(self.prompt, str) else len(self.prompt)


@dataclass(frozen=True)
class RandomDataset:
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    as_text: bool = False

    def __post_init__(self) -> None:
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("random input and output lengths must be at least 1")
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"random range ratio must be in [0, 1), got {self.range_ratio}")


@dataclass(frozen=True)
class JsonlDataset:
    path: Path
    default_output_len: int = 128

    def __post_init__(self) -> None:
        if self.default_output_len < 1:
            raise ValueError("default output length must be at least 1")


@dataclass(frozen=True)
class PrefixRepetitionDataset:
    """vllm bench serve's `prefix_repetition`: `num_prefixes` random prefixes of `prefix_len`
    tokens, and request i is prefix i mod `num_prefixes` followed by a random suffix of
    `suffix_len` tokens of its own."""

    prefix_len: int = 256
    suffix_len: int = 256
    num_prefixes: int = 10
    output_len: int = 128
    as_text: bool = False

    def __post_init__(self) -> None:
        if self.prefix_len < 1 or self.num_prefixes < 1 or self.output_len < 1:
            raise ValueError("prefix length, number of prefixes and output length must be at least 1")
        if self.suffix_len < 0:
            raise ValueError(f"suffix length must be >= 0, got {self.suffix_len}")


Dataset = RandomDataset | JsonlDataset | PrefixRepetitionDataset


class Workload(Protocol):
    def prompt(self, index: int) -> PromptSpec: ...


def sends_token_ids(dataset: Dataset) -> bool:
    """Whether the dataset's prompts are token ids rather than text."""
    return isinstance(dataset, RandomDataset | PrefixRepetitionDataset) and not dataset.as_text


def length_bounds(length: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive bounds of a length drawn uniformly in [length*(1-r), length*(1+r)], at least 1."""
    return max(1, math.floor(length * (1 - range_ratio))), max(1, math.ceil(length * (1 + range_ratio)))


@dataclass(frozen=True)
class RandomWorkload:
    dataset: RandomDataset
    seed: int
    stream: int = MEASURED_STREAM

    def prompt(self, index: int) -> PromptSpec:
        rng = np.random.default_rng([self.seed, self.stream, index])
        input_len = _draw_length(rng, self.dataset.input_len, self.dataset.range_ratio)
        output_len = _draw_length(rng, self.dataset.output_len, self.dataset.range_ratio)
        return PromptSpec(_as_prompt(_draw_ids(rng, input_len), self.dataset.as_text), output_len)


def _draw_ids(rng: np.random.Generator, length: int) -> tuple[int, ...]:
    return tuple(int(t) for t in rng.integers(PRINTABLE_LOW, PRINTABLE_HIGH + 1, size=length))


def _as_prompt(ids: tuple[int, ...], as_text: bool) -> str | tuple[int, ...]:
    """The ids themselves, or the text of the same characters (one byte each)."""
    return "".join(map(chr, ids)) if as_text else ids


def _draw_length(rng: np.random.Generator, length: int, range_ratio: float) -> int:
    low, high = length_bounds(length, range_ratio)
    return int(rng.integers(low, high + 1))


@dataclass(frozen=True)
class PrefixRepetitionWorkload:
    """Prefix k is drawn from (seed, k) alone, so every stream (the warmup's too) shares the
    same prefixes; request i's suffix is drawn from (seed, stream, i)."""

    dataset: PrefixRepetitionDataset
    seed: int
    stream: int = MEASURED_STREAM

    @cached_property
    def prefixes(self) -> tuple[tuple[int, ...], ...]:
        d = self.dataset
        return tuple(
            _draw_ids(np.random.default_rng([self.seed, PREFIX_STREAM, k]), d.prefix_len)
            for k in range(d.num_prefixes)
        )

    def prefix_index(self, index: int) -> int:
        """Which prefix request `index` starts with: round robin."""
        return index % self.dataset.num_prefixes

    def prompt(self, index: int) -> PromptSpec:
        suffix = _draw_ids(np.random.default_rng([self.seed, self.stream, index]), self.dataset.suffix_len)
        ids = self.prefixes[self.prefix_index(index)] + suffix
        return PromptSpec(_as_prompt(ids, self.dataset.as_text), self.dataset.output_len)


@dataclass(frozen=True)
class JsonlWorkload:
    """The file's prompts in order, cycled when more requests are asked for."""

    specs: tuple[PromptSpec, ...]

    def prompt(self, index: int) -> PromptSpec:
        return self.specs[index % len(self.specs)]


def load_workload(dataset: Dataset, seed: int, stream: int = MEASURED_STREAM) -> Workload:
    if isinstance(dataset, RandomDataset):
        return RandomWorkload(dataset, seed, stream)
    if isinstance(dataset, PrefixRepetitionDataset):
        return PrefixRepetitionWorkload(dataset, seed, stream)
    return JsonlWorkload(load_jsonl(dataset.path, dataset.default_output_len))


def load_jsonl(path: Path, default_output_len: int) -> tuple[PromptSpec, ...]:
    """One JSON object per line: {"prompt": "...", "output_len": 64}; blank lines are skipped."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkloadError(f"{path}: cannot read: {exc}") from exc
    specs = tuple(
        parse_jsonl_line(line, default_output_len, f"{path}:{number}")
        for number, line in enumerate(lines, start=1)
        if line.strip()
    )
    if not specs:
        raise WorkloadError(f"{path}: no prompts")
    return specs


def parse_jsonl_line(line: str, default_output_len: int, where: str) -> PromptSpec:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise WorkloadError(f"{where}: not valid JSON: {exc.msg} (column {exc.colno})") from exc
    if not isinstance(item, dict):
        raise WorkloadError(f"{where}: expected a JSON object, got {type(item).__name__}")
    prompt = item.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise WorkloadError(f'{where}: "prompt" must be a non-empty string')
    return PromptSpec(prompt, _output_len(item, default_output_len, where))


def _output_len(item: dict[str, object], default: int, where: str) -> int:
    value = item.get("output_len")
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise WorkloadError(f'{where}: "output_len" must be an integer >= 1, got {value!r}')
    return value
