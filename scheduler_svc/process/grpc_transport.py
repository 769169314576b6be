"""The worker transport over gRPC: one channel and one `Connect` stream per worker session,
with the handshake, keepalives and the session's pending results (see `engine.transport` for
the interface the core sees)."""

from __future__ import annotations

import asyncio
import time
from typing import TypeAlias, cast

import grpc

from scheduler_svc.engine.transport import WorkerUnavailable
from scheduler_svc.process.worker_link import OneSession, PendingSteps, WorkerLinkConfig, hello
from stepahead.protocol import GRPC_OPTIONS, Launch, StepResult, WorkerInfo, info_from_proto, launch_to_proto
from stepahead.v1 import worker_pb2, worker_pb2_grpc

WorkerCall: TypeAlias = grpc.aio.StreamStreamCall[worker_pb2.SchedulerMessage, worker_pb2.WorkerMessage]


# A worker that vanishes without closing its socket (a host or network failure,
# not a killed process, which the kernel reports at once) is found within ~5 s.
KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 3_000),
    ("grpc.keepalive_timeout_ms", 2_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


class GrpcTransport(OneSession["GrpcWorkerSession"]):
    """Opens one channel and one Connect stream per session."""

    def __init__(
        self,
        target: str,
        credentials: grpc.ChannelCredentials | None = None,
        link: WorkerLinkConfig | None = None,
    ) -> None:
        super().__init__()
        self._target = target
        self._credentials = credentials  # None: plaintext
        self._link = link or WorkerLinkConfig()

    def new_session(self) -> GrpcWorkerSession:
        options = GRPC_OPTIONS + KEEPALIVE_OPTIONS
        if self._credentials is None:
            channel = grpc.aio.insecure_channel(self._target, options=options)
        else:
            channel = grpc.aio.secure_channel(self._target, self._credentials, options=options)
        return GrpcWorkerSession(self._target, channel, self._link)


class GrpcWorkerSession:
    """One Connect stream: launches written in order, results matched in order."""

    def __init__(self, target: str, channel: grpc.aio.Channel, link: WorkerLinkConfig) -> None:
        self._target = target
        self._channel = channel
        self._link = link
        metadata = (("authorization", f"Bearer {link.token}"),) if link.token else None
        self._call: WorkerCall = worker_pb2_grpc.WorkerStub(channel).Connect(metadata=metadata)
        self._steps = PendingSteps()
        self._reader: asyncio.Task[None] | None = None
        self.info: WorkerInfo
        self.last_heard = time.monotonic()

    async def start(self) -> None:
        await self.handshake()

    async def handshake(self) -> None:
        timeout = self._link.silence_timeout_s
        try:
            await asyncio.wait_for(self._call.write(hello(self._link)), timeout)
            first = await self._read_past_keepalives()
        except TimeoutError:
            raise WorkerUnavailable(f"{self._target}: no connection within {timeout:g}s") from None
        except grpc.aio.AioRpcError as exc:
            raise WorkerUnavailable(f"{self._target}: {exc.code().name}: {exc.details()}") from exc
        if not isinstance(first, worker_pb2.WorkerMessage) or not first.HasField("welcome"):
            raise WorkerUnavailable(f"{self._target}: no Welcome in the handshake")
        self.info = info_from_proto(first.welcome)
        self._reader = asyncio.create_task(self._read_results())

    async def _read_past_keepalives(self) -> object:
        """The first message that is not a Keepalive (the worker may still be finishing a step
        of the session before); WorkerUnavailable after silence_timeout_s without a word."""
        timeout = self._link.silence_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(self._call.read(), timeout)
            except TimeoutError:
                raise WorkerUnavailable(f"no handshake: the worker said nothing for {timeout:g}s") from None
            self.last_heard = time.monotonic()
            if not (isinstance(message, worker_pb2.WorkerMessage) and message.HasField("keepalive")):
                return message

    async def launch(self, launch: Launch) -> asyncio.Future[StepResult]:
        done = self._steps.add(launch.step_id)
        try:
            await self._call.write(worker_pb2.SchedulerMessage(launch=launch_to_proto(launch)))
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
            # InvalidStateError: the worker already ended the call (it was draining).
            self._steps.fail(WorkerUnavailable(f"launch of step {launch.step_id}: {exc!r}"))
        return done

    async def close(self) -> None:
        self._call.cancel()
        if self._reader is not None:
            self._reader.cancel()
        await self._channel.close()
        self._steps.fail(WorkerUnavailable("session closed"))

    async def _read_results(self) -> None:
        try:
            while (message := await self._call.read()) is not grpc.aio.EOF:
                self.last_heard = time.monotonic()
                self._steps.deliver(cast(worker_pb2.WorkerMessage, message))
            self._steps.fail(WorkerUnavailable(f"{self._target}: the worker ended the session"))
        except grpc.aio.AioRpcError as exc:
            self._steps.fail(WorkerUnavailable(f"{self._target}: {exc.code().name}: {exc.details()}"))
