"""python -m bench.link_cost: what the core -> frontend link costs per step.

A real gRPC stream over a unix socket, as between the engine core and a frontend process: the
server side builds and sends one `StepOutputs` per step (`outputs_to_proto`), the client side
receives and decodes it (`outputs_from_proto`). Both sides run in this process, so the CPU time
per message is the two sides together. Prints one row per batch size.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc

from scheduler_svc.contract import StepOutputs
from scheduler_svc.process.link.codec import outputs_from_proto, outputs_to_proto
from stepahead.protocol import GRPC_OPTIONS
from stepahead.v1 import core_pb2, core_pb2_grpc

BATCH_SIZES = (64, 256, 512)


@dataclass(frozen=True)
class LinkRow:
    rows: int
    messages: int
    cpu_us_per_step: float  # both sides
    cpu_us_per_token: float
    bytes_per_step: int


def step_outputs(rows: int) -> StepOutputs:
    outputs = StepOutputs()
    for handle in range(rows):
        outputs.add(handle + 1, 32 + handle % 95, None)
    return outputs


class _Sender(core_pb2_grpc.EngineCoreServicer):
    """Only Attach: the other methods are never called here."""

    def __init__(self, rows: int, messages: int) -> None:
        self._rows, self._messages = rows, messages

    async def Attach(self, request_iterator: Any, context: Any) -> AsyncIterator[core_pb2.CoreMessage]:
        outputs = step_outputs(self._rows)
        for _ in range(self._messages):
            yield core_pb2.CoreMessage(outputs=outputs_to_proto(outputs))

    async def Abort(self, request: Any, context: Any) -> Any:
        raise NotImplementedError

    async def GetServerInfo(self, request: Any, context: Any) -> Any:
        raise NotImplementedError


async def measure(rows: int, messages: int) -> LinkRow:
    with tempfile.TemporaryDirectory() as private:
        server = grpc.aio.server(options=GRPC_OPTIONS)
        core_pb2_grpc.add_EngineCoreServicer_to_server(_Sender(rows, messages), server)
        server.add_insecure_port(f"unix:{private}/link.sock")
        await server.start()
        async with grpc.aio.insecure_channel(f"unix:{private}/link.sock", options=GRPC_OPTIONS) as channel:
            call = core_pb2_grpc.EngineCoreStub(channel).Attach()
            started = time.process_time()
            size = 0
            async for message in call:
                size = message.ByteSize()
                outputs_from_proto(message.outputs)
            cpu = time.process_time() - started
        await server.stop(0)
    per_step = cpu / messages * 1e6
    return LinkRow(rows, messages, per_step, per_step / rows, size)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.link_cost", description=__doc__)
    p.add_argument("--messages", type=int, default=2000)
    args = p.parse_args(argv)
    print("| rows per step | CPU µs per step (both sides) | CPU µs per token | bytes per step |")
    print("|---:|---:|---:|---:|")
    for rows in BATCH_SIZES:
        r = asyncio.run(measure(rows, args.messages))
        print(f"| {r.rows} | {r.cpu_us_per_step:.0f} | {r.cpu_us_per_token:.2f} | {r.bytes_per_step:,} |")


if __name__ == "__main__":
    main()
