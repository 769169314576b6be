"""The link between the engine core and its frontends.

In one process (`--frontends 0`) `LocalCore` calls the core directly and the core calls
the `Frontend` directly. Across processes the core serves `stepahead.v1.EngineCore` on a
unix socket: each frontend process attaches one bidirectional stream (`RemoteCore` on its
side, `RemoteFrontend` on the core's). Either way one message per step goes to each
frontend (all of its rows, packed) and new requests and aborts come back in batches.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeAlias

import grpc

import stepahead
from scheduler_svc.engine.core import EngineCore
from scheduler_svc.engine.outputs import StepOutputs, TokenLogprob
from scheduler_svc.engine.request import Request, SamplingParams
from scheduler_svc.frontend.frontend import CoreRequestSpec, Frontend
from stepahead.protocol import GRPC_OPTIONS, WorkerInfo, info_from_proto, info_to_proto
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
    p = core.policy
    response = generation_pb2.GetServerInfoResponse(
        version=stepahead.__version__,
        mode=core.config.mode,
        kv_slots_free=p.cache.reclaimable,
        request_slots_free=p.req_slots.num_free,
        requests_running=len(p.running),
        requests_waiting=len(p.waiting),
        worker_connected=core.ready,
        prefix_cache_slots=p.cache.tree.size,
        prefix_cache_hit_tokens=p.cache.cached_prompt_tokens,
    )
    if core.info is not None:
        i = core.info
        response.model = i.model
        response.vocab_size = i.vocab_size
        response.max_context_len = i.max_context_len
        response.eos_token_ids.extend(i.eos_token_ids)
        response.kv_slots = i.kv_slots
        response.request_slots = p.req_slots.capacity
        response.device = i.device
        response.tensor_parallel_size = i.tensor_parallel_size
    return response


class LocalCore:
    """The core in the frontend's own process."""

    def __init__(self, core: EngineCore, frontend: Frontend) -> None:
        self._core = core
        self._frontend = frontend
        frontend.core = self
        core.attach(frontend)

    def add(self, spec: CoreRequestSpec) -> None:
        self._core.add([core_request(spec, self._frontend)])

    def abort(self, handle: int) -> None:
        self._core.abort_handles(self._frontend, [handle])

    async def abort_request(self, rid: str) -> bool:
        return self._core.abort(rid)

    async def server_info(self) -> generation_pb2.GetServerInfoResponse:
        return core_server_info(self._core)


# ---- wire forms ------------------------------------------------------------------------------


def params_to_proto(p: SamplingParams) -> core_pb2.CoreSampling:
    return core_pb2.CoreSampling(
        max_new_tokens=p.max_new_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        seed=p.seed,
        stop_token_ids=sorted(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs,
        top_logprobs=p.top_logprobs,
        repetition_penalty=p.repetition_penalty,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        min_tokens=p.min_tokens,
        bias_ids=[token for token, _ in p.logit_bias],
        bias_values=[bias for _, bias in p.logit_bias],
    )


def params_from_proto(m: core_pb2.CoreSampling) -> SamplingParams:
    """Stop strings stay in the frontend: the core's copy has none."""
    return SamplingParams(
        m.max_new_tokens,
        m.temperature,
        m.top_p,
        m.top_k,
        m.seed,
        frozenset(m.stop_token_ids),
        (),
        m.ignore_eos,
        logprobs=m.logprobs,
        top_logprobs=m.top_logprobs,
        repetition_penalty=m.repetition_penalty,
        presence_penalty=m.presence_penalty,
        frequency_penalty=m.frequency_penalty,
        min_tokens=m.min_tokens,
        logit_bias=tuple(zip(m.bias_ids, m.bias_values, strict=True)),
    )


def spec_to_proto(spec: CoreRequestSpec) -> core_pb2.NewCoreRequest:
    return core_pb2.NewCoreRequest(
        handle=spec.handle,
        request_id=spec.rid,
        prompt_ids=spec.prompt_ids,
        sampling=params_to_proto(spec.params),
        arrival_unix_s=spec.arrival_time,
        index=spec.index,
    )


def spec_from_proto(m: core_pb2.NewCoreRequest) -> CoreRequestSpec:
    return CoreRequestSpec(
        m.handle, m.request_id, list(m.prompt_ids), params_from_proto(m.sampling), m.arrival_unix_s, m.index
    )


def outputs_to_proto(outputs: StepOutputs) -> core_pb2.StepOutputs:
    msg = core_pb2.StepOutputs(
        handles=outputs.handles,
        token_ids=outputs.token_ids,
        finish_reasons=outputs.finish_reasons,
        errors=[
            core_pb2.RequestError(handle=h, code=grpc.StatusCode[code].value[0], message=message)
            for h, code, message in outputs.errors
        ],
    )
    if outputs.logprobs:
        msg.logprob_entries.extend(outputs.logprob_entries)
        for lp in outputs.logprobs:
            msg.logprobs.append(lp.logprob)
            msg.top_counts.append(len(lp.top_ids))
            msg.top_ids.extend(lp.top_ids)
            msg.top_logprobs.extend(lp.top_logprobs)
    msg.cached_entries.extend(outputs.cached_entries)
    msg.cached_tokens.extend(outputs.cached_tokens)
    return msg


_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


def outputs_from_proto(m: core_pb2.StepOutputs) -> StepOutputs:
    return StepOutputs(
        list(m.handles),
        list(m.token_ids),
        list(m.finish_reasons),
        [(e.handle, _CODE_NAMES.get(e.code, "UNKNOWN"), e.message) for e in m.errors],
        list(m.logprob_entries),
        _logprobs_from_proto(m),
        list(m.cached_entries),
        list(m.cached_tokens),
    )


def _logprobs_from_proto(m: core_pb2.StepOutputs) -> list[TokenLogprob]:
    logprobs, start = [], 0
    for logprob, count in zip(m.logprobs, m.top_counts, strict=True):
        end = start + count
        logprobs.append(TokenLogprob(logprob, tuple(m.top_ids[start:end]), tuple(m.top_logprobs[start:end])))
        start = end
    return logprobs


def worker_state_to_proto(info: WorkerInfo | None, connected: bool) -> core_pb2.WorkerState:
    state = core_pb2.WorkerState(connected=connected)
    if info is not None:
        state.welcome.CopyFrom(info_to_proto(info))
    return state


# ---- the core's side -------------------------------------------------------------------------


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
