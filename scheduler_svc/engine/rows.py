"""The running requests' per-step state as arrays, indexed by request slot: what every step
reads and writes for every row (positions computed, tokens in flight, tokens known) and what
its checks compare them with (length limits, where stop tokens start to count, whose row it is).

A request holds a row while it holds a request slot (`SessionSlots.assign` to `release`); its
`num_computed`, `num_inflight` and `prompt_kept` read and write that row then, and its own
fields otherwise (`request.py`). The pick and the result processing of plain decode rows work on
whole columns at once (`running.py`, `results.py`), so a step costs a few array operations
rather than a walk of Python objects.

A step's new output tokens and KV slots of plain decode rows are written into the rows' tails
(`append_tokens`, `append_kv`), a column at a time, not onto each request's lists. The served
core sleeps through each device step, and the step after finds the caches cold: one that walks
a few hundred requests' objects and lists pays cache misses for each (`bench.core_cpu`'s rows
after an idle sleep). A tail holds up to TAIL entries; it moves into the request's own lists
when it fills, when the request reads them (`Request.output_ids`, `Request.kv_slots`) and when
the row is cleared.

Truth tests of a column are `np.count_nonzero` and `ndarray.nonzero`: numpy's `any`, `all` and
`flatnonzero` run a Python function of numpy's each, which a cold step pays several times over.

Each assignment of a slot gets a fresh `tag`: a batch records its rows' tags, and a row whose
slot has since been released (the request ended, was preempted or aborted) or given to another
request no longer matches, so its token is dropped, never applied to the wrong request.
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING, overload

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from scheduler_svc.contract import OutputSink
    from scheduler_svc.engine.request import Request

Column = npt.NDArray[np.int64]
NO_TAG = -1
TAIL = 64  # new output tokens (and KV slots) a row holds before they move into its request's lists


class SlotRows:
    # The columns, one entry per request slot. `array` for scalar access (Python ints, no
    # boxing of numpy scalars), numpy views of the same memory for the per-step column work.
    COLUMNS = (
        "computed",  # positions whose KV is computed or launched (num_computed)
        "inflight",  # tokens sampled on the device, not processed yet (num_inflight)
        "known",  # prompt + processed output tokens (num_known)
        "prompt_len",
        "limit",  # prompt_len + max_new_tokens: no more tokens once known + inflight reach it
        "stop_from",  # prompt_len + min_tokens + 1: a stop token ends it from this length on
        "eos_stops",  # 1: the model's EOS ids end it (not ignore_eos)
        "plain",  # 1: its results need nothing but the columns (no logprobs, no stop ids)
        "drafts",  # K: its decode rows are verify rows of K drafts (speculative decoding); 0: none
        "skip",  # decode rows it still takes without drafts (its drafts were rejected lately)
        "backoff",  # the last such run's length (0: its last verify row accepted a draft)
        "found",  # 1: the worker's lookup found drafts for it in the last step processed
        "kept",  # 1: this attempt's prefill is in the prefix cache (prompt_kept)
        "tag",  # this assignment of the slot (NO_TAG: free)
        "handle",  # its name at its owner
        "owner",  # its owner's number (`owner_ids`)
        "new_tokens",  # output tokens in its tail, not yet in the request's `output_ids`
        "new_kv",  # KV slots in its tail, not yet in the request's `kv_slots`
    )

    def __init__(self, capacity: int, draft_tokens: int = 0) -> None:
        """`draft_tokens`: K under speculative decoding (0: none)."""
        self.capacity = capacity
        self.draft_tokens = draft_tokens
        for name in self.COLUMNS:
            a = array("q", bytes(8 * capacity))
            setattr(self, name, a)
            view = np.frombuffer(a, dtype=np.int64) if capacity else np.zeros(0, np.int64)
            setattr(self, name + "_np", view)
        self.tag_np[:] = NO_TAG
        # The tails, TAIL entries a row: `array` for a row at a time, numpy views for columns.
        self.tail_tokens = array("q", bytes(8 * capacity * TAIL))
        self.tail_kv = array("q", bytes(8 * capacity * TAIL))
        self.tail_tokens_np = _matrix(self.tail_tokens, capacity)
        self.tail_kv_np = _matrix(self.tail_kv, capacity)
        self.requests: list[Request | None] = [None] * capacity  # by request slot
        self.owners: list[OutputSink | None] = []  # by owner number
        self._owner_ids: dict[int, int] = {}  # id(owner) -> owner number
        self._next_tag = 0

    # Typed views of the columns (set in __init__).
    computed: array[int]
    inflight: array[int]
    known: array[int]
    prompt_len: array[int]
    limit: array[int]
    stop_from: array[int]
    eos_stops: array[int]
    plain: array[int]
    drafts: array[int]
    skip: array[int]
    backoff: array[int]
    found: array[int]
    kept: array[int]
    tag: array[int]
    handle: array[int]
    owner: array[int]
    new_tokens: array[int]
    new_kv: array[int]
    computed_np: Column
    inflight_np: Column
    known_np: Column
    prompt_len_np: Column
    limit_np: Column
    stop_from_np: Column
    eos_stops_np: Column
    plain_np: Column
    drafts_np: Column
    skip_np: Column
    backoff_np: Column
    found_np: Column
    kept_np: Column
    tag_np: Column
    handle_np: Column
    owner_np: Column
    new_tokens_np: Column
    new_kv_np: Column

    def owner_id(self, owner: OutputSink | None) -> int:
        key = id(owner)
        number = self._owner_ids.get(key)
        if number is None:
            number = self._owner_ids[key] = len(self.owners)
            self.owners.append(owner)
        return number

    def place(self, req: Request, slot: int, computed: int, inflight: int, kept: int) -> None:
        """`req` takes the row of `slot`, with its progress so far."""
        p = req.params
        prompt_len = len(req.prompt_ids)
        self.computed[slot] = computed
        self.inflight[slot] = inflight
        self.known[slot] = prompt_len + len(req.output_ids)
        self.prompt_len[slot] = prompt_len
        self.limit[slot] = prompt_len + p.max_new_tokens
        self.stop_from[slot] = prompt_len + p.min_tokens + 1
        self.eos_stops[slot] = not p.ignore_eos
        self.plain[slot] = not (p.logprobs or p.stop_token_ids)
        self.drafts[slot] = self.draft_tokens
        self.skip[slot] = self.backoff[slot] = 0
        self.found[slot] = 1  # until a step says otherwise
        self.kept[slot] = kept
        self.tag[slot] = self._next_tag
        self._next_tag += 1
        self.handle[slot] = req.handle
        self.owner[slot] = self.owner_id(req.owner)
        self.new_tokens[slot] = self.new_kv[slot] = 0
        self.requests[slot] = req

    def clear(self, slot: int) -> tuple[int, int, int]:
        """The row of `slot` is free again, its tails moved into its request's lists; returns
        what it held (computed, inflight, kept)."""
        req = self.requests[slot]
        if req is not None:
            self.flush(req, slot)
            self.requests[slot] = None
        held = self.computed[slot], self.inflight[slot], self.kept[slot]
        self.tag[slot] = NO_TAG
        return held

    # ---- the tails ---------------------------------------------------------------------

    def append_tokens(self, slots: Column, tokens: Column) -> None:
        """Each row of `slots` (distinct) gains its output token of `tokens`."""
        self._append(self.new_tokens_np, self.tail_tokens_np, slots, tokens)

    def append_kv(self, slots: Column, kv: Column) -> None:
        """Each row of `slots` (distinct) gains the KV slot of `kv` for its next position."""
        self._append(self.new_kv_np, self.tail_kv_np, slots, kv)

    def append_token(self, slot: int, token: int) -> None:
        """`append_tokens` for one row."""
        self._append_one(self.new_tokens, self.tail_tokens, slot, token)

    def append_kv_one(self, slot: int, kv_slot: int) -> None:
        """`append_kv` for one row."""
        self._append_one(self.new_kv, self.tail_kv, slot, kv_slot)

    def flush(self, req: Request, slot: int) -> None:
        """`req`'s (the row of `slot`'s) tails move into its lists."""
        n = self.new_tokens[slot]
        if n:
            at = slot * TAIL
            req.output_head.extend(self.tail_tokens[at : at + n])
            self.new_tokens[slot] = 0
        n = self.new_kv[slot]
        if n:
            at = slot * TAIL
            req.kv_head.extend(self.tail_kv[at : at + n])
            self.new_kv[slot] = 0

    def _append(self, counts: Column, tail: npt.NDArray[np.int64], slots: Column, values: Column) -> None:
        n = counts[slots]
        tail[slots, n] = values
        n += 1
        counts[slots] = n
        full = n == TAIL
        if np.count_nonzero(full):
            for slot in slots[full].tolist():
                self._flush_slot(slot)

    def _append_one(self, counts: array[int], tail: array[int], slot: int, value: int) -> None:
        n = counts[slot]
        tail[slot * TAIL + n] = value
        counts[slot] = n + 1
        if n + 1 == TAIL:
            self._flush_slot(slot)

    def _flush_slot(self, slot: int) -> None:
        req = self.requests[slot]
        assert req is not None, f"request slot {slot}: a tail without a request"
        self.flush(req, slot)


def _matrix(buffer: array[int], capacity: int) -> npt.NDArray[np.int64]:
    """`buffer` as a (capacity, TAIL) matrix, sharing its memory."""
    if not capacity:
        return np.zeros((0, TAIL), np.int64)
    return np.frombuffer(buffer, dtype=np.int64).reshape(capacity, TAIL)


class RowField:
    """A `Request` attribute kept in column `column` of its row while it holds a request slot,
    and in the request's own `_<name>` otherwise (`SessionSlots.assign` copies it in,
    `release` back)."""

    def __init__(self, column: str) -> None:
        self._column = column
        self._own = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self._own = "_" + name

    @overload
    def __get__(self, req: None, owner: type) -> RowField: ...
    @overload
    def __get__(self, req: Request, owner: type) -> int: ...
    def __get__(self, req: Request | None, owner: type) -> RowField | int:
        if req is None:
            return self
        rows = req.rows
        if rows is None:
            own: int = getattr(req, self._own)
            return own
        column: array[int] = getattr(rows, self._column)
        return column[req.req_slot]  # type: ignore[index]

    def __set__(self, req: Request, value: int) -> None:
        rows = req.rows
        if rows is None:
            setattr(req, self._own, value)
        else:
            column: array[int] = getattr(rows, self._column)
            column[req.req_slot] = value  # type: ignore[index]
