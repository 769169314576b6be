"""Free lists for the worker's KV pool slots and request slots."""

from __future__ import annotations


class SlotAllocator:
    """Hands out integer slots 0..capacity-1; a double free is a bug, not a no-op."""

    def __init__(self, capacity: int, name: str) -> None:
        self.capacity = capacity
        self.name = name
        # Popping from the end hands out low slots first.
        self._free = list(range(capacity - 1, -1, -1))
        self._in_use: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._in_use)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"{self.name}: {n} slots asked, {len(self._free)} free")
        slots = self._free[len(self._free) - n :]
        del self._free[len(self._free) - n :]
        self._in_use.update(slots)
        return slots

    def allocate_one(self) -> int:
        return self.allocate(1)[0]

    def free(self, slots: list[int]) -> None:
        for slot in slots:
            self._in_use.remove(slot)  # KeyError on a double free
        self._free.extend(slots)
