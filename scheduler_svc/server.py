"""The client-facing gRPC service: stepahead.v1.Generation, health, reflection."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any, TypeAlias

import grpc
from grpc_health.v1 import health

import stepahead
from scheduler_svc.request import Request
from scheduler_svc.scheduler import Scheduler, random_seed
from scheduler_svc.validation import InvalidRequest, validate_request
from stepahead.serving import add_health_and_reflection, set_serving
from stepahead.v1 import generation_pb2, generation_pb2_grpc

log = logging.getLogger("stepahead.scheduler")

SERVICE_NAME = "stepahead.v1.Generation"
Context: TypeAlias = grpc.aio.ServicerContext[Any, Any]


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: Context
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        req = await self._admit(request, context)
        try:
            async for response in self._stream(req, context):
                yield response
        finally:
            if not req.finished:  # the client cancelled or went away
                self._scheduler.abort(req.rid)

    async def Abort(
        self, request: generation_pb2.AbortRequest, context: Context
    ) -> generation_pb2.AbortResponse:
        return generation_pb2.AbortResponse(aborted=self._scheduler.abort(request.request_id))

    async def GetServerInfo(
        self, request: generation_pb2.GetServerInfoRequest, context: Context
    ) -> generation_pb2.GetServerInfoResponse:
        s = self._scheduler
        response = generation_pb2.GetServerInfoResponse(
            version=stepahead.__version__,
            mode=s.config.mode,
            kv_slots_free=s.kv.num_free,
            request_slots_free=s.req_slots.num_free,
            requests_running=len(s.running),
            requests_waiting=len(s.waiting),
            worker_connected=s.ready,
        )
        if s.info is not None and s.tokenizer is not None:
            response.model = s.info.model
            response.vocab_size = s.info.vocab_size
            response.max_context_len = s.info.max_context_len
            response.eos_token_ids.extend(s.info.eos_token_ids)
            response.kv_slots = s.info.kv_slots
            response.request_slots = s.req_slots.capacity
            response.device = s.info.device
            response.tokenizer = s.tokenizer.name
        return response

    async def _admit(self, request: generation_pb2.GenerateRequest, context: Context) -> Request:
        s = self._scheduler
        if s.info is None or s.tokenizer is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no worker is connected yet")
        rid = request.request_id or uuid.uuid4().hex
        if rid in s.requests:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {rid!r} is already live")
        try:
            valid = validate_request(request, s.tokenizer, s.info, random_seed())
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        req = s.new_request(rid, valid.prompt_ids, valid.params)
        s.add_request(req)
        return req

    async def _stream(self, req: Request, context: Context) -> AsyncIterator[generation_pb2.GenerateResponse]:
        prompt_tokens = len(req.prompt_ids)
        while True:
            await req.stream.ready.wait()
            if req.stream.error is not None:
                await context.abort(*req.stream.error)
            chunk = req.stream.take()
            yield generation_pb2.GenerateResponse(
                request_id=req.rid,
                token_ids=chunk.token_ids,
                text=chunk.text,
                finish_reason=int(chunk.finish_reason or 0),  # type: ignore[arg-type]
                prompt_tokens=prompt_tokens,
                completion_tokens=chunk.completion_tokens,
            )
            if chunk.finish_reason is not None:
                return


async def build_server(
    scheduler: Scheduler, host: str, port: int
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    server = grpc.aio.server()
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(scheduler), server)
    health_servicer = await add_health_and_reflection(server, SERVICE_NAME)
    bound = server.add_insecure_port(f"{host}:{port}")
    return server, bound, health_servicer


def health_follows_worker(scheduler: Scheduler, health_servicer: health.aio.HealthServicer) -> None:
    """SERVING while a worker session is up, NOT_SERVING otherwise."""
    tasks: set[asyncio.Task[None]] = set()

    def on_ready(ready: bool) -> None:
        task = asyncio.get_running_loop().create_task(set_serving(health_servicer, SERVICE_NAME, ready))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    scheduler.on_ready = on_ready
