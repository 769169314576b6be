"""Free lists for the worker's KV pool slots and request slots."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt


class SlotAllocator:
    """Hands out integer slots 0..capacity-1; a double free is a bug, not a no-op.

    NOTE: the free stack and the in-use map are flat arrays, not lists or sets of
    ints: a KV pool has up to millions of slots, and a container of that many
    objects makes every full garbage collection walk it, stalling the event loop
    for milliseconds (long enough to leave the device idle). The stack is allocated
    once, at its full size, with a count of the free slots on it: a resizable one
    (`array`) is reallocated whenever it shrinks by more than a few elements, which a
    step's column of new KV slots always does, and for a pool of millions of slots that is
    an `mremap` of megabytes (and a TLB flush) every step.
    """

    def __init__(self, capacity: int, name: str) -> None:
        self.capacity = capacity
        self.name = name
        # Taking from the top hands out low slots first.
        self._stack = np.arange(capacity - 1, -1, -1, dtype=np.int64)
        self._top = capacity  # the free slots are _stack[:_top]
        self._in_use = bytearray(capacity)
        self._in_use_np = np.frombuffer(self._in_use, dtype=np.uint8) if capacity else np.zeros(0, np.uint8)

    @property
    def num_free(self) -> int:
        return self._top

    @property
    def num_used(self) -> int:
        return self.capacity - self._top

    def can_allocate(self, n: int) -> bool:
        return n <= self._top

    def allocate(self, n: int) -> list[int]:
        if n > 8:
            slots: list[int] = self.allocate_column(n).tolist()
            return slots
        top = self._top
        if n > top:
            raise MemoryError(f"{self.name}: {n} slots asked, {top} free")
        slots = self._stack[top - n : top].tolist()
        self._top = top - n
        for slot in slots:
            self._in_use[slot] = 1
        return slots

    def allocate_column(self, n: int) -> npt.NDArray[np.int64]:
        """`allocate`, as an array (no Python int per slot)."""
        top = self._top
        if n > top:
            raise MemoryError(f"{self.name}: {n} slots asked, {top} free")
        column = self._stack[top - n : top].copy()  # a copy: the stack's top is written again
        self._top = top - n
        self._in_use_np[column] = 1
        return column

    def allocate_one(self) -> int:
        return self.allocate(1)[0]

    def free_one(self, slot: int) -> None:
        """`free([slot])`."""
        if not self._in_use[slot]:
            raise ValueError(f"{self.name}: slot {slot} freed twice")
        self._in_use[slot] = 0
        self._stack[self._top] = slot
        self._top += 1

    def free(self, slots: list[int]) -> None:
        column = np.array(slots, np.int64) if len(slots) > 8 else None  # converted once
        if column is not None and self._in_use_np[column].all() and len(set(slots)) == len(slots):
            self._in_use_np[column] = 0  # the common case, a column at a time
        else:
            for i, slot in enumerate(slots):
                if not self._in_use[slot]:
                    for freed in slots[:i]:  # nothing freed in vain: the call changes nothing
                        self._in_use[freed] = 1
                    raise ValueError(f"{self.name}: slot {slot} freed twice")
                self._in_use[slot] = 0
        top = self._top  # every slot was in use, so the stack has room for them all
        self._stack[top : top + len(slots)] = slots if column is None else column
        self._top = top + len(slots)
