"""The client-facing gRPC service: stepahead.v1.Generation, health, reflection."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any, TypeAlias, TypeVar

import grpc
from grpc_health.v1 import health

from scheduler_svc.contract import TokenLogprob
from scheduler_svc.frontend.api_config import ClientApiConfig
from scheduler_svc.frontend.frontend import ApiError, Frontend
from scheduler_svc.frontend.multiplex import Multiplexed, News, RequestFailure
from scheduler_svc.frontend.streams import Completions, OutputChunk
from scheduler_svc.frontend.telemetry import Counting
from scheduler_svc.frontend.validation import (
    UnparsableRequest,
    lenient_deserializer,
)
from stepahead.auth import BearerTokenInterceptor
from stepahead.protocol import NO_BDP_PROBE
from stepahead.serving import (
    NO_PORT_SHARING,
    PORT_SHARING,
    add_health_and_reflection,
    add_port,
    server_credentials,
    set_serving,
)
from stepahead.v1 import generation_pb2, generation_pb2_grpc

log = logging.getLogger("stepahead.scheduler")

SERVICE_NAME = "stepahead.v1.Generation"
# Which frontend serves a call: Generate's trailing metadata, the unary calls' initial metadata.
FRONTEND_METADATA = "stepahead-frontend"
MAX_MANY_MESSAGE_BYTES = 1 << 20
Context: TypeAlias = grpc.aio.ServicerContext[Any, Any]
Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"  # generic only in the stubs
T = TypeVar("T")


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """Every handler first turns away what the lenient deserializer could not parse."""

    def __init__(self, frontend: Frontend) -> None:
        self._frontend = frontend

    async def Generate(
        self, request: generation_pb2.GenerateRequest | UnparsableRequest, context: Context
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        request = await _parsed(request, context)
        try:
            completions = await self._frontend.admit(request)
        except ApiError as exc:
            await context.abort(exc.code, str(exc))
        context.set_trailing_metadata(((FRONTEND_METADATA, self._frontend.name),))  # sent with the status
        try:
            async for response in _stream(completions, context, self._frontend.telemetry.messages):
                yield response
        finally:
            self._frontend.cancel(completions)  # a no-op once finished: else the client went away

    async def GenerateMany(
        self,
        requests: AsyncIterator[generation_pb2.GenerateManyRequest | UnparsableRequest],
        context: Context,
    ) -> AsyncIterator[generation_pb2.GenerateManyResponse]:
        calls = Multiplexed(self._frontend)
        context.set_trailing_metadata(((FRONTEND_METADATA, self._frontend.name),))  # sent with the status
        reader = asyncio.create_task(_read_many(requests, calls))
        messages = self._frontend.telemetry.messages
        try:
            while not calls.over:
                await calls.ready.wait()
                if reader.done() and not reader.cancelled() and (exc := reader.exception()) is not None:
                    if isinstance(exc, Unparsable):
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                    raise exc
                news, failures = calls.take()
                if news or failures:
                    for message in many_messages(news, failures):
                        messages.inc()
                        yield message
        finally:
            reader.cancel()
            calls.cancel()  # a no-op once all finished: else the client went away

    async def Abort(
        self, request: generation_pb2.AbortRequest | UnparsableRequest, context: Context
    ) -> generation_pb2.AbortResponse:
        request = await _parsed(request, context)
        try:
            aborted = await self._frontend.abort(request.request_id)
        except ConnectionError as exc:  # the engine core is gone
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return generation_pb2.AbortResponse(aborted=aborted)

    async def GetServerInfo(
        self, request: generation_pb2.GetServerInfoRequest | UnparsableRequest, context: Context
    ) -> generation_pb2.GetServerInfoResponse:
        await _parsed(request, context)
        assert self._frontend.core is not None
        try:
            response = await self._frontend.core.server_info()
        except ConnectionError as exc:  # the engine core is gone
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        if self._frontend.tokenizer is not None and response.model:
            response.tokenizer = self._frontend.tokenizer.name
            response.chat_template = self._frontend.chat is not None
        return response


async def _stream(
    completions: Completions, context: Context, messages: Counting
) -> AsyncIterator[generation_pb2.GenerateResponse]:
    while not completions.done:
        await completions.ready.wait()
        if completions.error is not None:
            await context.abort(*completions.error)
        for index, chunk in completions.take():
            messages.inc()
            yield _response(completions, index, chunk)


def _response(completions: Completions, index: int, chunk: OutputChunk) -> generation_pb2.GenerateResponse:
    response = generation_pb2.GenerateResponse()
    _fill(response, completions, index, chunk)
    return response


def _fill(
    response: generation_pb2.GenerateResponse, completions: Completions, index: int, chunk: OutputChunk
) -> None:
    """A chunk's fields, set in place (a GenerateMany message's responses are added to it, not
    copied in) and only where not empty (a field set costs even when it holds nothing)."""
    response.request_id = completions.rid
    response.token_ids.extend(chunk.token_ids)
    response.text = chunk.text
    response.prompt_tokens = len(completions.prompt_ids)
    response.completion_tokens = chunk.completion_tokens
    if chunk.finish_reason is not None:
        response.finish_reason = int(chunk.finish_reason)  # type: ignore[assignment]
    if isinstance(chunk.stop_reason, str):
        response.stop_string = chunk.stop_reason
    elif chunk.stop_reason is not None:
        response.stop_token_id = chunk.stop_reason
    if index:
        response.index = index
    if cached := completions.clients[index].cached_tokens:
        response.cached_tokens = cached
    if chunk.logprobs:
        response.logprobs.extend(_logprobs_to_proto(chunk))
    if chunk.prompt_logprobs is not None:
        pairs = zip(completions.prompt_ids[1:], chunk.prompt_logprobs, strict=True)
        response.prompt_logprobs.extend(_logprob_to_proto(token, lp) for token, lp in pairs)
    for d in chunk.tool_calls:
        response.tool_calls.add(index=d.index, id=d.id, name=d.name, arguments=d.arguments)
    if chunk.reasoning:
        response.reasoning_text = chunk.reasoning
    if chunk.reasoning_tokens:
        response.reasoning_tokens = chunk.reasoning_tokens


class Unparsable(Exception):
    """A GenerateMany message the deserializer could not parse: the call ends INVALID_ARGUMENT."""


async def _read_many(
    requests: AsyncIterator[generation_pb2.GenerateManyRequest | UnparsableRequest], calls: Multiplexed
) -> None:
    """Admits and aborts in the order they come; `calls` is closed after the last (or on an
    unparsable message, which `Unparsable` reports)."""
    try:
        async for message in requests:
            if isinstance(message, UnparsableRequest):
                raise Unparsable(message.reason)
            kind = message.WhichOneof("kind")
            if kind == "generate":
                await calls.generate(message.generate)
            elif kind == "abort":
                await calls.abort(message.abort.request_id)
            else:
                raise Unparsable("kind: a GenerateManyRequest carries generate or abort")
    finally:
        calls.close()


def _many_error(failure: RequestFailure) -> generation_pb2.ManyError:
    code: int = failure.code.value[0]
    return generation_pb2.ManyError(request_id=failure.rid, code=code, message=failure.message)


def many_messages(
    news: list[News], failures: list[RequestFailure]
) -> list[generation_pb2.GenerateManyResponse]:
    """What is new as GenerateMany messages: one, unless it would be over MAX_MANY_MESSAGE_BYTES
    (a client's default receive limit is 4 MiB): then halves, a request's news never split."""
    message = _many_response(news, failures)
    if len(news) < 2 or message.ByteSize() <= MAX_MANY_MESSAGE_BYTES:
        return [message]
    half = len(news) // 2
    return many_messages(news[:half], failures) + many_messages(news[half:], [])


def _many_response(news: list[News], failures: list[RequestFailure]) -> generation_pb2.GenerateManyResponse:
    message = generation_pb2.GenerateManyResponse()
    add = message.responses.add
    for completions, chunks in news:
        for index, chunk in chunks:
            _fill(add(), completions, index, chunk)
    message.errors.extend(_many_error(f) for f in failures)
    return message


def _logprobs_to_proto(chunk: OutputChunk) -> list[generation_pb2.TokenLogprob]:
    if not chunk.logprobs:
        return []
    return [_logprob_to_proto(t, lp) for t, lp in zip(chunk.token_ids, chunk.logprobs, strict=True)]


def _logprob_to_proto(token: int, lp: TokenLogprob) -> generation_pb2.TokenLogprob:
    pairs = zip(lp.top_ids, lp.top_logprobs, strict=True)
    top = [generation_pb2.TopLogprob(token_id=i, logprob=v) for i, v in pairs]
    return generation_pb2.TokenLogprob(token_id=token, logprob=lp.logprob, top_logprobs=top)


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
        "GenerateMany": grpc.stream_stream_rpc_method_handler(
            servicer.GenerateMany,
            request_deserializer=lenient_deserializer(pb.GenerateManyRequest),
            response_serializer=pb.GenerateManyResponse.SerializeToString,
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


async def build_server(
    frontend: Frontend, api: ClientApiConfig, share_port: bool = False
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Health and reflection share the port, its TLS and its size limit, but not the API key.
    `share_port`: frontend processes share the public port (SO_REUSEPORT)."""
    interceptors: list[grpc.aio.ServerInterceptor] = [FrontendNameInterceptor(frontend.name)]
    if api.api_key:
        interceptors.append(BearerTokenInterceptor(api.api_key, "API key"))
    sharing = PORT_SHARING if share_port else NO_PORT_SHARING
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[("grpc.max_receive_message_length", api.max_request_bytes), NO_BDP_PROBE, *sharing],
    )
    add_generation_service(GenerationServicer(frontend), server)
    health_servicer = await add_health_and_reflection(server, SERVICE_NAME)
    bound = add_port(server, f"{api.host}:{api.port}", server_credentials(api.tls))
    return server, bound, health_servicer


class FrontendNameInterceptor(grpc.aio.ServerInterceptor):
    """Every unary call (health checks included) answers with the frontend's name in its initial
    metadata (Generate, in its trailing metadata): with several frontends on one port, a client
    (or a probe) can tell which one a connection reached."""

    def __init__(self, name: str) -> None:
        self._metadata = ((FRONTEND_METADATA, name),)

    async def intercept_service(
        self, continuation: Any, handler_call_details: grpc.HandlerCallDetails
    ) -> Handler | None:
        handler: Handler | None = await continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        behavior: Any = handler.unary_unary  # a coroutine function on grpc.aio servers
        metadata = self._metadata

        async def named(request: object, context: Context) -> object:
            await context.send_initial_metadata(metadata)
            return await behavior(request, context)

        return grpc.unary_unary_rpc_method_handler(
            named,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def health_follows_worker(frontend: Frontend, health_servicer: health.aio.HealthServicer) -> None:
    """SERVING while a worker session is up (and the frontend holds its tokenizer)."""
    tasks: set[asyncio.Task[None]] = set()

    def on_ready(ready: bool) -> None:
        task = asyncio.get_running_loop().create_task(set_serving(health_servicer, SERVICE_NAME, ready))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    frontend.on_ready = on_ready
