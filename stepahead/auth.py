"""Bearer-token access to a gRPC service: the scheduler's API key, the worker link's token."""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeAlias

import grpc
from grpc_reflection.v1alpha import reflection

Context: TypeAlias = grpc.aio.ServicerContext[Any, Any]
Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"  # generic only in the stubs

# Reachable without a key: probes and tooling must work before anyone holds one.
KEYLESS_SERVICES = ("grpc.health.v1.Health", reflection.SERVICE_NAME, "grpc.reflection.v1.ServerReflection")

Continuation: TypeAlias = "Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]]"


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Every method outside KEYLESS_SERVICES needs `authorization: Bearer <token>` metadata.
    `what` names the token in refusals ("API key", "worker token"); `on_refusal` counts them."""

    def __init__(self, token: str, what: str, on_refusal: Callable[[], None] = lambda: None) -> None:
        self._key = token.encode()
        self._what = what
        self._on_refusal = on_refusal

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> Handler | None:
        handler = await continuation(handler_call_details)
        service = handler_call_details.method.lstrip("/").split("/", 1)[0]
        if handler is None or service in KEYLESS_SERVICES:
            return handler
        refusal = self._refusal(handler_call_details.invocation_metadata)
        if refusal is None:
            return handler
        self._on_refusal()
        return _refusing_handler(handler, refusal)

    def _refusal(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
        """Why the call is refused, or None when it carries the key."""
        values = [value for key, value in metadata or () if key == "authorization"]
        if not values or not isinstance(values[0], str):
            return f"authorization: missing; send 'authorization: Bearer <{self._what}>' metadata"
        scheme, _, token = values[0].partition(" ")
        if scheme.lower() != "bearer":
            return "authorization: expected the Bearer scheme"
        if not hmac.compare_digest(token.strip().encode(), self._key):  # constant time in the key
            return f"authorization: wrong {self._what}"
        return None


def _refusing_handler(handler: Handler, reason: str) -> Handler:
    """A handler of the same shape as `handler` that answers UNAUTHENTICATED without parsing
    the request: an unauthenticated payload costs nothing but its bytes."""

    async def refuse(request: object, context: Context) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    async def refuse_stream(request: object, context: Context) -> AsyncIterator[None]:
        """A streaming method's handler must be an async generator, even one that never yields."""
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)
        yield None

    def ignore(payload: bytes) -> None:
        return None

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse_stream, request_deserializer=ignore)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, request_deserializer=ignore)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, request_deserializer=ignore)
    return grpc.unary_unary_rpc_method_handler(refuse, request_deserializer=ignore)
