"""A frontend process's side of the link: the engine core as it sees it (`RemoteCore`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, TypeAlias

import grpc

from scheduler_svc.contract import CoreRequestSpec
from scheduler_svc.frontend.frontend import Frontend
from scheduler_svc.process.link.codec import (
    outputs_from_proto,
    spec_to_proto,
)
from stepahead.protocol import GRPC_OPTIONS, info_from_proto
from stepahead.v1 import core_pb2, core_pb2_grpc, generation_pb2

log = logging.getLogger("stepahead.link")

Context: TypeAlias = grpc.aio.ServicerContext[Any, Any]
METRICS_TIMEOUT_S = 3.0


CoreCall: TypeAlias = grpc.aio.StreamStreamCall[core_pb2.FrontendMessage, core_pb2.CoreMessage]


class RemoteCore:
    """The core across the unix socket. New requests and aborts made in one event-loop turn
    leave as one message."""

    def __init__(self, socket_path: str, frontend: Frontend, metrics: Callable[[], bytes]) -> None:
        self._channel = grpc.aio.insecure_channel(f"unix:{socket_path}", options=GRPC_OPTIONS)
        self._stub = core_pb2_grpc.EngineCoreStub(self._channel)
        self._frontend = frontend
        self._metrics = metrics
        self._call: CoreCall | None = None
        self._batch = core_pb2.RequestBatch()
        self._unsent: set[int] = set()  # handles in self._batch.add
        self._outgoing: asyncio.Queue[core_pb2.FrontendMessage] = asyncio.Queue()
        self._flush_scheduled = False
        frontend.core = self

    async def attach(self, index: int, pid: int, port: int) -> None:
        """Says hello, then serves until the core goes away (returns then)."""
        self._call = self._stub.Attach()
        hello = core_pb2.FrontendHello(index=index, pid=pid, port=port)
        await self._call.write(core_pb2.FrontendMessage(hello=hello))
        writer = asyncio.create_task(self._write())
        try:
            await self._read(self._call)
        finally:
            writer.cancel()

    def add(self, spec: CoreRequestSpec) -> None:
        self._batch.add.append(spec_to_proto(spec))
        self._unsent.add(spec.handle)
        self._schedule_flush()

    def abort(self, handle: int) -> None:
        if handle in self._unsent:  # never reached the core: just do not send it
            self._unsent.discard(handle)
            kept = [m for m in self._batch.add if m.handle != handle]
            del self._batch.add[:]
            self._batch.add.extend(kept)
            return
        self._batch.abort.append(handle)
        self._schedule_flush()

    async def abort_request(self, rid: str) -> bool:
        response = await self._stub.Abort(generation_pb2.AbortRequest(request_id=rid))
        return bool(response.aborted)

    async def server_info(self) -> generation_pb2.GetServerInfoResponse:
        return await self._stub.GetServerInfo(generation_pb2.GetServerInfoRequest())

    async def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
        await self._channel.close()

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._batch.add or self._batch.abort:
            self._outgoing.put_nowait(core_pb2.FrontendMessage(requests=self._batch))
        self._batch = core_pb2.RequestBatch()
        self._unsent = set()

    async def _write(self) -> None:
        assert self._call is not None
        while True:
            message = await self._outgoing.get()
            await self._call.write(message)

    async def _read(self, call: CoreCall) -> None:
        try:
            async for message in call:
                self._dispatch(message)
        except grpc.aio.AioRpcError as exc:
            log.error("lost the engine core: %s %s", exc.code().name, exc.details())

    def _dispatch(self, message: core_pb2.CoreMessage) -> None:
        if message.HasField("outputs"):
            self._frontend.send(outputs_from_proto(message.outputs))
        elif message.HasField("worker"):
            w = message.worker
            info = info_from_proto(w.welcome) if w.HasField("welcome") else None
            self._frontend.worker_state(info, w.connected)
        elif message.HasField("metrics_query"):
            reply = core_pb2.MetricsText(id=message.metrics_query.id, text=self._metrics())
            self._outgoing.put_nowait(core_pb2.FrontendMessage(metrics=reply))
