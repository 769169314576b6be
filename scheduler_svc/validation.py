"""Checks of a GenerateRequest; each failure names the offending field."""

from __future__ import annotations

import math
from dataclasses import dataclass

from scheduler_svc.request import SamplingParams
from scheduler_svc.tokenizer import Tokenizer
from stepahead.protocol import WorkerInfo
from stepahead.v1 import generation_pb2

MAX_REQUEST_ID_CHARS = 256


class InvalidRequest(ValueError):
    """The request cannot be served as sent (INVALID_ARGUMENT)."""


@dataclass(frozen=True)
class ValidRequest:
    prompt_ids: list[int]
    params: SamplingParams


def validate_request(
    request: generation_pb2.GenerateRequest, tokenizer: Tokenizer, info: WorkerInfo, seed: int
) -> ValidRequest:
    """`seed` is used when the request brings none."""
    if len(request.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(f"request_id: at most {MAX_REQUEST_ID_CHARS} characters")
    prompt_ids = _prompt_ids(request, tokenizer, info.vocab_size)
    params = _sampling_params(request.sampling, info.vocab_size, seed)
    _check_fits(len(prompt_ids), params.max_new_tokens, info)
    return ValidRequest(prompt_ids, params)


def _prompt_ids(request: generation_pb2.GenerateRequest, tokenizer: Tokenizer, vocab: int) -> list[int]:
    which = request.WhichOneof("input")
    if which is None:
        raise InvalidRequest("input: set text or input_ids")
    if which == "text":
        if not request.text:
            raise InvalidRequest("input.text: must not be empty")
        ids = tokenizer.encode(request.text)
        if not ids:
            raise InvalidRequest("input.text: encodes to no tokens")
        return ids
    ids = list(request.input_ids.ids)
    if not ids:
        raise InvalidRequest("input.input_ids.ids: must not be empty")
    _check_in_vocab(ids, "input.input_ids.ids", vocab)
    return ids


def _check_in_vocab(ids: list[int], field: str, vocab: int) -> None:
    for i, token in enumerate(ids):
        if token >= vocab:
            raise InvalidRequest(f"{field}[{i}]: {token} is outside the vocabulary (0..{vocab - 1})")


def _sampling_params(p: generation_pb2.SamplingParams, vocab: int, seed: int) -> SamplingParams:
    if p.max_new_tokens < 1:
        raise InvalidRequest("sampling.max_new_tokens: must be at least 1")
    if not math.isfinite(p.temperature) or p.temperature < 0:
        raise InvalidRequest(f"sampling.temperature: must be a finite number >= 0, got {p.temperature}")
    top_p = p.top_p if p.HasField("top_p") else 1.0
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise InvalidRequest(f"sampling.top_p: must be in (0, 1], got {top_p}")
    _check_in_vocab(list(p.stop_token_ids), "sampling.stop_token_ids", vocab)
    for i, stop in enumerate(p.stop):
        if not stop:
            raise InvalidRequest(f"sampling.stop[{i}]: must not be empty")
    return SamplingParams(
        max_new_tokens=p.max_new_tokens,
        temperature=p.temperature,
        top_p=top_p,
        top_k=p.top_k,
        seed=p.seed if p.HasField("seed") else seed,
        stop_token_ids=frozenset(p.stop_token_ids),
        stop=tuple(p.stop),
        ignore_eos=p.ignore_eos,
    )


def _check_fits(prompt_len: int, max_new_tokens: int, info: WorkerInfo) -> None:
    total = prompt_len + max_new_tokens
    if total > info.max_context_len:
        raise InvalidRequest(
            f"sampling.max_new_tokens: prompt ({prompt_len} tokens) + max_new_tokens "
            f"({max_new_tokens}) exceeds the context length {info.max_context_len}"
        )
    if total > info.kv_slots:
        raise InvalidRequest(
            f"sampling.max_new_tokens: prompt ({prompt_len} tokens) + max_new_tokens "
            f"({max_new_tokens}) exceeds the KV pool of {info.kv_slots} tokens"
        )
