"""A radix tree over token ids whose nodes own KV slots: the prefix cache's bookkeeping.

Synchronous, free of gRPC, asyncio and torch; the scheduling policy drives it. A node's key is
a run of token ids and its value the KV slots that hold them, one per token, position by
position from the root: a path from the root spells a prefix and names the slots of its KV.

    match(ids)               the longest cached prefix of `ids` (its slots and its last node)
    lock(node) / unlock(...) a live request uses the path to `node`: not evictable meanwhile
    relock(node, below)      move a lock down the path: from `node` to `below`, a node under it
    insert(ids, slots, at)   cache a computed prefix (walked from `at`, a node on its path, if
                             given); returns its last node and how many of `slots` it did not take
    evict(n)                 free up to `n` slots of unreferenced leaves, least recently used first

Eviction does not walk the tree: a heap of candidates (an unreferenced leaf, at its last use) is
kept as nodes become such leaves or are used again; an entry whose node has since been used,
locked, given a child or removed is skipped when it comes up. A server whose pool is full of
cached prefixes evicts at most of its admissions and steps, and a walk of a tree of thousands of
leaves each time cost milliseconds of the loop's CPU.

Invariants the policy relies on (tests/test_radix_cache.py checks them against a brute-force
model of the cache):
- A slot the tree holds is never written: the tree only takes slots whose KV is computed, and
  gives a slot back (`evict`) only when no live request references its node.
- `insert` never remaps: a prefix already cached keeps its slots, and the inserting request's
  duplicates stay its own (the caller frees them with the request). So a launched batch always
  reads the slots it was launched with.
- Every cached prefix's parent prefix is cached (the tree is prefix-closed); `evict` takes
  leaves only, so this holds after it too.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field


@dataclass(eq=False, slots=True)
class RadixNode:
    key: list[int] = field(default_factory=list)  # token ids of this edge
    slots: list[int] = field(default_factory=list)  # their KV slots, one each
    parent: RadixNode | None = None
    depth: int = 0  # token ids from the root to the end of its key
    children: dict[int, RadixNode] = field(default_factory=dict)  # by the child key's first id
    refs: int = 0  # live requests whose matched or inserted prefix runs through this node
    last_use: int = 0
    removed: bool = False  # evicted: no longer in the tree

    @property
    def is_evictable(self) -> bool:
        """An unreferenced leaf of the tree (the root never is one)."""
        return not self.children and self.refs == 0 and self.parent is not None and not self.removed

    @property
    def is_leaf(self) -> bool:
        return not self.children


@dataclass(frozen=True, slots=True)
class Match:
    """The longest cached prefix: its KV slots, and the node it ends in (the root: none)."""

    slots: list[int]
    node: RadixNode

    @property
    def length(self) -> int:
        return len(self.slots)


class RadixCache:
    def __init__(self) -> None:
        self.root = RadixNode()
        self.size = 0  # slots held by the tree
        self.evictable = 0  # of them, in nodes no live request references
        self._clock = itertools.count(1)
        # (last use, order, node): every evictable leaf at its last use, and stale entries
        self._candidates: list[tuple[int, int, RadixNode]] = []
        self._order = itertools.count()  # ties in last use go first offered first

    def match(self, ids: list[int]) -> Match:
        """The longest prefix of `ids` in the tree; a node that matches only part of its key is
        split, so the match always ends at a node boundary."""
        slots: list[int] = []
        node, _ = self._walk(self.root, ids, slots)
        return Match(slots, node)

    def _walk(
        self, node: RadixNode, ids: list[int], slots: list[int] | None = None, now: int = 0
    ) -> tuple[RadixNode, int]:
        """From `node` (a node on the path `ids` spells), down the longest path `ids` goes on
        spelling: its last node and depth, each node on it used `now` (0: a new tick), and the
        KV slots below `node` added to `slots`, where given."""
        now = now or next(self._clock)
        i = node.depth
        while i < len(ids) and (child := node.children.get(ids[i])) is not None:
            shared = _shared_length(child.key, ids, i)
            if shared < len(child.key):
                child = self._split(child, shared)
            if slots is not None:
                slots.extend(child.slots)
            child.last_use = now
            node, i = child, i + shared
        self._offer(node)  # used now: only the last node of the path can be a leaf
        return node, i

    def _touch(self, node: RadixNode) -> int:
        """`node` and its ancestors are used now, as a walk from the root to it would leave
        them; returns the tick."""
        now = next(self._clock)
        while node.parent is not None:
            node.last_use = now
            node = node.parent
        return now

    def lock(self, node: RadixNode) -> None:
        """A live request uses the prefix ending at `node`: none of its path may be evicted."""
        for n in _path(node):
            if n.refs == 0:
                self.evictable -= len(n.slots)
            n.refs += 1

    def relock(self, node: RadixNode, below: RadixNode) -> None:
        """`lock(below)` then `unlock(node)`, where `below` is `node` or a node under it: only the
        path between them changes hands."""
        n = below
        while n is not node:
            assert n.parent is not None, "relock below a node not under it"
            if n.refs == 0:
                self.evictable -= len(n.slots)
            n.refs += 1
            n = n.parent

    def unlock(self, node: RadixNode) -> None:
        for n in _path(node):
            n.refs -= 1
            if n.refs == 0:
                self.evictable += len(n.slots)
                self._offer(n)
            assert n.refs >= 0, "unlocked more often than locked"

    def insert(self, ids: list[int], slots: list[int], at: RadixNode | None = None) -> tuple[RadixNode, int]:
        """Cache `ids` whose KV is in `slots` (one each). Returns the node it ends in and how
        many leading entries of `slots` the tree did not take: their prefix was cached already
        (with other slots, which it keeps), so they stay the caller's. `at`: a node in the tree
        whose path `ids` starts with (a live request's locked node), where the walk starts; the
        tree is left as a walk from the root would leave it."""
        assert len(ids) == len(slots), "one KV slot per token"
        if at is None:
            parent, taken_from = self._walk(self.root, ids)
        else:
            assert not at.removed and at.depth <= len(ids)
            parent, taken_from = self._walk(at, ids, now=self._touch(at))
        if taken_from == len(ids):
            return parent, taken_from
        leaf = RadixNode(ids[taken_from:], slots[taken_from:], parent, len(ids))  # slices: copies
        leaf.last_use = next(self._clock)
        parent.children[leaf.key[0]] = leaf
        self.size += len(leaf.slots)
        self.evictable += len(leaf.slots)
        self._offer(leaf)
        return leaf, taken_from

    def evict(self, wanted: int) -> list[int]:
        """Free at least `wanted` slots if that many are evictable (else all that are): whole
        unreferenced leaves, least recently used first; a parent left childless and unreferenced
        becomes a leaf in its turn."""
        freed: list[int] = []
        candidates = self._candidates
        while len(freed) < wanted and candidates:
            entry = heapq.heappop(candidates)
            if not _current(entry):
                continue  # used, locked, given a child or removed since it was offered
            leaf = entry[2]
            parent = leaf.parent
            freed.extend(self._remove(leaf))
            if parent is not None:
                self._offer(parent)  # a leaf now, perhaps
        return freed

    def reset(self) -> list[int]:
        """Forget everything (a new worker session: the KV is gone); returns the slots held.
        Only while no live request holds a lock."""
        assert self.evictable == self.size, "reset with prefixes in use"
        slots = [s for n in self._nodes() for s in n.slots]
        self.root, self.size, self.evictable = RadixNode(), 0, 0
        self._candidates = []
        return slots

    def _offer(self, node: RadixNode) -> None:
        """`node`, if an evictable leaf, is a candidate at its last use. The heap is rebuilt from
        its live entries when stale ones outnumber the slots the tree holds."""
        if not node.is_evictable:
            return
        candidates = self._candidates
        heapq.heappush(candidates, (node.last_use, next(self._order), node))
        if len(candidates) > 2 * self.size + 64:
            live = [c for c in candidates if _current(c)]
            heapq.heapify(live)
            self._candidates = live

    def _split(self, node: RadixNode, at: int) -> RadixNode:
        """Cut `node`'s key after `at` ids; the new upper node keeps its references."""
        parent = node.parent
        assert parent is not None and 0 < at < len(node.key)
        upper = RadixNode(
            node.key[:at], node.slots[:at], parent, parent.depth + at, {}, node.refs, node.last_use
        )
        parent.children[upper.key[0]] = upper
        node.key, node.slots, node.parent = node.key[at:], node.slots[at:], upper
        upper.children[node.key[0]] = node
        return upper

    def _remove(self, leaf: RadixNode) -> list[int]:
        assert leaf.parent is not None and leaf.is_leaf and leaf.refs == 0
        del leaf.parent.children[leaf.key[0]]
        leaf.removed = True
        self.size -= len(leaf.slots)
        self.evictable -= len(leaf.slots)
        return leaf.slots

    def _nodes(self) -> list[RadixNode]:
        """Every node but the root."""
        found, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            found.append(node)
            stack.extend(node.children.values())
        return found


def _shared_length(key: list[int], ids: list[int], start: int) -> int:
    """How many leading ids of `key` equal `ids[start:]`'s. Lists compared a slice at a time, in
    C: a whole edge in one comparison (the common case), a partial one by halving; a Python
    loop over the ids cost a fully cached 2,000-token prompt about 100 µs at each lookup."""
    n = min(len(key), len(ids) - start)
    if key[:n] == ids[start : start + n]:
        return n
    shared, differs = 0, n  # key[:shared] matches; key[:differs] does not
    while differs - shared > 1:
        mid = (shared + differs) // 2
        if key[shared:mid] == ids[start + shared : start + mid]:
            shared = mid
        else:
            differs = mid
    return shared


def _current(candidate: tuple[int, int, RadixNode]) -> bool:
    """A candidate's node is still an evictable leaf, last used when it was offered."""
    last_use, _, node = candidate
    return node.is_evictable and node.last_use == last_use


def _path(node: RadixNode) -> list[RadixNode]:
    """`node` and its ancestors, the root excluded."""
    path = []
    while node.parent is not None:
        path.append(node)
        node = node.parent
    return path
