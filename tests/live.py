"""Helpers for tests against live processes on 127.0.0.1."""

from __future__ import annotations

import asyncio
import socket

import grpc

from stepahead.v1 import generation_pb2 as pb
from stepahead.v1 import generation_pb2_grpc


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
