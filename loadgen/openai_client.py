"""The OpenAI-compatible HTTP backends: streaming /v1/completions or /v1/chat/completions over
one aiohttp session, and what the stream's chunks tell."""

from __future__ import annotations

from dataclasses import dataclass, field

import aiohttp

from loadgen.backend import BackendError, Sampling
from loadgen.openai_protocol import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    DONE,
    MODELS_PATH,
    SseDecoder,
    StreamChunk,
    StreamError,
    chat_body,
    completion_body,
    first_model_id,
    http_failure,
    parse_chunk,
)
from loadgen.timing import Clock, RequestTiming

CONNECTION_ERROR = "CONNECTION_ERROR"
STREAM_ERROR = "STREAM_ERROR"
# NOTE: aiohttp's default timeout (5 minutes for the whole request) would fail long generations;
# as over gRPC, a request runs until it ends or the run stops it.
NO_TIMEOUT = aiohttp.ClientTimeout(total=None)


def base_urls(value: str) -> list[str]:
    """Comma-separated base URLs (replicas) as a list; ValueError when one is empty."""
    urls = [url.strip() for url in value.split(",")]
    if not all(urls):
        raise ValueError(f"empty base URL in {value!r}")
    return urls


@dataclass(frozen=True)
class OpenAITarget:
    base_url: str  # without /v1; several (replicas) comma-separated
    model: str | None = None  # None: the first of GET /v1/models (of the first base URL)
    api_key: str | None = field(default=None, repr=False)
    chat: bool = False

    def url(self, path: str) -> str:
        return self.urls(path)[0]

    def urls(self, path: str) -> list[str]:
        """`path` under every base URL, in their order."""
        return [base.rstrip("/") + path for base in base_urls(self.base_url)]


def received(timing: RequestTiming, now: float, chunk: StreamChunk) -> None:
    """A text chunk is one token unless the chunk carries a usage that says how many it adds;
    a usage's completion_tokens is the output length."""
    timing.heard(now)
    if chunk.prompt_tokens is not None:
        timing.prompt_tokens = chunk.prompt_tokens
    if chunk.text:
        timing.arrived(now, _tokens_added(timing, chunk))
    if chunk.completion_tokens is not None:
        timing.output_tokens = chunk.completion_tokens
    if chunk.finish_reason is not None:
        timing.finish_reason = chunk.finish_reason.upper()


def _tokens_added(timing: RequestTiming, chunk: StreamChunk) -> int:
    if chunk.completion_tokens is None:
        return 1
    return max(1, chunk.completion_tokens - sum(timing.message_tokens))


async def read_stream(
    response: aiohttp.ClientResponse, timing: RequestTiming, clock: Clock, chat: bool
) -> None:
    """Reads to the end of the body (so the connection can be reused); the request is done at
    `data: [DONE]`, failed if the stream reports an error or ends without it."""
    decoder = SseDecoder()
    async for data in response.content.iter_any():
        now = clock()
        for payload in decoder.feed(data):
            _on_event(timing, now, payload, chat)
    for payload in decoder.finish():
        _on_event(timing, clock(), payload, chat)
    if not timing.closed:
        timing.failed(clock(), STREAM_ERROR, f"the stream ended without data: {DONE}")


def _on_event(timing: RequestTiming, now: float, payload: str, chat: bool) -> None:
    if timing.closed:
        return
    if payload == DONE:
        timing.ended(now)
        return
    try:
        chunk = parse_chunk(payload, chat)
    except StreamError as exc:
        timing.failed(now, STREAM_ERROR, str(exc))
        return
    if chunk.error is not None:
        timing.failed(now, STREAM_ERROR, chunk.error.message)
        return
    received(timing, now, chunk)


class OpenAIBackend:
    """One session for the run; `pool_limit` caps its connections (None: no cap). Over HTTP/1.1
    a streaming request holds a connection to its end, so the cap also caps requests in flight.
    With several base URLs (replicas), request i goes to the (i mod n)-th."""

    def __init__(self, target: OpenAITarget, pool_limit: int | None, sampling: Sampling) -> None:
        self.target, self.sampling, self.model = target, sampling, target.model
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=pool_limit or 0),
            timeout=NO_TIMEOUT,
            headers=_auth_headers(target.api_key),
        )
        self.urls = target.urls(CHAT_PATH if target.chat else COMPLETIONS_PATH)

    async def connect(self) -> None:
        if self.model is None:
            self.model = await first_model(self.session, self.target.url(MODELS_PATH))

    async def send(self, timing: RequestTiming, clock: Clock) -> None:
        body = self.body(timing)
        timing.sent(clock())
        try:
            url = self.urls[timing.index % len(self.urls)]
            async with self.session.post(url, json=body) as response:
                if response.status != 200:
                    timing.failed(clock(), *http_failure(response.status, await response.read()))
                    return
                await read_stream(response, timing, clock, self.target.chat)
        except aiohttp.ClientError as exc:
            timing.failed(clock(), CONNECTION_ERROR, str(exc) or type(exc).__name__)

    def body(self, timing: RequestTiming) -> dict[str, object]:
        if self.model is None:
            raise BackendError("send before connect: the model is not known yet")
        build = chat_body if self.target.chat else completion_body
        return build(timing.spec, self.model, self.sampling, timing.index)

    async def close(self) -> None:
        await self.session.close()


def _auth_headers(api_key: str | None) -> dict[str, str]:
    return {} if not api_key else {"Authorization": f"Bearer {api_key}"}


async def first_model(session: aiohttp.ClientSession, url: str) -> str:
    """The first model id the server lists; raises BackendError when there is none to take."""
    try:
        async with session.get(url) as response:
            status, body = response.status, await response.read()
    except aiohttp.ClientError as exc:
        raise BackendError(f"cannot list the models at {url} (or give --model): {exc}") from exc
    if status != 200:
        failure, detail = http_failure(status, body)
        raise BackendError(f"cannot list the models at {url} (or give --model): {failure}: {detail}")
    model = first_model_id(body)
    if model is None:
        raise BackendError(f"{url} lists no model (give one with --model)")
    return model
