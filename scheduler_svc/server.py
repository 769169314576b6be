"""The client-facing gRPC service: stepahead.v1.Generation, health, reflection."""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias, TypeVar

import grpc
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection

from scheduler_svc.frontend import ApiError, Frontend
from scheduler_svc.streams import ClientRequest
from scheduler_svc.validation import RequestLimits, UnparsableRequest, lenient_deserializer
from stepahead.serving import (
    NO_PORT_SHARING,
    PORT_SHARING,
    add_health_and_reflection,
    add_port,
    set_serving,
)
from stepahead.v1 import generation_pb2, generation_pb2_grpc

log = logging.getLogger("stepahead.scheduler")

SERVICE_NAME = "stepahead.v1.Generation"
FRONTEND_METADATA = "stepahead-frontend"  # initial metadata of Generate: which frontend serves the call
DEFAULT_MAX_REQUEST_BYTES = 4 << 20
Context: TypeAlias = grpc.aio.ServicerContext[Any, Any]
Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"  # generic only in the stubs
T = TypeVar("T")


@dataclass(frozen=True)
class ApiConfig:
    """How the client API is exposed: transport security, access, and input bounds."""

    credentials: grpc.ServerCredentials | None = None  # None: plaintext
    api_key: str | None = None  # None: no key asked
    limits: RequestLimits = field(default_factory=RequestLimits)
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # larger messages: RESOURCE_EXHAUSTED from gRPC
    share_port: bool = False  # frontend processes share the public port (SO_REUSEPORT)


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """Every handler first turns away what the lenient deserializer could not parse."""

    def __init__(self, frontend: Frontend) -> None:
        self._frontend = frontend

    async def Generate(
        self, request: generation_pb2.GenerateRequest | UnparsableRequest, context: Context
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        request = await _parsed(request, context)
        try:
            client = self._frontend.admit(request)
        except ApiError as exc:
            await context.abort(exc.code, str(exc))
        await context.send_initial_metadata(((FRONTEND_METADATA, self._frontend.name),))
        try:
            async for response in _stream(client, context):
                yield response
        finally:
            self._frontend.cancel(client)  # a no-op once it finished: else the client went away

    async def Abort(
        self, request: generation_pb2.AbortRequest | UnparsableRequest, context: Context
    ) -> generation_pb2.AbortResponse:
        request = await _parsed(request, context)
        return generation_pb2.AbortResponse(aborted=await self._frontend.abort(request.request_id))

    async def GetServerInfo(
        self, request: generation_pb2.GetServerInfoRequest | UnparsableRequest, context: Context
    ) -> generation_pb2.GetServerInfoResponse:
        await _parsed(request, context)
        assert self._frontend.core is not None
        response = await self._frontend.core.server_info()
        if self._frontend.tokenizer is not None and response.model:
            response.tokenizer = self._frontend.tokenizer.name
        return response


async def _stream(client: ClientRequest, context: Context) -> AsyncIterator[generation_pb2.GenerateResponse]:
    prompt_tokens = len(client.prompt_ids)
    while True:
        await client.stream.ready.wait()
        if client.stream.error is not None:
            await context.abort(*client.stream.error)
        chunk = client.stream.take()
        yield generation_pb2.GenerateResponse(
            request_id=client.rid,
            token_ids=chunk.token_ids,
            text=chunk.text,
            finish_reason=int(chunk.finish_reason or 0),  # type: ignore[arg-type]
            prompt_tokens=prompt_tokens,
            completion_tokens=chunk.completion_tokens,
        )
        if chunk.finish_reason is not None:
            return


async def _parsed(request: T | UnparsableRequest, context: Context) -> T:
    """`request` itself, unless the deserializer could not parse it: then INVALID_ARGUMENT."""
    if isinstance(request, UnparsableRequest):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
    return request


def add_generation_service(servicer: GenerationServicer, server: grpc.aio.Server) -> None:
    """As the generated `add_GenerationServicer_to_server`, with deserializers that hand an
    unparsable payload to the handler (INVALID_ARGUMENT) rather than fail inside gRPC (UNKNOWN)."""
    pb = generation_pb2
    handlers: dict[str, Handler] = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate,
            request_deserializer=lenient_deserializer(pb.GenerateRequest),
            response_serializer=pb.GenerateResponse.SerializeToString,
        ),
        "Abort": grpc.unary_unary_rpc_method_handler(
            servicer.Abort,
            request_deserializer=lenient_deserializer(pb.AbortRequest),
            response_serializer=pb.AbortResponse.SerializeToString,
        ),
        "GetServerInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetServerInfo,
            request_deserializer=lenient_deserializer(pb.GetServerInfoRequest),
            response_serializer=pb.GetServerInfoResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


# Reachable without a key: probes and tooling must work before anyone holds one.
KEYLESS_SERVICES = ("grpc.health.v1.Health", reflection.SERVICE_NAME, "grpc.reflection.v1.ServerReflection")

Continuation: TypeAlias = "Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]]"


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Every method outside KEYLESS_SERVICES needs `authorization: Bearer <key>` metadata."""

    def __init__(self, api_key: str) -> None:
        self._key = api_key.encode()

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> Handler | None:
        handler = await continuation(handler_call_details)
        service = handler_call_details.method.lstrip("/").split("/", 1)[0]
        if handler is None or service in KEYLESS_SERVICES:
            return handler
        refusal = self._refusal(handler_call_details.invocation_metadata)
        return handler if refusal is None else _refusing_handler(handler, refusal)

    def _refusal(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
        """Why the call is refused, or None when it carries the key."""
        values = [value for key, value in metadata or () if key == "authorization"]
        if not values or not isinstance(values[0], str):
            return "authorization: missing; send 'authorization: Bearer <API key>' metadata"
        scheme, _, token = values[0].partition(" ")
        if scheme.lower() != "bearer":
            return "authorization: expected the Bearer scheme"
        if not hmac.compare_digest(token.strip().encode(), self._key):  # constant time in the key
            return "authorization: wrong API key"
        return None


def _refusing_handler(handler: Handler, reason: str) -> Handler:
    """A handler of the same shape as `handler` that answers UNAUTHENTICATED without parsing
    the request: an unauthenticated payload costs nothing but its bytes."""

    async def refuse(request: object, context: Context) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    def ignore(payload: bytes) -> None:
        return None

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse, request_deserializer=ignore)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, request_deserializer=ignore)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse, request_deserializer=ignore)
    return grpc.unary_unary_rpc_method_handler(refuse, request_deserializer=ignore)


async def build_server(
    frontend: Frontend, host: str, port: int, config: ApiConfig = ApiConfig()
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Health and reflection share the port, its TLS and its size limit, but not the API key."""
    interceptors = [ApiKeyInterceptor(config.api_key)] if config.api_key else []
    sharing = PORT_SHARING if config.share_port else NO_PORT_SHARING
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[("grpc.max_receive_message_length", config.max_request_bytes), *sharing],
    )
    add_generation_service(GenerationServicer(frontend), server)
    health_servicer = await add_health_and_reflection(server, SERVICE_NAME)
    bound = add_port(server, f"{host}:{port}", config.credentials)
    return server, bound, health_servicer


def health_follows_worker(frontend: Frontend, health_servicer: health.aio.HealthServicer) -> None:
    """SERVING while a worker session is up (and the frontend holds its tokenizer)."""
    tasks: set[asyncio.Task[None]] = set()

    def on_ready(ready: bool) -> None:
        task = asyncio.get_running_loop().create_task(set_serving(health_servicer, SERVICE_NAME, ready))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    frontend.on_ready = on_ready
