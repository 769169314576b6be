"""A request as the engine core sees it: token ids, progress, slots.

Text (detokenization, stop strings) lives in the frontend that admitted the request;
the core knows tokens only, and ends requests on EOS, `stop_token_ids` and
`max_new_tokens`.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from scheduler_svc.contract import FinishReason, SamplingParams, TokenLogprob
from scheduler_svc.engine.rows import RowField

if TYPE_CHECKING:
    from scheduler_svc.contract import OutputSink
    from scheduler_svc.engine.kv.radix_cache import RadixNode
    from scheduler_svc.engine.rows import SlotRows


@dataclass(eq=False, slots=True)
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
    # `output_ids` and `kv_slots` (properties): these lists, then the tails of its row, while it
    # holds one (`rows.SlotRows.append_tokens`), which a read of either moves into them.
    output_head: list[int] = field(default_factory=list)
    req_slot: int | None = None
    kv_head: list[int] = field(default_factory=list)
    # Speculative decoding: per verify row in flight, oldest first, the K KV slots reserved for
    # its drafts (`kv/manager.py`); its first slot, its pending token's, is in kv_slots already.
    draft_slots: collections.deque[list[int]] = field(default_factory=collections.deque)
    tree_slots: set[int] = field(default_factory=set)  # of kv_slots, those the prefix cache holds
    cache_node: RadixNode | None = None  # where its cached prefix ends (locked while it lives)
    cached_prompt_tokens: int = 0  # prompt tokens its first admission found in the prefix cache
    # With params.prompt_logprobs: its prompt's log-probabilities as their steps' results come,
    # position 1 on, until they go out with its first token (`prompt_scores_sent`).
    prompt_scores: list[TokenLogprob] = field(default_factory=list)
    prompt_scores_sent: bool = False
    attempt: int = 0
    finish_reason: FinishReason | None = None
    arrival_time: float = field(default_factory=time.time)
    first_scheduled_time: float | None = None
    # Progress, in its row of `rows` while it holds a request slot, in `_num_computed` etc. otherwise
    # (`rows.RowField`).
    rows: SlotRows | None = field(default=None, init=False, repr=False)
    _num_computed: int = field(default=0, init=False, repr=False)
    _num_inflight: int = field(default=0, init=False, repr=False)
    _prompt_kept: int = field(default=0, init=False, repr=False)
    num_computed = RowField("computed")  # positions whose KV is computed or launched
    num_inflight = RowField("inflight")  # sampled on the device, not processed yet
    prompt_kept = RowField("kept")  # this attempt's prefill is in the prefix cache

    @property
    def output_ids(self) -> list[int]:
        """Its processed output tokens (the list itself: appending to it adds one)."""
        self._take_tails()
        return self.output_head

    @property
    def kv_slots(self) -> list[int]:
        """The KV slots of its positions, one each (the list itself, as `output_ids`)."""
        self._take_tails()
        return self.kv_head

    @kv_slots.setter
    def kv_slots(self, slots: list[int]) -> None:
        self._take_tails()
        self.kv_head = slots

    def _take_tails(self) -> None:
        """Its row's tails (`rows.SlotRows.append_tokens`) move into its lists."""
        rows = self.rows
        if rows is not None:
            rows.flush(self, self.req_slot)  # type: ignore[arg-type]

    def add_output(self, token: int) -> None:
        """A processed token joins the output."""
        self.output_ids.append(token)
        rows = self.rows
        if rows is not None:
            rows.known[self.req_slot] += 1  # type: ignore[index]

    @property
    def drafts(self) -> int:
        """K: its decode rows may be verify rows of K drafts (0: plain decode rows, or no slot)."""
        rows = self.rows
        return 0 if rows is None else rows.drafts[self.req_slot]  # type: ignore[index]

    @property
    def next_drafts(self) -> int:
        """Drafts its next decode row carries: K, or 0 while it backs off (`running.py`)."""
        rows = self.rows
        if rows is None or rows.skip[self.req_slot] or not rows.found[self.req_slot]:  # type: ignore[index]
            return 0
        return rows.drafts[self.req_slot]  # type: ignore[index]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def key(self) -> tuple[str, int]:
        """Unique among live requests: the client's id and the completion's index."""
        return self.rid, self.index

    @property
    def num_known(self) -> int:
        """Tokens the CPU knows: prompt plus processed output (its row counts them, tails and
        all, while it holds one)."""
        rows = self.rows
        if rows is not None:
            return rows.known[self.req_slot]  # type: ignore[index]
        return len(self.prompt_ids) + len(self.output_head)

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.num_known

    def known_ids(self, start: int, end: int) -> list[int]:
        prompt_len = len(self.prompt_ids)
        if end <= prompt_len:
            return self.prompt_ids[start:end]
        if start == 0:  # a prefix: one list made, not the whole and then its slice
            return self.prompt_ids + self.output_ids[: end - prompt_len]
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
        return self.num_known - len(self.prompt_ids) + self.num_inflight
