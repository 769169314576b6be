"""The worker transport over the worker's framed link (`--worker unix:PATH`, the worker's
`--link-socket PATH`): one unix-socket connection per session, Connect's messages as frames
(`stepahead.framing`). A launch is one `send`, a result is parsed in the loop's read callback:
no HTTP/2, no completion thread. A worker process that dies closes the socket, which ends the
session at once; one that hangs is found by the core's silence timeout, as on gRPC."""

from __future__ import annotations

import asyncio
import time

from scheduler_svc.engine.transport import WorkerUnavailable
from scheduler_svc.process.worker_link import OneSession, PendingSteps, WorkerLinkConfig, hello
from stepahead.framing import FrameProtocol
from stepahead.protocol import Launch, StepResult, WorkerInfo, info_from_proto, launch_to_proto
from stepahead.v1 import worker_pb2

SCHEME = "unix:"


def socket_path(address: str) -> str | None:
    """The socket of a `--worker unix:PATH` address; None for a gRPC address."""
    return address[len(SCHEME) :] if address.startswith(SCHEME) else None


class SocketTransport(OneSession["SocketWorkerSession"]):
    """Opens one connection per session."""

    def __init__(self, path: str, link: WorkerLinkConfig | None = None) -> None:
        super().__init__()
        self._path = path
        self._link = link or WorkerLinkConfig()

    def new_session(self) -> SocketWorkerSession:
        return SocketWorkerSession(self._path, self._link)


class SocketWorkerSession:
    """One connection: launches written in order, results matched in order."""

    def __init__(self, path: str, link: WorkerLinkConfig) -> None:
        self._where = f"{SCHEME}{path}"
        self._path = path
        self._link = link
        self._steps = PendingSteps()
        self._first: asyncio.Future[worker_pb2.WorkerMessage] = asyncio.get_running_loop().create_future()
        self._protocol = FrameProtocol(worker_pb2.WorkerMessage.FromString, self._on_frame, self._on_lost)
        self.info: WorkerInfo
        self.last_heard = time.monotonic()

    async def start(self) -> None:
        await self._open()
        await self.handshake()

    async def _open(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(
                loop.create_unix_connection(lambda: self._protocol, self._path), self._link.silence_timeout_s
            )
        except TimeoutError:
            raise WorkerUnavailable(
                f"{self._where}: no connection within {self._link.silence_timeout_s:g}s"
            ) from None
        except OSError as exc:
            raise WorkerUnavailable(f"{self._where}: {exc.strerror or exc}") from exc

    async def handshake(self) -> None:
        self._protocol.send(hello(self._link, self._link.token or ""))
        timeout = self._link.silence_timeout_s
        while not self._first.done():
            # Keepalives (the worker still finishing a step of the session before) move the wait on.
            left = timeout - (time.monotonic() - self.last_heard)
            if left <= 0:
                raise WorkerUnavailable(f"no handshake: the worker said nothing for {timeout:g}s")
            await asyncio.wait({self._first}, timeout=left)
        first = self._first.result()  # raises the session's end
        if first.HasField("closed"):
            raise _closed(self._where, first.closed)
        if not first.HasField("welcome"):
            raise WorkerUnavailable(f"{self._where}: no Welcome in the handshake")
        self.info = info_from_proto(first.welcome)

    async def launch(self, launch: Launch) -> asyncio.Future[StepResult]:
        done = self._steps.add(launch.step_id)
        if not self._protocol.open:
            self._steps.fail(WorkerUnavailable(f"launch of step {launch.step_id}: the link is closed"))
        self._protocol.send(worker_pb2.SchedulerMessage(launch=launch_to_proto(launch)))
        return done

    async def close(self) -> None:
        self._protocol.close()
        self._steps.fail(WorkerUnavailable("session closed"))
        if not self._first.done():
            self._first.set_exception(WorkerUnavailable("session closed"))
            self._first.exception()

    def _on_frame(self, message: worker_pb2.WorkerMessage) -> None:
        self.last_heard = time.monotonic()
        if not self._first.done():
            if not message.HasField("keepalive"):
                self._first.set_result(message)
        elif message.HasField("closed"):
            self._steps.fail(_closed(self._where, message.closed))
            self._protocol.close()
        else:
            self._steps.deliver(message)

    def _on_lost(self, exc: Exception | None) -> None:
        reason = f" ({exc})" if exc is not None else ""
        failure = WorkerUnavailable(f"{self._where}: the worker ended the session{reason}")
        if not self._first.done():
            self._first.set_exception(failure)
        self._steps.fail(failure)


def _closed(where: str, closed: worker_pb2.SessionClosed) -> WorkerUnavailable:
    return WorkerUnavailable(f"{where}: {closed.code}: {closed.details}")
