"""python -m bench.rpc_floor: what a grpc.aio server spends of CPU per call and per message,
whatever its handler does: the floor under a frontend's cost per request and per message.

A server process serves a server-streaming method that yields `m` prebuilt responses of a
generated token each (the shape of a `Generate` call), with uvloop as the frontends run; this
process calls it `--calls` times, `--concurrency` calls in flight on one channel, for m = 1 and
m = `--messages`. The server's CPU time (from /proc) over the calls, per call, gives the two
costs: per message = (cost at m - cost at 1) / (m - 1), per call = cost at 1 - per message.
The machine's speed is printed as the time of a pure Python loop.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
from dataclasses import dataclass
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import grpc

from bench.machine import loop_calibration
from stepahead.event_loop import run as run_loop
from stepahead.v1 import generation_pb2 as pb
from stepahead_cli.serve import free_port

METHOD = "/stepahead.bench.Floor/Stream"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Floor:
    per_call_us: float  # server CPU a call, messages aside
    per_message_us: float  # server CPU a message
    calls: int
    messages: int  # per call, in the longer run


def _serve(port: int, ready: Event) -> None:
    """Each call's request is the number of responses it wants (4 bytes, little-endian)."""
    response = pb.GenerateResponse(request_id="r", token_ids=[42], text="x", completion_tokens=1)

    async def stream(request: bytes, context: Any) -> Any:
        for _ in range(int.from_bytes(request, "little")):
            yield response

    async def main() -> None:
        handler: grpc.RpcMethodHandler[bytes, pb.GenerateResponse] = grpc.unary_stream_rpc_method_handler(
            stream, request_deserializer=None, response_serializer=pb.GenerateResponse.SerializeToString
        )
        server = grpc.aio.server()
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("stepahead.bench.Floor", {"Stream": handler}),)
        )
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        ready.set()
        await server.wait_for_termination()

    run_loop(main())


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


async def _call_all(port: int, calls: int, concurrency: int, messages: int) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        method: grpc.aio.UnaryStreamMultiCallable[bytes, bytes] = channel.unary_stream(
            METHOD, request_serializer=None, response_deserializer=None
        )
        gate = asyncio.Semaphore(concurrency)
        request = messages.to_bytes(4, "little")

        async def one() -> None:
            async with gate:
                async for _ in method(request):
                    pass

        await asyncio.gather(*(one() for _ in range(calls)))


def server_cpu_per_call_us(pid: int, port: int, calls: int, concurrency: int, messages: int) -> float:
    run_loop(_call_all(port, min(calls, 200), concurrency, messages))  # warm up
    before = _cpu_s(pid)
    run_loop(_call_all(port, calls, concurrency, messages))
    return (_cpu_s(pid) - before) / calls * 1e6


def measure(calls: int, concurrency: int, messages: int) -> Floor:
    """A fresh server process; the per-call cost at 1 and at `messages` messages, in turns
    (twice each, the lower kept)."""
    port = free_port()
    ready = multiprocessing.get_context("spawn").Event()
    server = multiprocessing.get_context("spawn").Process(target=_serve, args=(port, ready))
    server.start()
    try:
        if not ready.wait(60):
            raise RuntimeError("the bench server did not start")
        assert server.pid is not None
        one, many = [], []
        for _ in range(2):
            one.append(server_cpu_per_call_us(server.pid, port, calls, concurrency, 1))
            many.append(server_cpu_per_call_us(server.pid, port, calls, concurrency, messages))
    finally:
        server.kill()
        server.join()
    per_message = (min(many) - min(one)) / (messages - 1)
    return Floor(min(one) - per_message, per_message, calls, messages)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.rpc_floor", description=__doc__)
    p.add_argument("--calls", type=int, default=3000, help="calls per measurement (default 3000)")
    p.add_argument("--concurrency", type=int, default=64, help="calls in flight (default 64)")
    p.add_argument("--messages", type=int, default=16, help="messages a call in the longer run (default 16)")
    args = p.parse_args(argv)
    if args.messages < 2 or args.calls < 1 or args.concurrency < 1:
        p.error("--messages must be at least 2, --calls and --concurrency at least 1")
    print(f"loop calibration: {loop_calibration():.2f} s")
    floor = measure(args.calls, args.concurrency, args.messages)
    print(
        f"grpc.aio server, {floor.calls} calls, {args.concurrency} in flight: "
        f"{floor.per_call_us:.0f} us of CPU a call, {floor.per_message_us:.1f} us a message"
    )


if __name__ == "__main__":
    main()
