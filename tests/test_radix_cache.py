"""The prefix cache's radix tree against a brute-force model: every cached prefix and its KV
slot, under random sequences of insert, match, lock, unlock and evict."""

from __future__ import annotations

import copy
import heapq
import itertools
import random
from collections import Counter

import pytest

from scheduler_svc.engine.kv.radix_cache import RadixCache, RadixNode, _shared_length

Prefix = tuple[int, ...]


class Model:
    """Every cached prefix -> the KV slot of its last token; the locks, as prefixes."""

    def __init__(self) -> None:
        self.cached: dict[Prefix, int] = {}
        self.locks: list[tuple[RadixNode, Prefix]] = []

    def cached_length(self, ids: list[int]) -> int:
        n = 0
        while n < len(ids) and tuple(ids[: n + 1]) in self.cached:
            n += 1
        return n

    def insert(self, ids: list[int], slots: list[int]) -> int:
        taken_from = self.cached_length(ids)
        for i in range(taken_from, len(ids)):
            self.cached[tuple(ids[: i + 1])] = slots[i]
        return taken_from

    def locked_prefixes(self) -> set[Prefix]:
        return {p[:i] for _, p in self.locks for i in range(1, len(p) + 1)}

    def evictable(self) -> int:
        locked = self.locked_prefixes()
        return sum(p not in locked for p in self.cached)


def random_ids(rng: random.Random, stems: list[list[int]]) -> list[int]:
    """A prompt that often shares a stem (a system prompt) and a bit more with earlier ones."""
    stem = rng.choice(stems)[: rng.randint(0, 12)]
    return stem + [rng.randrange(6) for _ in range(rng.randint(1 if not stem else 0, 8))] or [0]


def evict_by_a_walk(cache: RadixCache, wanted: int) -> list[int]:
    """Eviction as a walk of the whole tree finds it: every unreferenced leaf, least recently
    used first, a parent left an unreferenced leaf joining them."""
    freed: list[int] = []
    order = itertools.count()
    leaves = [(n.last_use, next(order), n) for n in cache._nodes() if n.is_leaf and n.refs == 0]
    heapq.heapify(leaves)
    while len(freed) < wanted and leaves:
        leaf = heapq.heappop(leaves)[2]
        parent = leaf.parent
        freed.extend(cache._remove(leaf))
        if parent is not None and parent is not cache.root and parent.is_leaf and parent.refs == 0:
            heapq.heappush(leaves, (parent.last_use, next(order), parent))
    return freed


def lock_on_path(model: Model, ids: list[int], rng: random.Random) -> int | None:
    """Half the time, the index of a lock whose prefix `ids` starts with, if there is one."""
    on_path = [i for i, (_, prefix) in enumerate(model.locks) if tuple(ids[: len(prefix)]) == prefix]
    return rng.choice(on_path) if on_path and rng.random() < 0.5 else None


def check_tree(cache: RadixCache, model: Model) -> None:
    """Same prefixes, same slots, prefix-closed, sizes exact, every slot held once."""
    assert cache.size == len(model.cached)
    assert cache.evictable == model.evictable()
    for prefix, slot in model.cached.items():
        assert prefix[:-1] == () or prefix[:-1] in model.cached
        assert cache.match(list(prefix)).slots[-1] == slot
    assert len(set(model.cached.values())) == len(model.cached)


