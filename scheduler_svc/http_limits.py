"""What one HTTP connection may cost a frontend before its request is even read: the size and
count of its request head, and how long the head may take to arrive (slowloris).

uvicorn's httptools protocol sets none of these: a client could send an endless header (held in
memory, appended to as it grows) or keep hundreds of connections half-sent forever. The limits
are nginx's kind; a client over one gets 431 or 408 in OpenAI's error body and the connection
is closed. How long a body may pause is checked where the API reads it (`openai_api`).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from scheduler_svc.http_config import HttpLimits

TOO_LARGE = "Request Header Fields Too Large"
LINGER_S = 2.0  # a refused connection is read and dropped this long before it closes


def error_response(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP/1.1 response that closes the connection, in OpenAI's error body."""
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": None}
    body = json.dumps({"error": error}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class _TooManyHeaders(Exception):
    pass


def limited_protocol(limits: HttpLimits) -> type[LimitedHttpToolsProtocol]:
    """The protocol class uvicorn builds each connection with, held to `limits`."""
    return type("LimitedHttpTools", (LimitedHttpToolsProtocol,), {"limits": limits})


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the request head bounded in size, count and time."""

    limits = HttpLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_bytes = 0
        self._headers_seen = 0
        self._in_head = True  # waiting for (the rest of) a request head
        self._head_timer: asyncio.TimerHandle | None = None
        self._discarding = False  # refused: the connection only drains until it closes

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """uvicorn's, with the head's limits; a malformed request is a client's mistake: a 400,
        not a warning in the log."""
        if self._discarding:
            return
        head_before = self._in_head
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            if isinstance(exc.__context__, _TooManyHeaders):
                self._refuse(431, TOO_LARGE, f"over {self.limits.max_headers} header fields")
            else:
                self._refuse(400, "Bad Request", "the request is not valid HTTP/1.1")
            return
        except httptools.HttpParserError:
            self._refuse(400, "Bad Request", "the request is not valid HTTP/1.1")
            return
        except httptools.HttpParserUpgrade:
            self._unsupported_upgrade_warning()  # no WebSocket route is served
        if head_before and self._in_head and not self._discarding and not self.transport.is_closing():
            self._head_bytes += len(data)
            if self._head_bytes > self.limits.max_head_bytes:
                self._refuse(431, TOO_LARGE, f"the request head is over {self.limits.max_head_bytes} bytes")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes, self._headers_seen, self._in_head = 0, 0, True
        if self._head_timer is None:
            self._arm_head_timer()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers_seen += 1
        if self._headers_seen > self.limits.max_headers:
            raise _TooManyHeaders  # ends the parse (see data_received)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._cancel_head_timer()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._in_head = True  # the next request's head, on a kept-alive connection
            self._arm_head_timer()

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = asyncio.get_running_loop().call_later(
            self.limits.head_timeout_s, self._head_too_slow
        )

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if not self._in_head or self._discarding or self.transport.is_closing():
            return
        if self._head_bytes or self._headers_seen:
            self._refuse(
                408, "Request Timeout", f"the request head took over {self.limits.head_timeout_s:g}s"
            )
        else:
            self.transport.close()  # an idle connection: nothing to answer

    def _refuse(self, status: int, reason: str, message: str) -> None:
        """Answers and closes, lingering: what the client still sends is read and dropped for a
        moment, since closing a socket with unread bytes resets it, and the reset can reach
        the client before the answer does."""
        self._cancel_head_timer()
        self._discarding = True
        self.transport.write(error_response(status, reason, message))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        asyncio.get_running_loop().call_later(LINGER_S, self.transport.close)
