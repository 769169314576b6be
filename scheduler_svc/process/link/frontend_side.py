"""A frontend process's side of the link: the engine core as it sees it (`RemoteCore`)."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable

from scheduler_svc.contract import CoreRequestSpec
from scheduler_svc.frontend.frontend import Frontend
from scheduler_svc.process.link.codec import outputs_from_proto, spec_to_proto
from stepahead.framing import FrameProtocol
from stepahead.protocol import info_from_proto
from stepahead.v1 import core_pb2, generation_pb2

log = logging.getLogger("stepahead.link")

QUERY_TIMEOUT_S = 10.0  # abort by id, server info: answered at once by a live core


class CoreGone(ConnectionError):
    """The engine core's link is closed (or a query's answer did not come in time)."""


class RemoteCore:
    """The core across the unix socket. New requests and aborts made in one event-loop turn
    leave as one message."""

    def __init__(self, socket_path: str, frontend: Frontend, metrics: Callable[[], bytes]) -> None:
        self._socket_path = socket_path
        self._frontend = frontend
        self._metrics = metrics
        self._wire: FrameProtocol[core_pb2.CoreMessage] | None = None
        self._lost: asyncio.Future[None] | None = None
        self._batch = core_pb2.RequestBatch()
        self._unsent: set[int] = set()  # handles in self._batch.add
        self._flush_scheduled = False
        self._closing = False
        self._query_ids = itertools.count(1)
        self._queries: dict[int, asyncio.Future[core_pb2.CoreMessage]] = {}
        frontend.core = self

    async def attach(self, index: int, pid: int, port: int) -> None:
        """Says hello, then serves until the core goes away (returns then)."""
        loop = asyncio.get_running_loop()
        self._lost = lost = loop.create_future()
        try:
            _, wire = await loop.create_unix_connection(
                lambda: FrameProtocol(core_pb2.CoreMessage.FromString, self._dispatch, self._on_lost),
                self._socket_path,
            )
        except OSError as exc:
            log.error("cannot reach the engine core at %s: %s", self._socket_path, exc)
            return
        self._wire = wire
        wire.send(core_pb2.FrontendMessage(hello=core_pb2.FrontendHello(index=index, pid=pid, port=port)))
        await lost

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
        query = next(self._query_ids)
        answer = await self._ask(
            query, core_pb2.FrontendMessage(abort=core_pb2.AbortQuery(id=query, request_id=rid))
        )
        return answer.aborted.aborted

    async def server_info(self) -> generation_pb2.GetServerInfoResponse:
        query = next(self._query_ids)
        answer = await self._ask(
            query, core_pb2.FrontendMessage(server_info=core_pb2.ServerInfoQuery(id=query))
        )
        return answer.server_info.info

    async def exposition(self) -> bytes:
        query = next(self._query_ids)
        answer = await self._ask(
            query, core_pb2.FrontendMessage(exposition=core_pb2.ExpositionQuery(id=query))
        )
        return answer.exposition.text

    async def close(self) -> None:
        self._closing = True
        if self._wire is not None:
            self._wire.close()

    async def _ask(self, query: int, message: core_pb2.FrontendMessage) -> core_pb2.CoreMessage:
        if self._wire is None or not self._wire.open:
            raise CoreGone("the engine core is gone")
        done = self._queries[query] = asyncio.get_running_loop().create_future()
        self._wire.send(message)
        try:
            return await asyncio.wait_for(done, QUERY_TIMEOUT_S)
        except TimeoutError:
            raise CoreGone(f"the engine core did not answer in {QUERY_TIMEOUT_S:.0f}s") from None
        finally:
            self._queries.pop(query, None)

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if (self._batch.add or self._batch.abort) and self._wire is not None:
            self._wire.send(core_pb2.FrontendMessage(requests=self._batch))
        self._batch = core_pb2.RequestBatch()
        self._unsent = set()

    def _on_lost(self, exc: Exception | None) -> None:
        if not self._closing:
            log.error("lost the engine core%s", f": {exc}" if exc else "")
        for done in self._queries.values():
            if not done.done():
                done.set_exception(CoreGone("the engine core is gone"))
        if self._lost is not None and not self._lost.done():
            self._lost.set_result(None)

    def _dispatch(self, message: core_pb2.CoreMessage) -> None:
        kind = message.WhichOneof("kind")
        if kind == "outputs":
            self._frontend.send(outputs_from_proto(message.outputs))
        elif kind == "worker":
            w = message.worker
            info = info_from_proto(w.welcome) if w.HasField("welcome") else None
            self._frontend.worker_state(info, w.connected)
        elif kind == "metrics_query":
            reply = core_pb2.MetricsText(id=message.metrics_query.id, text=self._metrics())
            if self._wire is not None:
                self._wire.send(core_pb2.FrontendMessage(metrics=reply))
        elif kind in ("aborted", "server_info", "exposition"):
            done = self._queries.get(getattr(message, kind).id)
            if done is not None and not done.done():
                done.set_result(message)
