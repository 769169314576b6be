"""Packed columns on the links (stepahead/packed.py): each per-step message's columns round-trip
exactly at their types' bounds, and a column that is not one of this protocol's is refused
naming its field, on each side of each link."""

from __future__ import annotations

import asyncio

import pytest

from scheduler_svc.contract import NO_TOKEN, StepOutputs
from scheduler_svc.engine.transport import WorkerUnavailable
from scheduler_svc.process.link.codec import outputs_from_proto, outputs_to_proto
from scheduler_svc.process.worker_link import PendingSteps
from stepahead.packed import I32, U8, U32, U64, pack, unpack, unpack_flags
from stepahead.protocol import (
    Launch,
    StepResult,
    launch_from_proto,
    launch_to_proto,
    result_from_proto,
    result_to_proto,
)
from stepahead.v1 import core_pb2, worker_pb2

BOUNDS = {U8: (0, 255), U32: (0, 2**32 - 1), I32: (-(2**31), 2**31 - 1), U64: (0, 2**64 - 1)}


@pytest.mark.parametrize("typecode", list(BOUNDS))
def test_a_column_round_trips_at_its_bounds_little_endian(typecode: str) -> None:
    low, high = BOUNDS[typecode]  # type: ignore[index]
    values = [low, high, 1, low + 7, high - 3]
    data = pack(typecode, values)  # type: ignore[arg-type]
    size = len(data) // len(values)
    assert data[size : 2 * size] == high.to_bytes(size, "little", signed=low < 0)
    assert unpack(typecode, data, "f") == values  # type: ignore[arg-type]
    with pytest.raises((OverflowError, ValueError)):
        pack(typecode, [high + 1])  # type: ignore[arg-type]


def test_a_column_of_part_elements_or_odd_flags_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"^kv_slots: 7 bytes, not a whole number of 4-byte elements$"):
        unpack(U32, bytes(7), "kv_slots")
    with pytest.raises(ValueError, match=r"^row_sample: a flag byte other than 0 or 1$"):
        unpack_flags(b"\x01\x00\x02", "row_sample")
    assert unpack_flags(b"\x01\x00", "row_sample") == [True, False]
    assert unpack(U64, b"", "handles") == [] and unpack_flags(b"", "x") == []


def test_a_launch_a_result_and_step_outputs_round_trip() -> None:
    launch = Launch(
        9,
        released_slots=[3],
        row_req_slots=[0, 5, 2**32 - 1],
        row_start_pos=[0, 17, 4],
        row_num_tokens=[3, 1, 1],
        row_from_future=[False, True, True],
        row_sample=[False, True, True],
        prompt_ids=[65, 66, 2**32 - 1],
        kv_slots=[10, 11, 12, 13, 2**32 - 1],
    )
    assert (
        launch_from_proto(worker_pb2.Launch.FromString(launch_to_proto(launch).SerializeToString())) == launch
    )
    result = StepResult(9, [7, 2**32 - 1], 1.5, 2.5, 4, None, 0.25)
    wire = worker_pb2.StepResult.FromString(result_to_proto(result).SerializeToString())
    assert result_from_proto(wire) == result
    outputs = StepOutputs([2**64 - 1, 0, 5], [NO_TOKEN, 2**31 - 1, 0], [0, 2, 3])
    wire_outputs = core_pb2.StepOutputs.FromString(outputs_to_proto(outputs).SerializeToString())
    assert outputs_from_proto(wire_outputs) == outputs


def test_a_step_outputs_message_cut_short_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"^handles: 12 bytes"):
        outputs_from_proto(core_pb2.StepOutputs(handles=bytes(12)))


def test_a_malformed_result_fails_its_step_and_every_later_one() -> None:
    async def scenario() -> tuple[BaseException | None, BaseException | None, WorkerUnavailable | None]:
        steps = PendingSteps()
        first, second = steps.add(1), steps.add(2)
        cut = worker_pb2.StepResult(step_id=1, token_ids=b"\x01\x00")
        steps.deliver(worker_pb2.WorkerMessage(result=cut))
        return first.exception(), second.exception(), steps.failure

    first, second, failure = asyncio.run(scenario())
    assert isinstance(first, WorkerUnavailable) and "token_ids: 2 bytes" in str(first)
    assert isinstance(second, WorkerUnavailable) and failure is not None