@pytest.mark.parametrize("seed", range(8))
def test_random_operations_agree_with_the_brute_force_model(seed: int) -> None:
    rng = random.Random(seed)
    cache, model = RadixCache(), Model()
    stems = [[rng.randrange(6) for _ in range(12)] for _ in range(3)]
    next_slot, free = 0, 0  # slots handed out, and given back (by eviction or not taken)
    for _ in range(400):
        op = rng.random()
        ids = random_ids(rng, stems)
        if op < 0.35:
            slots = list(range(next_slot, next_slot + len(ids)))
            next_slot += len(ids)
            # As a live request keeps what it computed: walked from the node it holds, whose
            # lock then moves down to the node its tokens end in.
            holder = lock_on_path(model, ids, rng)
            at = None if holder is None else model.locks[holder][0]
            node, not_taken = cache.insert(ids, slots, at)
            assert not_taken == model.insert(ids, slots)
            free += not_taken
            if holder is not None and rng.random() < 0.5:
                cache.relock(model.locks[holder][0], node)
                model.locks[holder] = (node, tuple(ids))
            elif rng.random() < 0.5:
                cache.lock(node)
                model.locks.append((node, tuple(ids)))
        elif op < 0.6:
            match = cache.match(ids)
            n = model.cached_length(ids)
            assert match.slots == [model.cached[tuple(ids[: i + 1])] for i in range(n)]
            if n and rng.random() < 0.5:
                cache.lock(match.node)
                model.locks.append((match.node, tuple(ids[:n])))
        elif op < 0.8 and model.locks:
            node, _ = model.locks.pop(rng.randrange(len(model.locks)))
            cache.unlock(node)
        else:
            wanted, evictable = rng.randint(1, 20), model.evictable()
            locked = model.locked_prefixes()
            expected = evict_by_a_walk(copy.deepcopy(cache), wanted)
            freed = cache.evict(wanted)
            assert freed == expected, "the candidates' heap evicts what a walk of the tree would"
            assert len(freed) >= wanted if evictable >= wanted else len(freed) == evictable
            gone = {p for p, s in model.cached.items() if s in set(freed)}
            assert len(gone) == len(freed) and not gone & locked, "only unlocked prefixes go"
            for prefix in gone:
                del model.cached[prefix]
            free += len(freed)
        check_tree(cache, model)
    assert free + cache.size == next_slot, "every slot handed out is cached or given back"
    for node, _ in model.locks:
        cache.unlock(node)
    assert cache.evictable == cache.size
    assert sorted(cache.reset()) == sorted(model.cached.values()) and cache.size == 0


def shape(cache: RadixCache) -> list[tuple[object, ...]]:
    """Every node as a walk from the root sees it: its path, slots, depth, references, last use."""
    rows: list[tuple[object, ...]] = []
    stack: list[tuple[RadixNode, Prefix]] = [(cache.root, ())]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():
            spelled = (*path, *child.key)
            assert child.depth == len(spelled) and child.parent is node
            rows.append((spelled, tuple(child.slots), child.refs, child.last_use, child.removed))
            stack.append((child, spelled))
    return sorted(rows, key=repr)


@pytest.mark.parametrize("seed", range(4))
def test_an_insert_walked_from_a_held_node_leaves_the_tree_as_one_from_the_root(seed: int) -> None:
    """`insert(ids, slots, at)` (a request keeps its KV from the node it holds) and `relock` (its
    lock moves down) against `insert` from the root, `lock` and `unlock`, on copies of one tree:
    the same nodes, splits, references, last uses, evictable count and eviction order."""
    rng = random.Random(seed)
    stems = [[rng.randrange(4) for _ in range(10)] for _ in range(2)]
    walked, rooted = RadixCache(), RadixCache()
    held: list[RadixNode] = []  # in `walked`
    held_rooted: list[RadixNode] = []  # the same locks in `rooted`
    spelled: list[Prefix] = []  # what each held node's path spells
    next_slot = 0
    for _ in range(150):
        ids = random_ids(rng, stems)
        slots = list(range(next_slot, next_slot + len(ids)))
        next_slot += len(ids)
        on_path = [
            (i, n) for i, (n, p) in enumerate(zip(held, spelled, strict=True)) if tuple(ids[: len(p)]) == p
        ]
        if on_path and rng.random() < 0.7:
            i, at = rng.choice(on_path)
            node, not_taken = walked.insert(ids, slots, at)
            rooted_node, rooted_not_taken = rooted.insert(ids, slots)
            walked.relock(at, node)
            rooted.lock(rooted_node)
            rooted.unlock(held_rooted[i])
            held[i], held_rooted[i], spelled[i] = node, rooted_node, tuple(ids)
        else:
            node, not_taken = walked.insert(ids, slots)
            rooted_node, rooted_not_taken = rooted.insert(ids, slots)
            if rng.random() < 0.4:
                walked.lock(node)
                rooted.lock(rooted_node)
                held.append(node)
                held_rooted.append(rooted_node)
                spelled.append(tuple(ids))
        assert not_taken == rooted_not_taken
        if held and rng.random() < 0.1:
            i = rng.randrange(len(held))
            walked.unlock(held.pop(i))
            rooted.unlock(held_rooted.pop(i))
            spelled.pop(i)
        if rng.random() < 0.15:
            wanted = rng.randint(1, 15)
            assert walked.evict(wanted) == rooted.evict(wanted)
        assert shape(walked) == shape(rooted)
        assert (walked.size, walked.evictable) == (rooted.size, rooted.evictable)


