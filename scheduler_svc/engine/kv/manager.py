"""The one owner of the worker's KV slots on the scheduler's side (as nano-vllm's BlockManager
is): which slots are free, which the prefix cache holds, which are a request's own. The policy
asks it for room and for slots and tells it when a request ends; nothing else allocates or frees
a KV slot. One `KvManager` per worker session: a new session has none of the old one's KV.

A request's `kv_slots` hold its KV position by position; of those, `tree_slots` are the prefix
cache's (`prefix_cache.py`), the rest its own, freed here when it ends.
"""

from __future__ import annotations

from scheduler_svc.engine.kv.allocator import SlotAllocator
from scheduler_svc.engine.kv.prefix_cache import PrefixCache
from scheduler_svc.engine.kv.radix_cache import RadixCache
from scheduler_svc.engine.request import Request
from scheduler_svc.engine.rows import Column, SlotRows
from scheduler_svc.engine.telemetry import SchedulerTelemetry


class KvManager:
    def __init__(self, capacity: int, prefix_cache: bool, telemetry: SchedulerTelemetry) -> None:
        self._slots = SlotAllocator(capacity, "kv slots")
        self._cache = PrefixCache(self._slots, prefix_cache, telemetry)

    # ---- what is held --------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self._slots.capacity

    @property
    def num_free(self) -> int:
        """Slots nobody holds (not counting what eviction could give back)."""
        return self._slots.num_free

    @property
    def reclaimable(self) -> int:
        """Free slots plus those the prefix cache holds unreferenced (evictable)."""
        return self._cache.reclaimable

    @property
    def usage(self) -> float:
        """The share of the pool that requests hold (cached, unreferenced slots count as free)."""
        return (self.capacity - self.reclaimable) / self.capacity if self.capacity else 0.0

    @property
    def caching(self) -> bool:
        return self._cache.enabled

    @property
    def tree(self) -> RadixCache:
        """The prefix cache's tree, to read (its size, what is evictable)."""
        return self._cache.tree

    @property
    def cached_prompt_tokens(self) -> int:
        """Prompt tokens admitted requests found cached and did not compute."""
        return self._cache.cached_prompt_tokens

    @property
    def evicted(self) -> int:
        return self._cache.evicted

    # ---- what a request takes and gives back ---------------------------------------------

    def reuse_prefix(self, req: Request) -> bool:
        """A waiting `req` starts from the longest cached prefix of what it knows (locked, so
        that making room never evicts it); False when there is none to reuse."""
        match = self._cache.lookup(req)
        if match is None:
            return False
        self._cache.reuse(req, match)
        return True

    def make_room(self, need: int) -> bool:
        """Whether `need` slots can be had now, evicting unreferenced cached prefixes if the free
        ones fall short; nothing is evicted in vain."""
        return self._cache.make_room(need)

    def allocate(self, req: Request, n: int) -> list[int]:
        """`n` new slots for `req`'s next positions (after `make_room(n)` said yes)."""
        slots = self._slots.allocate(n)
        req.kv_slots.extend(slots)
        return slots

    def allocate_rows(self, rows: SlotRows, req_slots: Column | list[int]) -> list[int]:
        """One new slot for the next position of each request in `req_slots` (distinct request
        slots, after `make_room` said yes), in its row's tail (`SlotRows.append_kv`): a column
        at a time, or a row at a time for a list (a few rows)."""
        if isinstance(req_slots, list):
            taken = self._slots.allocate(len(req_slots))
            for req_slot, slot in zip(req_slots, taken, strict=True):
                rows.append_kv_one(req_slot, slot)
            return taken
        column = self._slots.allocate_column(len(req_slots))
        rows.append_kv(req_slots, column)
        slots: list[int] = column.tolist()
        return slots

    def allocate_verify(self, req: Request, drafts: int) -> list[int]:
        """`drafts` + 1 new slots for a verify row of `req` (after `make_room` said yes): the
        first for its pending token, at its next position; the drafts' held apart until the
        row's result says how many of them were accepted (`confirm_drafts`)."""
        slots = self._slots.allocate(drafts + 1)
        req.kv_slots.append(slots[0])
        req.draft_slots.append(slots[1:])
        return slots

    def confirm_drafts(self, req: Request, accepted: int, later_rows: int) -> None:
        """`req`'s oldest verify row accepted `accepted` drafts: their slots hold its next
        positions, after the row's first slot (and before the first slots of the `later_rows`
        verify rows launched after it); the rest are freed."""
        reserved = req.draft_slots.popleft()
        at = len(req.kv_slots) - later_rows
        req.kv_slots[at:at] = reserved[:accepted]
        self._slots.free(reserved[accepted:])

    def keep(self, req: Request, upto: int) -> None:
        """The prefix cache takes `req`'s KV of its first `upto` positions (computed ones)."""
        self._cache.keep(req, upto)

    def release(self, req: Request, computed: bool = True) -> None:
        """`req` gives back its KV: with `computed` (its KV exists: not a lost worker session)
        the prefix cache keeps what it computed; the slots that are its own are freed.

        NOTE: safe while a batch in flight still reads them: the worker runs batches in launch
        order, so every batch that can reuse a slot runs after the ones that hold it.
        """
        if req.kv_slots:
            self._slots.free(self._cache.release(req, computed))
            req.kv_slots = []
        while req.draft_slots:  # verify rows still in flight: their drafts' slots
            self._slots.free(req.draft_slots.popleft())
