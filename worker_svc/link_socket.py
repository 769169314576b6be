"""The worker's framed link (`--link-socket PATH`): the Connect session on a unix stream socket,
for a scheduler on the same host (`--worker unix:PATH`; `stepahead serve` uses it).

The messages are Connect's (`SchedulerMessage` in, `WorkerMessage` out), one length-prefixed
frame each (`stepahead.framing`), and the session is the gRPC service's own
(`WorkerServicer.session`): the same Hello, order, keepalives, drain and takeover. What gRPC's
status carries, a refusal or a takeover, comes as a last `SessionClosed` message. A launch and
its result cost a `send` and a parse each, where a gRPC stream message costs HTTP/2 framing, a
completion-queue round and the interpreter lock passed between two threads.

Access: the socket file is made for the worker's user only (mode 0600), and with
`--worker-token` the Hello must carry the token. TLS has no place on a local socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import socket
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import NoReturn

import grpc

from stepahead.framing import FrameProtocol
from stepahead.v1 import worker_pb2
from worker_svc.server import WorkerServicer

log = logging.getLogger("stepahead.worker")

# The longest path a unix socket's address holds (sun_path, with its terminating NUL).
MAX_SOCKET_PATH_BYTES = 107


class SessionClosedError(Exception):
    """A session's end with a status: sent to the scheduler as `SessionClosed`."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class _FramedPeer:
    """The `SessionPeer` of one framed connection."""

    def __init__(self, name: str) -> None:
        self._name = name

    def peer(self) -> str:
        return self._name

    async def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn:
        raise SessionClosedError(code, details)


class _Connection:
    """One scheduler's connection: frames in are queued for the session, its messages go out as
    frames; the connection's loss cancels the session (as a cancelled gRPC call does)."""

    def __init__(self, link: LinkSocket, name: str) -> None:
        self._link = link
        self._name = name
        self._incoming: asyncio.Queue[worker_pb2.SchedulerMessage | None] = asyncio.Queue()
        self.protocol = FrameProtocol(
            worker_pb2.SchedulerMessage.FromString, self._incoming.put_nowait, self._lost
        )
        self._task = asyncio.get_running_loop().create_task(self._serve())
        link.connections.add(self)

    def _lost(self, exc: Exception | None) -> None:
        self._incoming.put_nowait(None)
        self._task.cancel()

    async def _messages(self) -> AsyncIterator[worker_pb2.SchedulerMessage]:
        while (message := await self._incoming.get()) is not None:
            yield message

    async def _serve(self) -> None:
        messages = self._messages()
        try:
            first = await anext(messages, None)
            if first is not None:
                self._check_token(first)
                session = self._link.servicer.session(_then(first, messages), _FramedPeer(self._name))
                async with contextlib.aclosing(session) as replies:
                    async for reply in replies:
                        self.protocol.send(reply)
        except SessionClosedError as closed:
            self.protocol.send(
                worker_pb2.WorkerMessage(
                    closed=worker_pb2.SessionClosed(code=closed.code.name, details=closed.details)
                )
            )
        except asyncio.CancelledError:
            pass  # the scheduler closed the connection, or the worker stops
        finally:
            self.protocol.close()
            self._link.connections.discard(self)

    def _check_token(self, first: worker_pb2.SchedulerMessage) -> None:
        token = self._link.token
        if token is None:
            return
        given = first.hello.token if first.HasField("hello") else ""
        if not hmac.compare_digest(given.encode(), token.encode()):
            self._link.servicer.metrics.refused["unauthenticated"].inc()
            raise SessionClosedError(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong worker token")

    def stop(self) -> None:
        self._task.cancel()


async def _then(
    first: worker_pb2.SchedulerMessage, rest: AsyncIterator[worker_pb2.SchedulerMessage]
) -> AsyncIterator[worker_pb2.SchedulerMessage]:
    yield first
    async for message in rest:
        yield message


class LinkSocket:
    """The listening socket and its connections (one live session at a time, as on gRPC: the
    servicer refuses a second scheduler)."""

    def __init__(self, servicer: WorkerServicer, path: Path, token: str | None) -> None:
        self.servicer = servicer
        self.path = path
        self.token = token
        self.connections: set[_Connection] = set()
        self._server: asyncio.AbstractServer | None = None
        self._accepted = 0

    async def start(self) -> None:
        sock = bind_private(self.path)
        self._server = await asyncio.get_running_loop().create_unix_server(self._connection, sock=sock)

    def _connection(self) -> FrameProtocol[worker_pb2.SchedulerMessage]:
        self._accepted += 1
        return _Connection(self, f"unix:{self.path}#{self._accepted}").protocol

    async def stop(self) -> None:
        """No new connections; the live ones end (after the servicer's drain has answered what
        they launched)."""
        if self._server is not None:
            self._server.close()
        for connection in list(self.connections):
            connection.stop()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def bind_private(path: Path) -> socket.socket:
    """A unix stream socket bound at `path`, readable and writable by this user only; a stale
    socket file there is replaced, anything else at `path` is an error naming the flag."""
    where = os.fsencode(path)
    if len(where) > MAX_SOCKET_PATH_BYTES:
        raise ValueError(f"--link-socket {path}: longer than a unix socket's {MAX_SOCKET_PATH_BYTES} bytes")
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise ValueError(f"--link-socket {path}: exists and is not a socket")
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    previous = os.umask(0o177)  # the file is made 0600: no moment with wider access
    try:
        sock.bind(str(path))
    except OSError as exc:
        sock.close()
        raise ValueError(f"--link-socket {path}: {exc.strerror}") from exc
    finally:
        os.umask(previous)
    return sock
