"""python -m bench.link_cost: what the core -> frontend link costs per step, framed against gRPC.

One `StepOutputs` per step built with `outputs_to_proto` and sent over a unix socket, received
and decoded with `outputs_from_proto`, as between the engine core and a frontend process. Two
wires side by side in one run: the link as it is (`framed`: length-prefixed frames,
`stepahead/framing.py`) and a gRPC bidirectional stream carrying the same
messages (`grpc`: what the link was before). Both ends run in this process on this event loop,
so the CPU per message is the two sides together. Messages go out one every `--interval-ms`,
as steps do (a burst would let one read take many messages and hide the per-message wakeup);
the cost of the timer alone, measured the same way with nothing sent, is subtracted.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from bench.machine import loop_calibration
from scheduler_svc.contract import StepOutputs
from scheduler_svc.process.link.codec import outputs_from_proto, outputs_to_proto
from stepahead.event_loop import run as run_loop
from stepahead.framing import FrameProtocol
from stepahead.protocol import GRPC_OPTIONS
from stepahead.v1 import core_pb2

BATCH_SIZES = (64, 256, 512)
WIRES = ("framed", "grpc")
METHOD = "/stepahead.bench.Link/Attach"


@dataclass(frozen=True)
class LinkRow:
    wire: str
    rows: int
    messages: int
    cpu_us_per_step: float  # both sides, the timer's own cost taken off
    cpu_us_per_token: float
    bytes_per_step: int


def step_outputs(rows: int) -> StepOutputs:
    outputs = StepOutputs()
    for handle in range(rows):
        outputs.add(handle + 1, 32 + handle % 95, None)
    return outputs


async def _paced(messages: int, interval_s: float, send: Callable[[], None]) -> None:
    """Calls `send` `messages` times, one every `interval_s`."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    start = loop.time()

    def tick(i: int) -> None:
        if i == messages:
            done.set_result(None)
            return
        send()
        loop.call_at(start + (i + 1) * interval_s, tick, i + 1)

    tick(0)
    await done


async def _cpu(body: Callable[[], Awaitable[int]]) -> tuple[float, int]:
    started = time.process_time()
    size = await body()
    return time.process_time() - started, size


async def _framed(
    message: core_pb2.CoreMessage, messages: int, interval_s: float, private: str
) -> tuple[float, int]:
    loop = asyncio.get_running_loop()
    received: list[int] = []
    got_all = loop.create_future()

    def on_frame(m: core_pb2.CoreMessage) -> None:
        outputs_from_proto(m.outputs)
        received.append(m.ByteSize())
        if len(received) == messages:
            got_all.set_result(None)

    server_side: list[FrameProtocol[core_pb2.FrontendMessage]] = []

    def accept() -> FrameProtocol[core_pb2.FrontendMessage]:
        wire = FrameProtocol(core_pb2.FrontendMessage.FromString, lambda m: None, lambda e: None)
        server_side.append(wire)
        return wire

    server = await loop.create_unix_server(accept, f"{private}/framed.sock")
    _, client = await loop.create_unix_connection(
        lambda: FrameProtocol(core_pb2.CoreMessage.FromString, on_frame, lambda e: None),
        f"{private}/framed.sock",
    )
    while not server_side:
        await asyncio.sleep(0.001)
    sender = server_side[0]

    async def body() -> int:
        await _paced(
            messages, interval_s, lambda: sender.send(core_pb2.CoreMessage(outputs=outputs_to_proto(outputs)))
        )
        await got_all
        return received[-1]

    outputs = outputs_from_proto(message.outputs)
    try:
        return await _cpu(body)
    finally:
        client.close()
        server.close()
        await server.wait_closed()


async def _grpc(
    message: core_pb2.CoreMessage, messages: int, interval_s: float, private: str
) -> tuple[float, int]:
    outputs = outputs_from_proto(message.outputs)
    queue: asyncio.Queue[core_pb2.CoreMessage | None] = asyncio.Queue()

    async def attach(request_iterator: Any, context: Any) -> Any:
        while (m := await queue.get()) is not None:
            yield m

    handler = grpc.method_handlers_generic_handler(
        "stepahead.bench.Link",
        {
            "Attach": grpc.stream_stream_rpc_method_handler(
                attach,
                request_deserializer=core_pb2.FrontendMessage.FromString,
                response_serializer=core_pb2.CoreMessage.SerializeToString,
            )
        },
    )
    server = grpc.aio.server(options=GRPC_OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"unix:{private}/grpc.sock")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"unix:{private}/grpc.sock", options=GRPC_OPTIONS) as channel:
            call = channel.stream_stream(
                METHOD,
                request_serializer=core_pb2.FrontendMessage.SerializeToString,
                response_deserializer=core_pb2.CoreMessage.FromString,
            )()
            await call.wait_for_connection()

            async def receive() -> int:
                size = 0
                for _ in range(messages):
                    m = await call.read()
                    assert isinstance(m, core_pb2.CoreMessage)
                    outputs_from_proto(m.outputs)
                    size = m.ByteSize()
                return size

            async def body() -> int:
                reader = asyncio.create_task(receive())
                await _paced(
                    messages,
                    interval_s,
                    lambda: queue.put_nowait(core_pb2.CoreMessage(outputs=outputs_to_proto(outputs))),
                )
                size = await reader
                queue.put_nowait(None)
                return size

            return await _cpu(body)
    finally:
        await server.stop(0)


async def _timer_only(messages: int, interval_s: float) -> float:
    cpu, _ = await _cpu(lambda: _paced_size(messages, interval_s))
    return cpu


async def _paced_size(messages: int, interval_s: float) -> int:
    await _paced(messages, interval_s, lambda: None)
    return 0


async def measure(rows: int, messages: int, wire: str = "framed", interval_ms: float = 1.0) -> LinkRow:
    message = core_pb2.CoreMessage(outputs=outputs_to_proto(step_outputs(rows)))
    interval_s = interval_ms / 1e3
    timer = await _timer_only(messages, interval_s)
    with tempfile.TemporaryDirectory() as private:
        run = _framed if wire == "framed" else _grpc
        cpu, size = await run(message, messages, interval_s, private)
    per_step = max(cpu - timer, 0.0) / messages * 1e6
    return LinkRow(wire, rows, messages, per_step, per_step / rows, size)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.link_cost", description=__doc__)
    p.add_argument("--messages", type=int, default=2000)
    p.add_argument("--interval-ms", type=float, default=1.0)
    args = p.parse_args(argv)
    print(f"machine: loop calibration {loop_calibration():.2f} s")
    print(
        "| rows per step | wire | CPU µs per step (both sides) | CPU µs per token "
        "| bytes per step | framed / grpc |"
    )
    print("|---:|---|---:|---:|---:|---:|")
    for rows in BATCH_SIZES:
        got = {wire: run_loop(measure(rows, args.messages, wire, args.interval_ms)) for wire in WIRES}
        for wire in WIRES:
            r = got[wire]
            ratio = got["framed"].cpu_us_per_step / got["grpc"].cpu_us_per_step if wire == "framed" else 1.0
            print(
                f"| {r.rows} | {r.wire} | {r.cpu_us_per_step:.0f} | {r.cpu_us_per_token:.2f} "
                f"| {r.bytes_per_step:,} | {ratio:.2f} |"
            )


if __name__ == "__main__":
    main()
