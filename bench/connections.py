"""A closed loop over several client connections, so that frontend processes sharing one port
(SO_REUSEPORT spreads connections, not streams) all get load.

loadgen's own run keeps everything on one channel, which is one HTTP/2 connection: every
request would reach the same frontend. Here request i goes over connection i mod n; the
prompts, the lengths and the per-request records are loadgen's.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack

import grpc

from bench.run import Drive
from loadgen import BenchmarkConfig, Summary
from loadgen.client import Clock, RequestTiming, build_request, send_request
from loadgen.stats import summarize
from loadgen.workload import load_workload
from stepahead.v1 import generation_pb2_grpc

# NOTE: gRPC shares one subchannel (one TCP connection) between channels with the same target
# and arguments; a local pool per channel gives each channel a connection of its own.
OWN_CONNECTION = (("grpc.use_local_subchannel_pool", 1),)


def over_connections(connections: int) -> Drive:
    """A `bench.run.Drive` for closed loops spread over `connections` connections."""
    if connections < 1:
        raise ValueError(f"connections must be at least 1, got {connections}")

    def drive(config: BenchmarkConfig) -> Summary:
        return asyncio.run(closed_loop(config, connections))

    return drive


async def closed_loop(config: BenchmarkConfig, connections: int) -> Summary:
    """`max_concurrency` requests in flight until `num_prompts` are done; timed from the first
    send, once every connection is up."""
    if not math.isinf(config.request_rate) or config.num_prompts is None:
        raise ValueError("a closed loop: infinite request rate and a number of prompts")
    async with AsyncExitStack() as stack:
        channels = [
            await stack.enter_async_context(grpc.aio.insecure_channel(config.server, options=OWN_CONNECTION))
            for _ in range(connections)
        ]
        await asyncio.gather(*(channel.channel_ready() for channel in channels))
        return await _issue([generation_pb2_grpc.GenerationStub(c) for c in channels], config)


async def _issue(
    stubs: Sequence[generation_pb2_grpc.GenerationAsyncStub], config: BenchmarkConfig
) -> Summary:
    workload = load_workload(config.dataset, config.seed)
    timings = [RequestTiming(i, workload.prompt(i)) for i in range(config.num_prompts or 0)]
    slots = asyncio.Semaphore(config.max_concurrency or len(timings))
    origin = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - origin

    tasks = []
    for timing in timings:
        await slots.acquire()
        stub = stubs[timing.index % len(stubs)]
        tasks.append(asyncio.create_task(_one(stub, timing, config, clock, slots)))
    await asyncio.gather(*tasks)
    elapsed = clock()
    return summarize([t.record(elapsed) for t in timings], elapsed, config.slos)


async def _one(
    stub: generation_pb2_grpc.GenerationAsyncStub,
    timing: RequestTiming,
    config: BenchmarkConfig,
    clock: Clock,
    slots: asyncio.Semaphore,
) -> None:
    try:
        request = build_request(timing.spec, config.temperature, config.ignore_eos)
        await send_request(stub, request, timing, clock)
    finally:
        slots.release()
