"""uvicorn serving the HTTP API inside a frontend's running event loop.

The service owns the signals (uvicorn's own handlers are not installed) and the socket:
bound here, with SO_REUSEPORT when frontend processes share the port, so that a port in
use names its flag like the gRPC port does.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import resource
import socket
import ssl
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from scheduler_svc.frontend.openai.config import HttpLimits
from scheduler_svc.frontend.openai.limits import limited_protocol
from stepahead.serving import PortInUse, address_family

HTTP_PORT_FLAG = "--http-port"
START_TIMEOUT_S = 30.0
DEFAULT_LIMITS = HttpLimits()


@dataclass(frozen=True)
class HttpTls:
    cert: bytes  # PEM chain
    key: bytes
    client_ca: bytes | None = None  # require client certificates signed by it


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the service's event loop handles SIGTERM and drains


class HttpServer:
    def __init__(
        self,
        app: FastAPI,
        host: str,
        port: int,
        tls: HttpTls | None,
        share_port: bool,
        limits: HttpLimits = DEFAULT_LIMITS,
    ) -> None:
        self._sock = bind_socket(host, port, share_port)
        self.port = int(self._sock.getsockname()[1])
        config = uvicorn.Config(
            app,
            http=limited_protocol(limits, connection_limit()),
            log_config=None,
            access_log=False,
            lifespan="off",
            log_level="warning",
        )
        config.load()
        config.ssl = None if tls is None else tls_context(tls)
        self._server = _EmbeddedServer(config)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve(sockets=[self._sock]))
        async with asyncio.timeout(START_TIMEOUT_S):
            while not self._server.started:
                if self._task.done():
                    await self._task  # raises what stopped it
                    raise RuntimeError("the HTTP server stopped while starting")
                await asyncio.sleep(0.01)

    async def stop(self, grace_s: float) -> None:
        """Stops accepting, lets open responses finish for `grace_s`, then cancels them."""
        self._server.config.timeout_graceful_shutdown = max(1, math.ceil(grace_s))
        self._server.should_exit = True
        if self._task is not None:
            await self._task
        self._sock.close()


def connection_limit() -> int:
    """Open HTTP connections a frontend keeps at once: half its file descriptors, so that gRPC,
    /metrics and the worker link keep theirs (see `limits` for who makes room)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(16, min(soft // 2, 8192))


def bind_socket(host: str, port: int, share_port: bool) -> socket.socket:
    sock = socket.socket(address_family(host), socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if share_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise PortInUse.binding(host, port, exc, HTTP_PORT_FLAG) from exc
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def tls_context(tls: HttpTls) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with tempfile.TemporaryDirectory(prefix="stepahead-tls-") as private:  # mode 0700, removed at once
        cert, key = Path(private, "cert.pem"), Path(private, "key.pem")
        cert.write_bytes(tls.cert)
        key.write_bytes(tls.key)
        context.load_cert_chain(cert, key)
    if tls.client_ca is not None:
        context.load_verify_locations(cadata=tls.client_ca.decode())
        context.verify_mode = ssl.CERT_REQUIRED
    return context
