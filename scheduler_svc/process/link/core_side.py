"""The core's side of the link: the `EngineCore` service frontend processes attach to, and
each attached frontend as the core sees it (`RemoteFrontend`)."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeAlias

import grpc

import stepahead
from scheduler_svc.contract import CoreRequestSpec, StepOutputs
from scheduler_svc.engine.core import EngineCore
from scheduler_svc.engine.request import Request
from scheduler_svc.process.link.codec import (
    outputs_to_proto,
    spec_from_proto,
    worker_state_to_proto,
)
from stepahead.protocol import GRPC_OPTIONS, WorkerInfo
from stepahead.v1 import core_pb2, core_pb2_grpc, generation_pb2

log = logging.getLogger("stepahead.link")

Context: TypeAlias = grpc.aio.ServicerContext[Any, Any]
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
    """A frontend process, as the core sees it: messages queue for its stream's writer."""

    def __init__(self, index: int, pid: int, port: int) -> None:
        self.index, self.pid, self.port = index, pid, port
        self.queue: asyncio.Queue[core_pb2.CoreMessage | None] = asyncio.Queue()
        self._metrics: dict[int, asyncio.Future[bytes]] = {}
        self._query_ids = itertools.count(1)

    def send(self, outputs: StepOutputs) -> None:
        self.queue.put_nowait(core_pb2.CoreMessage(outputs=outputs_to_proto(outputs)))

    def worker_state(self, info: WorkerInfo | None, connected: bool) -> None:
        self.queue.put_nowait(core_pb2.CoreMessage(worker=worker_state_to_proto(info, connected)))

    async def metrics_text(self) -> bytes:
        query = next(self._query_ids)
        done = self._metrics[query] = asyncio.get_running_loop().create_future()
        self.queue.put_nowait(core_pb2.CoreMessage(metrics_query=core_pb2.MetricsQuery(id=query)))
        try:
            return await asyncio.wait_for(done, METRICS_TIMEOUT_S)
        finally:
            self._metrics.pop(query, None)

    def on_metrics(self, reply: core_pb2.MetricsText) -> None:
        done = self._metrics.get(reply.id)
        if done is not None and not done.done():
            done.set_result(reply.text)


class CoreLinkServicer(core_pb2_grpc.EngineCoreServicer):
    """Serves frontend processes on the core's unix socket."""

    def __init__(self, core: EngineCore, on_hello: Callable[[RemoteFrontend], None]) -> None:
        self._core = core
        self._on_hello = on_hello
        self.frontends: set[RemoteFrontend] = set()

    async def Attach(
        self, request_iterator: AsyncIterator[core_pb2.FrontendMessage], context: Context
    ) -> AsyncIterator[core_pb2.CoreMessage]:
        first = await anext(aiter(request_iterator), None)
        if first is None or not first.HasField("hello"):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "a frontend starts with a hello")
            return
        h = first.hello
        frontend = RemoteFrontend(h.index, h.pid, h.port)
        self.frontends.add(frontend)
        self._core.attach(frontend)
        reader = asyncio.create_task(self._read(frontend, request_iterator))
        try:
            self._on_hello(frontend)
            while (message := await frontend.queue.get()) is not None:
                yield message
        finally:
            reader.cancel()
            self.frontends.discard(frontend)
            self._core.detach(frontend)

    async def _read(
        self, frontend: RemoteFrontend, messages: AsyncIterator[core_pb2.FrontendMessage]
    ) -> None:
        try:
            async for message in messages:
                if message.HasField("requests"):
                    self._apply(frontend, message.requests)
                elif message.HasField("metrics"):
                    frontend.on_metrics(message.metrics)
        except grpc.aio.AioRpcError:
            pass
        finally:
            frontend.queue.put_nowait(None)  # the frontend is gone: end its stream

    def _apply(self, frontend: RemoteFrontend, batch: core_pb2.RequestBatch) -> None:
        """Aborts first: a handle the frontend ended before sending it is never in `add`."""
        if batch.abort:
            self._core.abort_handles(frontend, list(batch.abort))
        if batch.add:
            self._core.add([core_request(spec_from_proto(m), frontend) for m in batch.add])

    async def Abort(
        self, request: generation_pb2.AbortRequest, context: Context
    ) -> generation_pb2.AbortResponse:
        return generation_pb2.AbortResponse(aborted=self._core.abort(request.request_id))

    async def GetServerInfo(
        self, request: generation_pb2.GetServerInfoRequest, context: Context
    ) -> generation_pb2.GetServerInfoResponse:
        return core_server_info(self._core)

    async def metrics_texts(self) -> list[bytes]:
        """Every attached frontend's exposition (one that does not answer in time is left out)."""
        got = await asyncio.gather(*(f.metrics_text() for f in self.frontends), return_exceptions=True)
        return [text for text in got if isinstance(text, bytes)]


async def start_link_server(servicer: CoreLinkServicer, socket_path: str) -> grpc.aio.Server:
    server = grpc.aio.server(options=GRPC_OPTIONS)
    core_pb2_grpc.add_EngineCoreServicer_to_server(servicer, server)
    server.add_insecure_port(f"unix:{socket_path}")
    await server.start()
    return server


# ---- the frontend's side ---------------------------------------------------------------------
