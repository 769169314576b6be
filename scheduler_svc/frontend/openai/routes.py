"""The OpenAI-compatible HTTP API of a frontend: /v1/chat/completions, /v1/completions,
/v1/models, /health. It runs on the frontend's event loop, next to the gRPC API, and admits
requests through the same `Frontend`.

A request asks for `n` choices, each a completion of its own in the frontend; a streamed
response interleaves their chunks, each naming its choice's `index`. It starts only once
its request has its first output or its error, so a refusal (queue full, no worker) still
gets its HTTP status; errors after that come as a final `data: {"error": ...}` event. A
client that disconnects aborts every completion of its request.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias, TypeVar

import grpc
import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.background import BackgroundTask
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import stepahead
from scheduler_svc.contract import FinishReason, TokenLogprob
from scheduler_svc.frontend.api_config import ClientApiConfig
from scheduler_svc.frontend.frontend import NO_WORKER, ApiError, Frontend
from scheduler_svc.frontend.openai import messages as anthropic
from scheduler_svc.frontend.openai.config import host_allowed
from scheduler_svc.frontend.openai.protocol import (
    MAX_NAMES_LOGGED,
    ChatCompletionRequest,
    ChoiceLogprobs,
    CompletionRequest,
    Counts,
    FieldError,
    ResponseIds,
    error_body,
    field_path,
    http_field,
    http_message,
    usage,
)
from scheduler_svc.frontend.openai.renames import FieldNames
from scheduler_svc.frontend.openai.responses import ResponseShape, ResponsesRequest
from scheduler_svc.frontend.openai.tokenize import DetokenizeRequest, TokenizeRequest
from scheduler_svc.frontend.openai.tokenize import http_field as tokenize_field
from scheduler_svc.frontend.streams import Completions, OutputChunk, PromptGroup
from scheduler_svc.frontend.telemetry import Counting
from scheduler_svc.frontend.tools import CallDelta, merge_deltas
from scheduler_svc.frontend.validation import ValidRequest

log = logging.getLogger("stepahead.http")

Endpoint: TypeAlias = Literal["completions", "chat"]
Body: TypeAlias = CompletionRequest | ChatCompletionRequest
Read: TypeAlias = Completions | PromptGroup  # one request's completions, or a list of prompts'
T = TypeVar("T")
B = TypeVar("B", bound=pydantic.BaseModel)

MESSAGES_PATH = "/v1/messages"  # Anthropic's API: its error body
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


DEFAULT_API = ClientApiConfig()


class HttpError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        close: bool = False,
    ) -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.close = status, param, code, close

    def body(self) -> dict[str, Any]:
        return error_body(str(self), ERROR_TYPES.get(self.status, "server_error"), self.param, self.code)

    def response(self) -> JSONResponse:
        headers = {"connection": "close"} if self.close else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def build_app(frontend: Frontend, config: ClientApiConfig = DEFAULT_API) -> FastAPI:
    app = FastAPI(title="Stepahead", docs_url=None, redoc_url=None, openapi_url=None)
    api = OpenAIApi(frontend, config)
    app.add_api_route("/health", api.health, methods=["GET"])
    app.add_api_route("/v1/models", api.models, methods=["GET"])
    app.add_api_route("/v1/models/{model:path}", api.model, methods=["GET"])
    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", api.chat_completions, methods=["POST"])
    app.add_api_route("/v1/responses", api.responses, methods=["POST"])
    app.add_api_route("/v1/responses/{response_id}", api.stored_response, methods=["GET", "DELETE"])
    app.add_api_route("/v1/messages", api.messages, methods=["POST"])
    app.add_api_route("/v1/messages/count_tokens", api.count_tokens, methods=["POST"])
    app.add_api_route("/tokenize", api.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", api.detokenize, methods=["POST"])
    app.add_api_route("/version", api.version, methods=["GET"])
    app.add_api_route("/metrics", api.metrics, methods=["GET"])
    app.add_exception_handler(HttpError, _http_error_response)
    app.add_exception_handler(StarletteHTTPException, _routing_error_response)
    if config.allowed_hosts:
        app.add_middleware(HostCheck, allowed=config.allowed_hosts)
    app.add_middleware(RequestIdEcho)  # every response, refusals included
    if config.access_log:
        app.add_middleware(AccessLog)  # outermost: what the client got, and when it ended
    return app


access_log = logging.getLogger("stepahead.access")


class AccessLog:
    """One line a request, once its response has ended (a stream: at its last event):
    client, method, path, status, seconds, X-Request-Id."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        started, status = time.monotonic(), [0]

        async def seen(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self._app(scope, receive, seen)
        finally:
            client = scope.get("client") or ("-", 0)
            rid = Headers(scope=scope).get(REQUEST_ID_HEADER, "-")
            access_log.info(
                '%s:%s "%s %s" %s %.3fs %s',
                client[0],
                client[1],
                scope["method"],
                scope["path"][:256],
                status[0] or "-",
                time.monotonic() - started,
                rid[:MAX_REQUEST_ID_HEADER_CHARS],
            )


class RequestIdEcho:
    """A request's `X-Request-Id` comes back on its response, whatever the response is; a
    completion takes it as its id (`chatcmpl-<id>`, and the request id an abort names). An id
    that is too long or not printable ASCII gets a 400 naming the header."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        given = Headers(scope=scope).get(REQUEST_ID_HEADER)
        if given is None:
            await self._app(scope, receive, send)
            return
        if len(given) > MAX_REQUEST_ID_HEADER_CHARS or not all(" " < c < "\x7f" for c in given):
            message = f"{REQUEST_ID_HEADER}: at most {MAX_REQUEST_ID_HEADER_CHARS} printable ASCII characters"
            await HttpError(400, message, REQUEST_ID_HEADER).response()(scope, receive, send)
            return

        async def echo(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", given.encode())]}
            await send(message)

        await self._app(scope, receive, echo)


REQUEST_ID_HEADER = "x-request-id"
MAX_REQUEST_ID_HEADER_CHARS = 128  # well under the gRPC API's request_id limit with its prefix


class HostCheck:
    """A request whose Host header names no allowed host gets a 400 before any route runs: a
    web page that rebinds its own name to 127.0.0.1 still sends that name. /health and
    /metrics answer any host (probes and scrapers, an inference gateway's endpoint picker
    among them, address pods by IP)."""

    def __init__(self, app: ASGIApp, allowed: tuple[str, ...]) -> None:
        self._app, self._allowed = app, allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in ("/health", "/metrics"):
            host = Headers(scope=scope).get("host", "")
            if not host_allowed(host, self._allowed):
                message = (
                    f"the Host header {host[:256]!r} names no host this server answers to (--allowed-hosts)"
                )
                await HttpError(400, message, None, "invalid_host").response()(scope, receive, send)
                return
        await self._app(scope, receive, send)


async def _http_error_response(request: Request, exc: Exception) -> Response:
    """OpenAI's error body; Anthropic's on the Messages API's routes."""
    assert isinstance(exc, HttpError)
    if request.url.path.startswith(MESSAGES_PATH):
        headers = {"connection": "close"} if exc.close else None
        return JSONResponse(anthropic.error_body(exc.status, str(exc)), exc.status, headers=headers)
    return exc.response()


async def _routing_error_response(request: Request, exc: Exception) -> Response:
    """An unknown route or method, in OpenAI's error body too."""
    assert isinstance(exc, StarletteHTTPException)
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return HttpError(exc.status_code, message).response()


class OpenAIApi:
    def __init__(self, frontend: Frontend, config: ClientApiConfig) -> None:
        self._frontend = frontend
        self._config = config
        self._watchers: set[asyncio.Task[None]] = set()

    async def health(self) -> Response:
        return Response(status_code=200 if self._frontend.ready else 503)

    async def models(self, request: Request) -> JSONResponse:
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [self._model_card(self._model_name())]})

    async def model(self, request: Request, model: str) -> JSONResponse:
        self._authorize(request)
        self._check_model(model)
        return JSONResponse(self._model_card(model))

    async def version(self) -> JSONResponse:
        return JSONResponse({"version": stepahead.__version__})

    async def metrics(self) -> Response:
        """The whole service's metrics (the core's and every frontend's), as --metrics-port
        serves them: no API key, as /health (vLLM's /metrics asks none either)."""
        assert self._frontend.core is not None
        try:
            text = await self._frontend.core.exposition()
        except ConnectionError as exc:
            raise HttpError(503, f"the engine core did not answer: {exc}") from exc
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    async def tokenize(self, request: Request) -> JSONResponse:
        self._authorize(request)
        body = await self._parse_as(request, TokenizeRequest)
        self._check_model(body.model)
        try:
            ids = self._frontend.tokenize(body.to_proto())
        except FieldError as exc:
            raise HttpError(400, str(exc), exc.field) from exc
        except ApiError as exc:
            field = tokenize_field(exc.field) if exc.field else None
            message = (
                str(exc) if field is None or exc.field is None else str(exc).replace(exc.field, field, 1)
            )
            raise HttpError(HTTP_STATUS.get(exc.code, 500), message, field) from exc
        tokenizer, info = self._frontend.tokenizer, self._frontend.info
        assert tokenizer is not None and info is not None
        if body.prompt is not None and body.add_special_tokens is False:
            ids = tokenizer.encode(body.prompt, add_special_tokens=False)
        strs = (
            [tokenizer.token_bytes(i).decode(errors="replace") for i in ids]
            if body.return_token_strs
            else None
        )
        return JSONResponse(
            {"count": len(ids), "max_model_len": info.max_context_len, "tokens": ids, "token_strs": strs}
        )

    async def detokenize(self, request: Request) -> JSONResponse:
        self._authorize(request)
        body = await self._parse_as(request, DetokenizeRequest)
        self._check_model(body.model)
        tokenizer, info = self._frontend.tokenizer, self._frontend.info
        if tokenizer is None or info is None:
            raise HttpError(503, NO_WORKER)
        for i, token in enumerate(body.tokens):
            if token >= info.vocab_size:
                raise HttpError(
                    400,
                    f"tokens[{i}]: {token} is not below the vocabulary size {info.vocab_size}",
                    f"tokens[{i}]",
                )
        decoder = tokenizer.new_decoder()
        return JSONResponse({"prompt": decoder.push(body.tokens) + decoder.flush()})

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, CompletionRequest, "completions")

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, ChatCompletionRequest, "chat")

    async def responses(self, request: Request) -> Response:
        """The Responses API over the chat path (scheduler_svc/frontend/openai/responses.py)."""
        self._authorize(request)
        body = await self._parse_as(request, ResponsesRequest)
        served = self._check_model(body.model)
        rid = f"resp_{request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex}"
        try:
            chat, names = body.to_chat()
        except FieldError as exc:
            raise HttpError(400, str(exc), exc.field) from exc
        if unknown := body.unknown_fields():
            log.warning("request %s: ignoring fields no API documents: %s", rid, _names(unknown))
        completions = await self._admit_renamed(chat, rid, names)
        shape = ResponseShape(rid, served, body)

        def whole(choice: Choice) -> dict[str, Any]:
            thought = choice.take_reasoning()
            text, token_ids, token_logprobs, calls = choice.pending()
            logprobs = _text_logprobs(choice, token_ids, token_logprobs)
            made = [(c.id, c.name, c.arguments) for c in merge_deltas(calls)]
            return shape.whole(text, logprobs, made, choice.finish, _counts(completions, [choice]), thought)

        messages = self._frontend.telemetry.messages
        return await self._one_choice(
            request, chat, completions, lambda c: _response_events(completions, c, shape, messages), whole
        )

    async def messages(self, request: Request) -> Response:
        """Anthropic's Messages API over the chat path (scheduler_svc/frontend/openai/messages.py)."""
        self._authorize(request)
        body = await self._parse_as(request, anthropic.MessagesRequest)
        served = self._check_model(body.model)
        rid = f"msg_{request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex}"
        chat, names = self._anthropic_chat(body, rid)
        completions = await self._admit_renamed(chat, rid, names, capped=True)  # Anthropic's max_tokens
        assert body.max_tokens is not None  # required (`to_chat`)
        shape = anthropic.MessageShape(rid, served, body.max_tokens)

        def whole(choice: Choice) -> dict[str, Any]:
            thought = choice.take_reasoning()
            text, _, _, calls = choice.pending()
            made = [(c.id, c.name, c.arguments) for c in merge_deltas(calls)]
            counts = _counts(completions, [choice])
            return shape.whole(text, made, choice.finish, choice.stop_reason, counts, thought)

        messages = self._frontend.telemetry.messages
        return await self._one_choice(
            request, chat, completions, lambda c: _message_events(completions, c, shape, messages), whole
        )

    async def _admit_renamed(
        self, chat: ChatCompletionRequest, rid: str, names: FieldNames, capped: bool = False
    ) -> Read:
        """The chat completion a body was mapped onto, admitted; a refusal names the body's field."""
        try:
            return await self._admit(chat, rid, capped)
        except HttpError as exc:
            param = None if exc.param is None else names.rename(exc.param)
            raise HttpError(
                exc.status, names.message(str(exc), exc.param), param, exc.code, exc.close
            ) from exc

    async def _one_choice(
        self,
        request: Request,
        chat: ChatCompletionRequest,
        completions: Read,
        events: Callable[[Choice], AsyncIterator[str]],
        whole: Callable[[Choice], dict[str, Any]],
    ) -> Response:
        """A body mapped onto a chat completion of one choice: the stream of its `events`, or the
        `whole` answer once the choice is complete."""
        try:
            (choice,) = self._choices(chat, completions)
            if chat.stream:
                return await self._stream(request, completions, events(choice))
            await _unless_disconnected(request, _collect(completions, [choice]))
            if completions.error is not None:
                raise _stream_error(completions)
            return JSONResponse(whole(choice))
        except ClientGone:
            self._cancel(completions)
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except BaseException:
            self._cancel(completions)
            raise

    async def count_tokens(self, request: Request) -> JSONResponse:
        """The prompt tokens a Messages body would take (its `max_tokens` not needed)."""
        self._authorize(request)
        body = await self._parse_as(request, anthropic.MessagesRequest)
        self._check_model(body.model)
        chat, names = self._anthropic_chat(body, "count_tokens", count_only=True)
        try:
            ids = self._frontend.tokenize(chat.to_proto())
        except FieldError as exc:
            raise HttpError(400, str(exc), names.rename(exc.field)) from exc
        except ApiError as exc:
            error = _api_error(exc, chat)
            param = None if error.param is None else names.rename(error.param)
            raise HttpError(error.status, names.message(str(error), error.param), param) from exc
        return JSONResponse({"input_tokens": len(ids)})

    def _anthropic_chat(
        self, body: anthropic.MessagesRequest, rid: str, count_only: bool = False
    ) -> tuple[ChatCompletionRequest, anthropic.MessageFieldNames]:
        try:
            chat, names = body.to_chat(count_only)
        except FieldError as exc:
            raise HttpError(400, str(exc), exc.field) from exc
        if unknown := body.unknown_fields():
            log.warning("request %s: ignoring fields no API documents: %s", rid, _names(unknown))
        return chat, names

    async def stored_response(self, request: Request, response_id: str) -> Response:
        """Retrieving or deleting a response: none is kept (`store` is answered false)."""
        self._authorize(request)
        message = f"response {response_id[:64]!r} not found: this server keeps no responses"
        raise HttpError(404, message, "response_id", "not_found")

    # ---- one request ---------------------------------------------------------------------

    async def _serve(self, request: Request, model: type[Body], endpoint: Endpoint) -> Response:
        self._authorize(request)
        body = await self._parse_as(request, model)
        served = self._check_model(body.model)
        prefix = "chatcmpl" if endpoint == "chat" else "cmpl"
        given = request.headers.get(REQUEST_ID_HEADER)  # checked by RequestIdEcho
        ids = ResponseIds(f"{prefix}-{given or uuid.uuid4().hex}", served, endpoint)
        completions = await self._admit(body, ids.rid)
        try:
            choices = self._choices(body, completions)
            if body.stream:
                usage_asked = (body.include_usage, body.continuous_usage)
                messages = self._frontend.telemetry.messages
                return await self._stream(
                    request, completions, _sse(completions, choices, ids, usage_asked, messages)
                )
            return await self._whole(request, completions, choices, ids)
        except ClientGone:  # a quiet abort: the client is not there to read any response
            self._cancel(completions)
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except BaseException:
            self._cancel(completions)  # a no-op once they finished
            raise

    async def _admit(self, body: Body, rid: str, capped: bool = False) -> Read:
        """`capped`: max_tokens is at most what the context leaves (`Frontend.admit`)."""
        try:
            if unknown := body.check_fields():
                log.warning("request %s: ignoring fields no API documents: %s", rid, _names(unknown))
            generates = body.to_protos() if isinstance(body, CompletionRequest) else [body.to_proto()]
        except FieldError as exc:
            raise HttpError(400, str(exc), exc.field) from exc
        check = None if body.stream else functools.partial(self._check_whole_size, body)
        if not self._config.separate_reasoning:
            for generate in generates:
                if generate.WhichOneof("input") == "messages":
                    generate.messages.separate_reasoning = False  # --reasoning-parser none
        if len(generates) == 1:
            generates[0].request_id = rid
            try:
                return await self._frontend.admit(generates[0], open_ended=True, check=check, capped=capped)
            except ApiError as exc:
                raise _api_error(exc, body) from exc
        group = PromptGroup([], asyncio.Event())
        try:
            for i, generate in enumerate(generates):
                generate.request_id = f"{rid}-{i}"
                try:
                    part = await self._frontend.admit(
                        generate, open_ended=True, check=check, ready=group.ready
                    )
                except ApiError as exc:
                    error = _api_error(exc, body)
                    if error.param is not None and error.param.startswith("prompt"):
                        error = HttpError(
                            error.status, str(error).replace("prompt", f"prompt[{i}]", 1), f"prompt[{i}]"
                        )
                    raise error from exc
                group.parts.append(part)
        except BaseException:
            self._cancel(group)
            raise
        return group

    def _cancel(self, completions: Read) -> None:
        """The client went away or the call failed: every completion ends (a no-op for those
        that finished)."""
        for part in completions.parts if isinstance(completions, PromptGroup) else [completions]:
            self._frontend.cancel(part)

    def _check_whole_size(self, body: Body, valid: ValidRequest) -> None:
        """A whole response is built in the frontend's memory: its log-probabilities are bounded."""
        asked, top = body.logprob_params()
        tokens = valid.params.max_new_tokens
        counted = f"{body.max_tokens_field} ({tokens})"
        if isinstance(body, CompletionRequest) and body.scores_prompt:  # echo: the prompt's too
            tokens += len(valid.prompt_ids)
            counted = f"(the prompt's {len(valid.prompt_ids)} tokens + {counted})"
        entries = valid.n * tokens * (1 + top)
        limit = self._config.max_whole_logprobs
        if asked and entries > limit:
            field = http_field("sampling.top_logprobs", body)
            message = (
                f"{field}: a whole response holds at most {limit} log-probabilities, and n ({valid.n}) x "
                f"{counted} x (1 + {field}) ({1 + top}) asks "
                f'for {entries}: stream the response ("stream": true), or ask for fewer'
            )
            raise HttpError(400, message, field)

    def _choices(self, body: Body, completions: Read) -> list[Choice]:
        tokenizer = self._frontend.tokenizer
        assert tokenizer is not None  # admitted: the frontend has one

        def decode(ids: list[int]) -> str:
            decoder = tokenizer.new_decoder()
            return decoder.push(ids) + decoder.flush()

        parts = completions.parts if isinstance(completions, PromptGroup) else [completions]
        echoes = body.echoed(decode) if isinstance(body, CompletionRequest) else ["" for _ in parts]
        scored = isinstance(body, CompletionRequest) and body.scores_prompt
        outputs = not (isinstance(body, CompletionRequest) and body.prompt_only)
        choices: list[Choice] = []
        for part, echo in zip(parts, echoes, strict=True):
            for _ in part.clients:  # choice i x n + j: completion j of prompt i
                texts = [echo] if echo else []
                logprobs = body.new_logprobs(tokenizer.token_bytes)
                prompt = part.prompt_ids if scored else None
                choices.append(Choice(len(choices), logprobs, texts, prompt_ids=prompt, outputs=outputs))
        return choices

    async def _whole(
        self, request: Request, completions: Read, choices: list[Choice], ids: ResponseIds
    ) -> Response:
        await _unless_disconnected(request, _collect(completions, choices))
        if completions.error is not None:
            raise _stream_error(completions)
        body = await _whole_body(ids, choices, _counts(completions, choices))
        return Response(body, media_type="application/json")

    async def _stream(self, request: Request, completions: Read, events: AsyncIterator[str]) -> Response:
        """`events` once the request has its first output. A watcher of the connection cancels
        the request when the client leaves: the server may notice only at its next write, or
        never (writes to a closed connection are dropped)."""
        await _unless_disconnected(request, completions.ready.wait())
        if completions.error is not None:
            raise _stream_error(completions)
        watcher = asyncio.create_task(self._cancel_on_disconnect(request, completions))
        self._watchers.add(watcher)
        watcher.add_done_callback(self._watchers.discard)
        return StreamingResponse(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
            background=BackgroundTask(self._stream_ended, completions, watcher),
        )

    async def _cancel_on_disconnect(self, request: Request, completions: Read) -> None:
        await _disconnected(request)
        self._cancel(completions)

    def _stream_ended(self, completions: Read, watcher: asyncio.Task[None]) -> None:
        watcher.cancel()
        self._cancel(completions)  # a no-op once they finished

    # ---- checks --------------------------------------------------------------------------

    def _authorize(self, request: Request) -> None:
        """The API key as `Authorization: Bearer KEY` (OpenAI's clients) or `x-api-key: KEY`
        (Anthropic's)."""
        key = self._config.api_key
        if key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            given = request.headers.get("x-api-key", "")
        if not hmac.compare_digest(given.encode(), key.encode()):
            raise HttpError(
                401,
                "a valid API key is required: Authorization: Bearer KEY (or x-api-key: KEY)",
                None,
                "invalid_api_key",
            )

    def _model_name(self) -> str:
        """503 until a worker has been seen; while one restarts, requests wait for it (up to
        --worker-retry-timeout) as on the gRPC API."""
        if self._frontend.info is None:
            raise HttpError(503, NO_WORKER)
        return self._config.served_model_name or self._frontend.info.model

    def _model_card(self, model: str) -> dict[str, Any]:
        """vLLM's model card: `max_model_len` is the longest prompt + completion served."""
        info = self._frontend.info
        max_model_len = None if info is None else info.max_context_len
        return {
            "id": model,
            "object": "model",
            "created": 0,
            "owned_by": "stepahead",
            "max_model_len": max_model_len,
        }

    def _check_model(self, model: str | None) -> str:
        """The served model's name; 404 when `model` names another (None: the served one)."""
        served = self._model_name()
        if model is not None and model != served:
            message = f"model: `{model}` does not exist; this server serves `{served}`"
            raise HttpError(404, message, "model", "model_not_found")
        return served

    async def _parse_as(self, request: Request, model: type[B]) -> B:
        _check_content_type(request)
        raw = await self._read_body(request)
        try:
            data = json.loads(raw)
        except RecursionError:
            raise HttpError(400, "the body is not valid JSON: nested too deeply") from None
        except ValueError as exc:  # malformed, not UTF-8, or an integer of over 4300 digits
            raise HttpError(400, f"the body is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise HttpError(400, "the body must be a JSON object")
        if (path := _lone_surrogate(data)) is not None:
            raise HttpError(400, f"{path}: a lone UTF-16 surrogate is not text", path)
        try:
            return model.model_validate(data)
        except pydantic.ValidationError as exc:
            raise _validation_error(exc) from exc
        except RecursionError:
            raise HttpError(400, "the body is nested too deeply") from None

    async def _read_body(self, request: Request) -> bytes:
        limit = self._config.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise HttpError(413, f"the body is larger than {limit} bytes")
        chunks, size = [], 0
        body, pause_s = aiter(request.stream()), self._config.http_limits.body_pause_timeout_s
        while True:
            try:
                async with asyncio.timeout(pause_s):
                    chunk = await anext(body)
            except StopAsyncIteration:
                break
            except TimeoutError:
                message = f"the body paused for over {pause_s:g}s"
                raise HttpError(408, message, close=True) from None
            size += len(chunk)
            if size > limit:
                raise HttpError(413, f"the body is larger than {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)


def _names(fields: list[str]) -> str:
    """Field names for the log, the first few of them."""
    shown = ", ".join(repr(name[:64]) for name in fields[:MAX_NAMES_LOGGED])
    more = len(fields) - MAX_NAMES_LOGGED
    return f"{shown} and {more} more" if more > 0 else shown


def _check_content_type(request: Request) -> None:
    """JSON bodies only: a web page can POST text/plain or a form to this port without asking
    first (no CORS preflight), never application/json."""
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":
        shown = media_type or "none"
        raise HttpError(415, f"Content-Type: the body must be application/json (got {shown})")


def _lone_surrogate(data: Any) -> str | None:
    """The path (`messages[0].content`) of the first key or string in `data` holding a lone
    UTF-16 surrogate (`"\\ud800"` parses, but is no text); None when there is none."""
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if _has_surrogate(value):
                return path or "body"
        elif isinstance(value, dict):
            for key, item in value.items():
                child = f"{path}.{key}" if path else str(key)
                if _has_surrogate(key):
                    return path or "body"
                stack.append((item, child))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(value))
    return None


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _validation_error(exc: pydantic.ValidationError) -> HttpError:
    first = exc.errors()[0]
    param = field_path(first["loc"])
    return HttpError(400, f"{param}: {first['msg']}" if param else first["msg"], param or None)


def _api_error(exc: ApiError, body: Body | None = None) -> HttpError:
    status = HTTP_STATUS.get(exc.code, 500)
    if exc.field is None or body is None:
        return HttpError(status, str(exc))
    return HttpError(status, http_message(str(exc), exc.field, body), http_field(exc.field, body))


def _stream_error(completions: Read) -> HttpError:
    """An error the core sent for an admitted request (no field: it is not the input's)."""
    assert completions.error is not None
    code, message = completions.error
    return _api_error(ApiError(code, message))


class ClientGone(Exception):
    """The client disconnected before its response began."""


CLIENT_CLOSED_REQUEST = 499  # as nginx logs it; never reaches the client


async def _unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """`work`'s result; ClientGone if the client disconnects first."""
    job = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({job, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not job.done():
            job.cancel()
    if not job.done() or job.cancelled():
        raise ClientGone
    return job.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


@dataclass
class Choice:
    """One completion's output not sent yet. Tokens whose text is held back (by the
    incremental detokenization, or as the possible start of a stop string) wait here with
    their log-probabilities until a chunk with text or the finish carries them."""

    index: int
    logprobs: ChoiceLogprobs | None  # None: not asked for
    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    token_logprobs: list[TokenLogprob | None] = field(default_factory=list)  # None: a prompt's first
    calls: list[CallDelta] = field(default_factory=list)  # its tool calls' pieces
    reasoning: list[str] = field(default_factory=list)  # its thinking, split from its text
    finish: FinishReason | None = None
    stop_reason: str | int | None = None  # what ended it, with a STOP finish (vLLM's)
    completion_tokens: int = 0
    reasoning_tokens: int = 0  # of completion_tokens, the thinking's
    # echo with logprobs: the prompt, whose tokens (and log-probabilities: none for the first)
    # come before the first output token's in `logprobs`.
    prompt_ids: list[int] | None = None
    outputs: bool = True  # False: max_tokens 0 with echo, the prompt alone (its token left out)

    def add(self, chunk: OutputChunk) -> None:
        if self.prompt_ids is not None and chunk.prompt_logprobs is not None:
            self.token_ids += self.prompt_ids
            self.token_logprobs += [None, *chunk.prompt_logprobs][: len(self.prompt_ids)]
        if not self.outputs:
            if chunk.finish_reason is not None:
                self.finish = FinishReason.LENGTH
            return
        self.texts.append(chunk.text)
        if chunk.reasoning:
            self.reasoning.append(chunk.reasoning)
        self.token_ids += chunk.token_ids
        self.token_logprobs += chunk.logprobs
        self.calls += chunk.tool_calls
        self.finish, self.stop_reason = chunk.finish_reason, chunk.stop_reason
        self.completion_tokens = chunk.completion_tokens
        self.reasoning_tokens = chunk.reasoning_tokens

    @property
    def sendable(self) -> bool:
        return any(self.texts) or bool(self.calls or self.reasoning) or self.finish is not None

    def pending(self) -> tuple[str, list[int], list[TokenLogprob | None], list[CallDelta]]:
        """What is pending (text, its tokens and their log-probabilities, call deltas), taken."""
        pending = ("".join(self.texts), self.token_ids, self.token_logprobs, self.calls)
        self.texts, self.token_ids, self.token_logprobs, self.calls = [], [], [], []
        return pending

    def take_reasoning(self) -> str:
        """The thinking pending, taken."""
        reasoning, self.reasoning = "".join(self.reasoning), []
        return reasoning

    def take(self, ids: ResponseIds, chunk: bool) -> dict[str, Any]:
        """What is pending, as the choice of a body or of a chunk."""
        reasoning = self.take_reasoning()
        text, token_ids, token_logprobs, calls = self.pending()
        logprobs = None if self.logprobs is None else self.logprobs.format(token_ids, token_logprobs)
        return ids.choice(self.index, text, self.finish, chunk, logprobs, calls, self.stop_reason, reasoning)


SLICE_ENTRIES = 4096  # log-probabilities formatted between turns of the event loop (~25 ms)


async def _whole_body(ids: ResponseIds, choices: list[Choice], counts: Counts) -> bytes:
    """A whole response's JSON, built a slice of log-probabilities at a time with the event
    loop's other work in between: formatting and encoding 100,000 of them takes near a second.
    Each choice's `logprobs` is written into the body in place of a marker no text can hold."""
    nonce = uuid.uuid4().hex
    bodies, logprobs = [], {}
    for choice in choices:
        marker = f"{nonce}-{choice.index}"
        text = "".join(choice.texts)
        reasoning, stop_reason = "".join(choice.reasoning), choice.stop_reason
        bodies.append(
            ids.choice(choice.index, text, choice.finish, False, None, choice.calls, stop_reason, reasoning)
        )
        if choice.logprobs is not None:
            bodies[-1]["logprobs"] = marker
            logprobs[_dumps(marker)] = await _logprobs_json(choice)
    text = _dumps(ids.body(bodies, counts))
    for marker, value in logprobs.items():
        text = text.replace(marker, value, 1)
    return text.encode()


async def _logprobs_json(choice: Choice) -> str:
    """`choice.logprobs.format(...)` as JSON, formatted a slice of tokens at a time; the format's
    lists are joined across the slices."""
    assert choice.logprobs is not None
    token_ids, token_logprobs = choice.token_ids, choice.token_logprobs
    top = max((len(lp.top_ids) for lp in token_logprobs if lp is not None), default=0)
    width = max(1, SLICE_ENTRIES // (1 + top))
    fields: dict[str, list[str] | str] = {}
    for start in range(0, len(token_ids), width) or [0]:
        part = choice.logprobs.format(token_ids[start : start + width], token_logprobs[start : start + width])
        for key, value in part.items():
            if not isinstance(value, list):
                fields[key] = _dumps(value)
                continue
            pieces = fields.setdefault(key, [])
            assert isinstance(pieces, list)
            if value:
                pieces.append(_dumps(value)[1:-1])
        await asyncio.sleep(0)
    return "{" + ",".join(f"{_dumps(k)}:{_joined(v)}" for k, v in fields.items()) + "}"


def _joined(value: list[str] | str) -> str:
    return value if isinstance(value, str) else "[" + ",".join(value) + "]"


def _dumps(value: Any) -> str:
    """As a JSONResponse encodes its body."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def _counts(completions: Read, choices: list[Choice]) -> Counts:
    """(prompt tokens, completion tokens of every choice, prompt tokens found cached, of the
    completion tokens those of a reasoning model's thinking)."""
    completion_tokens = sum(choice.completion_tokens for choice in choices)
    reasoning_tokens = sum(choice.reasoning_tokens for choice in choices)
    return completions.prompt_tokens, completion_tokens, completions.cached_tokens, reasoning_tokens


async def _collect(completions: Read, choices: list[Choice]) -> None:
    """Until every completion has finished, or one failed."""
    while not completions.done:
        await completions.ready.wait()
        if completions.error is not None:
            return
        for index, chunk in completions.take():
            choices[index].add(chunk)


async def _sse(
    completions: Read,
    choices: list[Choice],
    ids: ResponseIds,
    usage_asked: tuple[bool, bool],
    messages: Counting,
) -> AsyncIterator[str]:
    """`usage_asked`: (a usage chunk at the end, the usage so far in every chunk)."""
    include_usage, continuous = usage_asked

    def so_far(chunk: dict[str, Any]) -> dict[str, Any]:
        return {**chunk, "usage": usage(*_counts(completions, choices))} if continuous else chunk

    if ids.chat:
        for choice in choices:
            yield _event(so_far(ids.role_chunk(choice.index)))
    async for chunk in _chunks(completions, choices, ids, messages):
        yield chunk if isinstance(chunk, str) else _event(so_far(chunk))
    if include_usage and completions.error is None:
        yield _event(ids.usage_chunk(_counts(completions, choices)))
    yield "data: [DONE]\n\n"


async def _chunks(
    completions: Read, choices: list[Choice], ids: ResponseIds, messages: Counting
) -> AsyncIterator[str | dict[str, Any]]:
    """Each chunk's body, or an error's event, whole."""
    while not completions.done:
        await completions.ready.wait()
        if completions.error is not None:
            yield _event(_stream_error(completions).body())
            return
        for index, chunk in completions.take():
            choice = choices[index]
            choice.add(chunk)
            if choice.sendable:
                messages.inc()
                yield ids.chunk(choice.take(ids, chunk=True))


def _event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _response_events(
    completions: Completions | PromptGroup, choice: Choice, shape: ResponseShape, messages: Counting
) -> AsyncIterator[str]:
    """A response's stream: the Responses API's typed events, each named by its `event:` line."""

    def pending(choice: Choice) -> list[dict[str, Any]]:
        events = shape.reasoning(choice.take_reasoning())
        text, token_ids, token_logprobs, calls = choice.pending()
        events += shape.text(text, _text_logprobs(choice, token_ids, token_logprobs)) + shape.calls(calls)
        if choice.finish is not None:
            events += shape.finished(choice.finish, _counts(completions, [choice]))
        return events

    def failed(error: HttpError) -> list[dict[str, Any]]:
        return shape.failed(str(error))

    async for event in _shaped_events(completions, choice, messages, shape.started(), pending, failed):
        yield event


async def _message_events(
    completions: Completions | PromptGroup, choice: Choice, shape: anthropic.MessageShape, messages: Counting
) -> AsyncIterator[str]:
    """A message's stream: the Messages API's events, each named by its `event:` line; an error
    of the engine after the first event ends it with an `error` event."""

    def pending(choice: Choice) -> list[dict[str, Any]]:
        events = shape.thinking(choice.take_reasoning())
        text, _, _, calls = choice.pending()
        events += shape.text(text) + shape.calls(calls)
        if choice.finish is not None:
            events += shape.finished(choice.finish, choice.stop_reason, _counts(completions, [choice]))
        return events

    def failed(error: HttpError) -> list[dict[str, Any]]:
        return [anthropic.error_body(error.status, str(error))]

    started = shape.started(completions.prompt_tokens, completions.cached_tokens)
    async for event in _shaped_events(completions, choice, messages, started, pending, failed):
        yield event


async def _shaped_events(
    completions: Completions | PromptGroup,
    choice: Choice,
    messages: Counting,
    started: list[dict[str, Any]],
    pending: Callable[[Choice], list[dict[str, Any]]],
    failed: Callable[[HttpError], list[dict[str, Any]]],
) -> AsyncIterator[str]:
    """A choice's stream of typed events: `started`, then what `pending` makes of each sendable
    piece of the choice, or `failed` of an error of the engine, which ends it."""
    for event in started:
        yield _typed_event(event)
    while not completions.done:
        await completions.ready.wait()
        if completions.error is not None:
            for event in failed(_stream_error(completions)):
                yield _typed_event(event)
            return
        for _, chunk in completions.take():
            choice.add(chunk)
            if not choice.sendable:
                continue
            messages.inc()
            for event in pending(choice):
                yield _typed_event(event)


def _text_logprobs(
    choice: Choice, token_ids: list[int], token_logprobs: list[TokenLogprob | None]
) -> list[dict[str, Any]]:
    """An `output_text`'s `logprobs`: chat's entries (empty unless asked for)."""
    if choice.logprobs is None:
        return []
    entries: list[dict[str, Any]] = choice.logprobs.format(token_ids, token_logprobs)["content"]
    return entries


def _typed_event(data: dict[str, Any]) -> str:
    return f"event: {data['type']}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"
