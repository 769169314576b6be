"""A request as the engine core sees it: token ids, progress, slots.

Text (detokenization, stop strings) lives in the frontend that admitted the request;
the core knows tokens only, and ends requests on EOS, `stop_token_ids` and
`max_new_tokens`.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler_svc.engine.kv.radix_cache import RadixNode
    from scheduler_svc.engine.outputs import OutputSink


class FinishReason(enum.IntEnum):
    """Values match stepahead.v1.FinishReason."""

    LENGTH = 1
    STOP = 2
    ABORT = 3


MAX_COMPLETIONS = 16  # `n`: completions of one prompt in one call
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries, as OpenAI bounds it
# A positive temperature below this samples at it: logits divided by less overflow float32 (and
# float32, the wire's type, rounds 1e-50 to 0, which would turn a sampled request greedy).
MIN_TEMPERATURE = 1e-2


@dataclass(frozen=True)
class SamplingParams:
    """`stop` strings are matched by the frontend; everything else acts in the core or the worker."""

    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: frozenset[int]
    stop: tuple[str, ...]
    ignore_eos: bool
    logprobs: bool = False
    top_logprobs: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids ascending

    @property
    def processes_logits(self) -> bool:
        """Whether the worker must do more than sample: logits processing or log-probabilities."""
        return (
            self.logprobs
            or self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.min_tokens > 0
            or bool(self.logit_bias)
        )

    @property
    def penalized(self) -> bool:
        """Whether the worker's penalties read the request's tokens."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def stop_finishes(self, num_generated: int) -> bool:
        """EOS, stop tokens and stop strings end the request only after min_tokens tokens."""
        return num_generated >= self.min_tokens


@dataclass(eq=False)
class Request:
    """NOTE: `output_ids` are the tokens the CPU has processed; up to
    `num_inflight` more are sampled on the device but not seen yet (the last
    one sits in the worker's FutureMap). KV covers `num_computed` tokens.

    `owner` is the frontend that admitted the request and `handle` its name
    there: every output of the request goes to that owner under that handle.
    """

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_seq: int
    owner: OutputSink | None = None
    handle: int = 0
    index: int = 0  # which of the client request's n completions
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_inflight: int = 0
    req_slot: int | None = None
    kv_slots: list[int] = field(default_factory=list)
    tree_slots: set[int] = field(default_factory=set)  # of kv_slots, those the prefix cache holds
    cache_node: RadixNode | None = None  # where its cached prefix ends (locked while it lives)
    prompt_kept: bool = False  # this attempt's prefill is in the prefix cache
    cached_prompt_tokens: int = 0  # prompt tokens its first admission found in the prefix cache
    attempt: int = 0
    finish_reason: FinishReason | None = None
    arrival_time: float = field(default_factory=time.time)
    first_scheduled_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def key(self) -> tuple[str, int]:
        """Unique among live requests: the client's id and the completion's index."""
        return self.rid, self.index

    @property
    def num_known(self) -> int:
        """Tokens the CPU knows: prompt plus processed output."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.num_known

    def known_ids(self, start: int, end: int) -> list[int]:
        prompt_len = len(self.prompt_ids)
        if end <= prompt_len:
            return self.prompt_ids[start:end]
        return (self.prompt_ids + self.output_ids)[start:end]

    def wants_decode(self) -> bool:
        """Its last token is sampled but not in KV, and more tokens are allowed.

        NOTE: counting in-flight tokens keeps a request whose pending results
        already reach max_new_tokens out of the next batch.
        """
        if self.finished or self.in_prefill:
            return False
        last_token_pending_kv = self.num_computed == self.num_known + self.num_inflight - 1
        return last_token_pending_kv and self.num_generated_or_inflight < self.params.max_new_tokens

    @property
    def num_generated_or_inflight(self) -> int:
        return len(self.output_ids) + self.num_inflight
