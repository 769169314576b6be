"""The scheduling policy's prefix cache: what a request reuses when it is admitted, what it
leaves in the radix tree (`scheduler_svc/engine/kv/radix_cache.py`) when its prompt is processed and when
it ends, and which of its KV slots are its own to free.

A request's `kv_slots` hold its KV position by position; `tree_slots` are those the tree holds
(matched at admission, or handed over since), the rest are the request's own. The request locks
the tree node its cached prefix ends in, so nothing it reads is evicted while it lives.

NOTE (overlap safety):
- Only KV that a launched batch computed enters the tree: the known tokens below
  `num_computed`, never an in-flight token. A batch that reads a cached slot is launched after
  the batch that wrote it, and the worker runs batches in launch order.
- Inserting never remaps: a request keeps the slots its batches were launched with, and a
  duplicate of a prefix the tree already holds stays the request's own until it ends.
- An evicted slot is reused only by a batch picked after the eviction, so after every batch
  that read it was launched (the argument `SessionSlots.release` makes for freeing).
- A new worker session has none of the KV: the policy starts an empty cache with it.
"""

from __future__ import annotations

import itertools

from scheduler_svc.engine.kv.allocator import SlotAllocator
from scheduler_svc.engine.kv.radix_cache import Match, RadixCache
from scheduler_svc.engine.request import Request
from scheduler_svc.engine.telemetry import SchedulerTelemetry


class PrefixCache:
    """Disabled, it matches nothing and keeps nothing: every slot is its request's own."""

    def __init__(self, kv: SlotAllocator, enabled: bool, telemetry: SchedulerTelemetry) -> None:
        self.kv = kv
        self.enabled = enabled
        self.telemetry = telemetry
        self.tree = RadixCache()
        self.cached_prompt_tokens = 0  # prompt tokens admitted requests did not compute
        self.evicted = 0  # slots given back by eviction

    def lookup(self, req: Request) -> Match | None:
        """The cached prefix of what `req` knows, leaving at least its last token to compute
        (the step that computes it samples the next). None: nothing to reuse.

        NOTE: a penalized request computes its whole prompt, so that the worker's token history
        (which it fills from prefill rows) holds every prompt token; one that asks for its
        prompt's log-probabilities does, so that each is scored (`SamplingParams.computes_prompt`).
        """
        if not self.enabled or req.params.computes_prompt:
            return None
        match = self.tree.match(req.known_ids(0, req.num_known - 1))
        return match if match.length else None

    def reuse(self, req: Request, match: Match) -> None:
        """`req`, being admitted, starts from the matched prefix."""
        self.tree.lock(match.node)
        req.cache_node = match.node
        req.kv_slots = list(match.slots)
        req.tree_slots = set(match.slots)
        req.num_computed = match.length
        if req.attempt == 0:
            hit = min(match.length, len(req.prompt_ids))
            req.cached_prompt_tokens = hit
            self.cached_prompt_tokens += hit
            self.telemetry.cache_hit_tokens.inc(hit)

    def keep(self, req: Request, upto: int, hold: bool = True) -> None:
        """The tree takes `req`'s KV of its first `upto` positions where it holds none yet; with
        `hold`, `req` locks the node they end in (instead of the one it held). The tree is walked
        from the node `req` holds, which spells the start of what it knows."""
        if not self.enabled or upto < 1:
            return
        kv_slots, held = req.kv_slots, req.cache_node
        slots = kv_slots if upto == len(kv_slots) else kv_slots[:upto]  # the tree copies what it takes
        node, taken_from = self.tree.insert(req.known_ids(0, upto), slots, held)
        req.tree_slots.update(itertools.islice(kv_slots, taken_from, upto))
        if hold:
            if held is None:
                self.tree.lock(node)
            else:
                self.tree.relock(held, node)
            req.cache_node = node

    def release(self, req: Request, computed: bool) -> list[int]:
        """`req` ends (or waits to be recomputed): with `computed` (its KV exists: not a lost
        worker session) the tree keeps what it computed of the tokens it knows. Returns the
        slots that are the request's own, for the caller to free."""
        if computed:
            self.keep(req, min(req.num_computed, req.num_known), hold=False)  # let go at once
        if req.cache_node is not None:
            self.tree.unlock(req.cache_node)
            req.cache_node = None
        kv_slots, tree_slots = req.kv_slots, req.tree_slots
        # The tree's are some of its slots: when they are as many, it has no slot of its own.
        own = [] if len(tree_slots) == len(kv_slots) else [s for s in kv_slots if s not in tree_slots]
        req.tree_slots = set()
        return own

    def make_room(self, need: int) -> bool:
        """Whether `need` KV slots can be had, evicting unreferenced cached prefixes (least
        recently used first) when the free ones fall short; nothing is evicted in vain."""
        short = need - self.kv.num_free
        if short <= 0:
            return True
        if short > self.tree.evictable:
            return False
        freed = self.tree.evict(short)
        self.kv.free(freed)
        self.evicted += len(freed)
        self.telemetry.cache_evicted_slots.inc(len(freed))
        return True

    @property
    def reclaimable(self) -> int:
        """Free slots plus those eviction could give back."""
        return self.kv.num_free + self.tree.evictable
