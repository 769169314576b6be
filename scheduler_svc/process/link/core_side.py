"""The core's side of the link: the socket frontend processes attach to (`CoreLink`), and each
attached frontend as the core sees it (`RemoteFrontend`)."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from typing import Any

import stepahead
from scheduler_svc.contract import CoreRequestSpec, StepOutputs
from scheduler_svc.engine.core import EngineCore
from scheduler_svc.engine.request import Request
from scheduler_svc.process.link.codec import (
    outputs_to_proto,
    spec_from_proto,
    worker_state_to_proto,
)
from stepahead.framing import FrameProtocol
from stepahead.protocol import WorkerInfo
from stepahead.v1 import core_pb2, generation_pb2

log = logging.getLogger("stepahead.link")

METRICS_TIMEOUT_S = 3.0


def core_request(spec: CoreRequestSpec, owner: Any) -> Request:
    return Request(
        spec.rid,
        spec.prompt_ids,
        spec.params,
        0,
        owner,
        spec.handle,
        spec.index,
        arrival_time=spec.arrival_time,
    )


def core_server_info(core: EngineCore) -> generation_pb2.GetServerInfoResponse:
    """Everything GetServerInfo reports but the tokenizer's name (a frontend adds it)."""
    held = core.policy.occupancy()
    response = generation_pb2.GetServerInfoResponse(
        version=stepahead.__version__,
        mode=core.config.mode,
        kv_slots_free=held.kv_slots_free,
        request_slots_free=held.request_slots_free,
        requests_running=held.running,
        requests_waiting=held.waiting,
        worker_connected=core.ready,
        prefix_cache_slots=held.prefix_cache_slots,
        prefix_cache_hit_tokens=held.prefix_cache_hit_tokens,
    )
    if core.info is not None:
        i = core.info
        response.model = i.model
        response.vocab_size = i.vocab_size
        response.max_context_len = i.max_context_len
        response.eos_token_ids.extend(i.eos_token_ids)
        response.kv_slots = i.kv_slots
        response.request_slots = held.request_slots
        response.device = i.device
        response.tensor_parallel_size = i.tensor_parallel_size
    return response


class RemoteFrontend:
    """A frontend process, as the core sees it: one framed connection on the core's socket."""

    def __init__(
        self, index: int, pid: int, port: int, wire: FrameProtocol[core_pb2.FrontendMessage]
    ) -> None:
        self.index, self.pid, self.port = index, pid, port
        self._wire = wire
        self._metrics: dict[int, asyncio.Future[bytes]] = {}
        self._query_ids = itertools.count(1)

    def send(self, outputs: StepOutputs) -> None:
        self._wire.send(core_pb2.CoreMessage(outputs=outputs_to_proto(outputs)))

    def answer(self, message: core_pb2.CoreMessage) -> None:
        self._wire.send(message)

    def worker_state(self, info: WorkerInfo | None, connected: bool) -> None:
        self._wire.send(core_pb2.CoreMessage(worker=worker_state_to_proto(info, connected)))

    async def metrics_text(self) -> bytes:
        query = next(self._query_ids)
        done = self._metrics[query] = asyncio.get_running_loop().create_future()
        self._wire.send(core_pb2.CoreMessage(metrics_query=core_pb2.MetricsQuery(id=query)))
        try:
            return await asyncio.wait_for(done, METRICS_TIMEOUT_S)
        finally:
            self._metrics.pop(query, None)

    def on_metrics(self, reply: core_pb2.MetricsText) -> None:
        done = self._metrics.get(reply.id)
        if done is not None and not done.done():
            done.set_result(reply.text)


class CoreLink:
    """Serves frontend processes on the core's unix socket: each connection starts with a
    hello and is then one `RemoteFrontend` attached to the core until it closes. The core's
    `Intake`: its connections are not read while the core awaits a step."""

    def __init__(
        self, core: EngineCore, on_hello: Callable[[RemoteFrontend], None], exposition: Callable[[], bytes]
    ) -> None:
        self._core = core
        self._on_hello = on_hello
        self._exposition = exposition  # blocks: asks every frontend for its metrics
        self._tasks: set[asyncio.Task[None]] = set()
        self.frontends: set[RemoteFrontend] = set()
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[FrameProtocol[core_pb2.FrontendMessage]] = set()

    async def start(self, socket_path: str) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(self._connection, socket_path)

    async def stop(self) -> None:
        """Stops listening and closes every connection (their frontends detach)."""
        if self._server is not None:
            self._server.close()
        for wire in list(self._connections):
            wire.close()
        if self._server is not None:
            await self._server.wait_closed()

    def _connection(self) -> FrameProtocol[core_pb2.FrontendMessage]:
        attached: list[RemoteFrontend] = []

        def on_frame(message: core_pb2.FrontendMessage) -> None:
            if attached:
                self._on_message(attached[0], message)
            elif message.HasField("hello"):
                h = message.hello
                frontend = RemoteFrontend(h.index, h.pid, h.port, wire)
                attached.append(frontend)
                self.frontends.add(frontend)
                self._core.attach(frontend)
                self._on_hello(frontend)
            else:
                log.error("a connection on the core's link did not start with a hello: closing it")
                wire.close()

        def on_lost(exc: Exception | None) -> None:
            self._connections.discard(wire)
            if attached:
                self.frontends.discard(attached[0])
                self._core.detach(attached[0])

        wire = FrameProtocol(core_pb2.FrontendMessage.FromString, on_frame, on_lost)
        self._connections.add(wire)
        return wire

    def _on_message(self, frontend: RemoteFrontend, message: core_pb2.FrontendMessage) -> None:
        kind = message.WhichOneof("kind")
        if kind == "requests":
            self._apply(frontend, message.requests)
        elif kind == "metrics":
            frontend.on_metrics(message.metrics)
        elif kind == "abort":
            aborted = self._core.abort(message.abort.request_id)
            answer = core_pb2.AbortAnswer(id=message.abort.id, aborted=aborted)
            frontend.answer(core_pb2.CoreMessage(aborted=answer))
        elif kind == "server_info":
            info = core_pb2.ServerInfoAnswer(id=message.server_info.id, info=core_server_info(self._core))
            frontend.answer(core_pb2.CoreMessage(server_info=info))
        elif kind == "exposition":
            task = asyncio.create_task(self._answer_exposition(frontend, message.exposition.id))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _answer_exposition(self, frontend: RemoteFrontend, query: int) -> None:
        """Rendered on a thread: it waits for every frontend's metrics, which come back through
        this event loop."""
        text = await asyncio.get_running_loop().run_in_executor(None, self._exposition)
        frontend.answer(core_pb2.CoreMessage(exposition=core_pb2.ExpositionAnswer(id=query, text=text)))

    def _apply(self, frontend: RemoteFrontend, batch: core_pb2.RequestBatch) -> None:
        """Aborts first: a handle the frontend ended before sending it is never in `add`."""
        if batch.abort:
            self._core.abort_handles(frontend, list(batch.abort))
        if batch.add:
            self._core.add([core_request(spec_from_proto(m), frontend) for m in batch.add])

    def hold(self) -> None:
        """The core awaits a step: what frontends send stays in their sockets (`Intake`)."""
        for wire in self._connections:
            wire.pause_reading()

    def release(self) -> None:
        for wire in list(self._connections):  # a frame read may close its connection
            wire.resume_reading()

    async def metrics_texts(self) -> list[bytes]:
        """Every attached frontend's exposition (one that does not answer in time is left out)."""
        got = await asyncio.gather(*(f.metrics_text() for f in self.frontends), return_exceptions=True)
        return [text for text in got if isinstance(text, bytes)]
