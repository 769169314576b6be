"""What HTTP connections may cost a frontend before their requests are even read: the size and
count of a request head, how long the head may take to arrive (slowloris), and how many
connections are open at once.

uvicorn's httptools protocol sets none of these: a client could send an endless header (held in
memory, appended to as it grows) or keep thousands of connections half-sent until the process
has no file descriptor left for gRPC, /metrics or its worker. The limits are nginx's kind; a
client over one gets 431 or 408 in OpenAI's error body and the connection is closed. At the cap
on open connections, the oldest one that is waiting for a request head (idle, or half-sent)
makes room for the new one; when every one is serving a request, the new one gets a 503. How
long a body may pause is checked where the API reads it (`routes`).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from scheduler_svc.frontend.openai.config import HttpLimits

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


def limited_protocol(limits: HttpLimits, max_connections: int) -> type[LimitedHttpToolsProtocol]:
    """The protocol class uvicorn builds each connection with, held to `limits`, at most
    `max_connections` of them open at once."""
    fields = {"limits": limits, "max_connections": max_connections}
    return type("LimitedHttpTools", (LimitedHttpToolsProtocol,), fields)


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the request head bounded in size, count and time."""

    limits = HttpLimits()
    max_connections = 1024

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._opened = 0.0  # loop time of the connection
        self._head_bytes = 0
        self._headers_seen = 0
        self._in_head = True  # waiting for (the rest of) a request head
        self._head_timer: asyncio.TimerHandle | None = None
        self._discarding = False  # refused: the connection only drains until it closes

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._opened = asyncio.get_running_loop().time()
        self._arm_head_timer()
        if len(self.connections) > self.max_connections:
            self._make_room()

    def _make_room(self) -> None:
        """Closes the oldest connection waiting for a request head, else refuses this one."""
        others = (c for c in self.connections if c is not self)
        waiting = [c for c in others if isinstance(c, LimitedHttpToolsProtocol) and c._waiting]
        if waiting:
            min(waiting, key=lambda c: c._opened)._head_too_slow(lingering=False)
        else:
            message = f"over {self.max_connections} open connections, each serving a request; retry later"
            self._refuse(503, "Service Unavailable", message, lingering=False)

    @property
    def _waiting(self) -> bool:
        """Between requests, or partway through a head: no request of it is being served."""
        serving = self.cycle is not None and not self.cycle.response_complete
        return self._in_head and not serving and not self._discarding and not self.transport.is_closing()

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

    def _head_too_slow(self, lingering: bool = True) -> None:
        """Its time for a head is up (or another connection needs its place)."""
        self._head_timer = None
        if not self._in_head or self._discarding or self.transport.is_closing():
            return
        if self._head_bytes or self._headers_seen:
            if lingering:
                message = f"the request head took over {self.limits.head_timeout_s:g}s"
            else:
                message = "the request head was not whole when its connection was needed for another"
            self._refuse(408, "Request Timeout", message, lingering)
        else:
            self.transport.close()  # an idle connection: nothing to answer

    def _refuse(self, status: int, reason: str, message: str, lingering: bool = True) -> None:
        """Answers and closes, lingering: what the client still sends is read and dropped for a
        moment, since closing a socket with unread bytes resets it, and the reset can reach
        the client before the answer does. Without `lingering` the connection's place is
        needed at once: it closes as soon as the answer is written."""
        self._cancel_head_timer()
        self._discarding = True
        self.transport.write(error_response(status, reason, message))
        if not lingering:
            self.transport.close()
            return
        if self.transport.can_write_eof():
            self.transport.write_eof()
        asyncio.get_running_loop().call_later(LINGER_S, self.transport.close)
