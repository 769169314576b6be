"""Helpers for tests against live processes on 127.0.0.1."""

from __future__ import annotations

import asyncio
import socket

import grpc

from stepahead.v1 import generation_pb2 as pb
from stepahead.v1 import generation_pb2_grpc, worker_pb2, worker_pb2_grpc


def request(text: str, max_new_tokens: int, rid: str = "", **sampling: object) -> pb.GenerateRequest:
    """A text request; `sampling` holds the other SamplingParams fields."""
    return pb.GenerateRequest(
        request_id=rid,
        text=text,
        sampling=pb.SamplingParams(max_new_tokens=max_new_tokens, **sampling),  # type: ignore[arg-type]
    )


async def generate(address: str, req: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    """Every response of one Generate call."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        return [r async for r in stub.Generate(req, timeout=60)]


def unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def server_info(address: str) -> pb.GetServerInfoResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        return await generation_pb2_grpc.GenerationStub(channel).GetServerInfo(pb.GetServerInfoRequest())


async def wait_all_free(address: str) -> pb.GetServerInfoResponse:
    """Until every KV and request slot is free and nothing runs or waits (10 s at most)."""
    for _ in range(500):
        info = await server_info(address)
        free = info.kv_slots_free == info.kv_slots and info.request_slots_free == info.request_slots
        if free and not info.requests_running and not info.requests_waiting:
            return info
        await asyncio.sleep(0.02)
    raise AssertionError(f"slots still in use: {info}")


FRONTEND_COUNTS = (0, 2)  # the suites that must hold for any process layout run with each


def frontend_flags(count: int) -> list[str]:
    return ["--frontends", str(count)]


def own_channel(address: str) -> grpc.aio.Channel:
    """A channel with its own TCP connection (channels of one process share them otherwise): with
    several frontends on one port, each connection lands on one of them."""
    return grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


async def frontend_of(channel: grpc.aio.Channel) -> str:
    """Which frontend serves this channel (the `stepahead-frontend` initial metadata)."""
    probe = pb.GenerateRequest(input_ids=pb.TokenIds(ids=[65]), sampling=pb.SamplingParams(max_new_tokens=1))
    call = generation_pb2_grpc.GenerationStub(channel).Generate(probe, timeout=30)
    metadata = await call.initial_metadata()
    async for _ in call:
        pass
    return str(dict(metadata)["stepahead-frontend"])


async def channels_by_frontend(
    address: str, frontends: int, per_frontend: int
) -> dict[str, list[grpc.aio.Channel]]:
    """`per_frontend` channels on each of the `frontends` processes (one frontend for 0)."""
    wanted = max(frontends, 1)
    found: dict[str, list[grpc.aio.Channel]] = {}
    for _ in range(40 * wanted * per_frontend):
        channel = own_channel(address)
        group = found.setdefault(await frontend_of(channel), [])
        if len(group) < per_frontend:
            group.append(channel)
        else:
            await channel.close()
        if len(found) == wanted and all(len(g) == per_frontend for g in found.values()):
            return found
    raise AssertionError(f"connections reached only frontends {sorted(found)}")


async def worker_stats_after_drain(address: str) -> worker_pb2.WorkerStats:
    """The worker's counters once its last request slot is released (10 s at most)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        for _ in range(500):  # the releases reach the worker with an idle launch
            stats = await stub.GetStats(worker_pb2.GetStatsRequest())
            if stats.live_request_slots == 0:
                return stats
            await asyncio.sleep(0.02)
    raise AssertionError(f"request slots still live on the worker: {stats}")