def test_eviction_takes_the_least_recently_used_leaf_first() -> None:
    cache = RadixCache()
    cache.insert([1, 2, 3], [10, 11, 12])
    cache.insert([1, 2, 4], [20, 21, 22])  # shares [1, 2]: its first two slots stay the caller's
    cache.insert([5], [30])
    cache.match([1, 2, 3])  # now the most recently used
    assert cache.evict(1) == [22]
    assert cache.evict(1) == [30]
    assert Counter(cache.evict(10)) == Counter([12, 10, 11])
    assert cache.size == cache.evictable == 0


def test_a_locked_prefix_survives_any_eviction_and_its_split_keeps_the_lock() -> None:
    cache = RadixCache()
    node, _ = cache.insert([1, 2, 3, 4], [0, 1, 2, 3])
    cache.lock(node)
    cache.insert([1, 2, 9], [4, 5, 6])  # splits [1, 2, 3, 4] after [1, 2]
    assert cache.evict(100) == [6]
    assert cache.match([1, 2, 3, 4]).slots == [0, 1, 2, 3]
    cache.unlock(node)
    assert sorted(cache.evict(100)) == [0, 1, 2, 3]


def test_insert_never_remaps_a_cached_prefix() -> None:
    cache = RadixCache()
    cache.insert([7, 8], [0, 1])
    node, not_taken = cache.insert([7, 8, 9], [5, 6, 7])
    assert not_taken == 2  # slots 5 and 6 stay the inserting request's
    assert cache.match([7, 8, 9]).slots == [0, 1, 7] and node.slots == [7]


def test_shared_length_is_the_first_difference_at_every_position() -> None:
    """The slice-halving comparison against a token-by-token walk: every place the first
    difference can be, edges longer and shorter than what is left of the ids, any start."""
    key = list(range(100, 140))
    for start in range(4):
        for cut in range(len(key) + 1):
            ids = [7] * start + key[:cut] + [1, 2, 3] + key[cut + 3 :]
            for end in (len(ids), start + cut // 2, start):  # ids shorter than the key too
                short = ids[:end]
                walked = 0
                while walked < min(len(key), len(short) - start) and key[walked] == short[start + walked]:
                    walked += 1
                assert _shared_length(key, short, start) == walked, (start, cut, end)


def test_eviction_walks_no_tree(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool full of cached prefixes evicts at every admission: the least recently used leaves
    come off the candidates' heap, with no walk of the tree however many leaves it has."""
    cache = RadixCache()
    for i in range(500):
        cache.insert([i, 1, 2], [3 * i, 3 * i + 1, 3 * i + 2])
    cache.match([7, 1, 2])  # used again: the last to go
    monkeypatch.setattr(RadixCache, "_nodes", lambda self: pytest.fail("the tree was walked"))
    assert cache.evict(4) == [0, 1, 2, 3, 4, 5]
    assert cache.evict(3 * 497) == [s for i in range(2, 500) if i != 7 for s in (3 * i, 3 * i + 1, 3 * i + 2)]
    assert cache.evict(1) == [21, 22, 23] and cache.size == cache.evictable == 0
