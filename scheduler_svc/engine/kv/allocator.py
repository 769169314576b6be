"""Free lists for the worker's KV pool slots and request slots."""

from __future__ import annotations

from array import array

import numpy as np
import numpy.typing as npt


class SlotAllocator:
    """Hands out integer slots 0..capacity-1; a double free is a bug, not a no-op.

    NOTE: the free stack and the in-use map are flat arrays, not lists or sets of
    ints: a KV pool has up to millions of slots, and a container of that many
    objects makes every full garbage collection walk it, stalling the event loop
    for milliseconds (long enough to leave the device idle).
    """

    def __init__(self, capacity: int, name: str) -> None:
        self.capacity = capacity
        self.name = name
        # Popping from the end hands out low slots first.
        self._free = array("q", range(capacity - 1, -1, -1))
        self._in_use = bytearray(capacity)
        self._in_use_np = np.frombuffer(self._in_use, dtype=np.uint8) if capacity else np.zeros(0, np.uint8)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > 8:
            slots: list[int] = self.allocate_column(n).tolist()
            return slots
        if n > len(self._free):
            raise MemoryError(f"{self.name}: {n} slots asked, {len(self._free)} free")
        slots = self._free[len(self._free) - n :].tolist()
        del self._free[len(self._free) - n :]
        for slot in slots:
            self._in_use[slot] = 1
        return slots

    def allocate_column(self, n: int) -> npt.NDArray[np.int64]:
        """`allocate`, as an array (no Python int per slot)."""
        if n > len(self._free):
            raise MemoryError(f"{self.name}: {n} slots asked, {len(self._free)} free")
        taken = self._free[len(self._free) - n :]  # a copy: the free stack stays resizable
        del self._free[len(self._free) - n :]
        column = np.frombuffer(taken, dtype=np.int64) if n else np.zeros(0, np.int64)
        self._in_use_np[column] = 1
        return column

    def allocate_one(self) -> int:
        return self.allocate(1)[0]

    def free(self, slots: list[int]) -> None:
        if len(slots) > 8 and self._in_use_np[slots].all() and len(set(slots)) == len(slots):
            self._in_use_np[slots] = 0  # the common case, a column at a time
        else:
            for i, slot in enumerate(slots):
                if not self._in_use[slot]:
                    for freed in slots[:i]:  # nothing freed in vain: the call changes nothing
                        self._in_use[freed] = 1
                    raise ValueError(f"{self.name}: slot {slot} freed twice")
                self._in_use[slot] = 0
        self._free.extend(slots)
