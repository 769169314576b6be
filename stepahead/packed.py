"""Packed columns on the links: a list of ints as a little-endian array in a protobuf `bytes`
field (the per-step messages' columns: Launch and StepResult in worker.proto, StepOutputs in
core.proto).

A repeated field costs the protobuf runtime a Python object per element on each side, both
to build and to read, and a step's message carries one element per row or token of its batch; an
`array` is built from a list, and read back into one, in a single C call: about half the CPU of
building and of reading each per-step message (docs/BENCHMARKS.md, "Packed columns on the links").
"""

from __future__ import annotations

import array
import sys
from collections.abc import Iterable
from typing import Literal

# The array typecodes of the wire's element types, checked for their sizes below.
Typecode = Literal["B", "I", "i", "Q"]
U8: Typecode = "B"
U32: Typecode = "I"
I32: Typecode = "i"
U64: Typecode = "Q"
_SIZES = {U8: 1, U32: 4, I32: 4, U64: 8}
for _code, _size in _SIZES.items():
    if array.array(_code).itemsize != _size:  # pragma: no cover - no such platform in sight
        raise ImportError(f"array typecode {_code!r} is not {_size} bytes on this platform")

_SWAP = sys.byteorder != "little"


def pack(typecode: Typecode, values: Iterable[int]) -> bytes:
    """`values` as the wire's little-endian array (OverflowError, or ValueError for a u8: a value
    out of the type's range)."""
    if typecode == U8:
        return bytes(values)
    column = array.array(typecode, values)
    if _SWAP:  # pragma: no cover - big-endian hosts only
        column.byteswap()
    return column.tobytes()


def unpack(typecode: Typecode, data: bytes, field: str) -> list[int]:
    """The wire's array back as a list; ValueError naming `field` when its length is not a whole
    number of elements (a peer that is not this protocol's)."""
    column = array.array(typecode)
    if len(data) % column.itemsize:
        raise ValueError(f"{field}: {len(data)} bytes, not a whole number of {column.itemsize}-byte elements")
    column.frombytes(data)
    if _SWAP:  # pragma: no cover - big-endian hosts only
        column.byteswap()
    return column.tolist()


def unpack_flags(data: bytes, field: str) -> list[bool]:
    """A u8 column of flags (0 or 1) as bools; ValueError naming `field` for any other byte."""
    if data and max(data) > 1:
        raise ValueError(f"{field}: a flag byte other than 0 or 1")
    return list(map(bool, data))
