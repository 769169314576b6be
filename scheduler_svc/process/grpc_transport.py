"""The worker transport over gRPC: one channel and one `Connect` stream per worker session,
with the handshake, keepalives and the session's pending results (see `engine.transport` for
the interface the core sees)."""

from __future__ import annotations

import asyncio
import collections
import time
import uuid
from dataclasses import dataclass, field
from typing import TypeAlias, cast

import grpc

from scheduler_svc.engine.transport import DEFAULT_SILENCE_TIMEOUT_S, WorkerSession, WorkerUnavailable
from stepahead.protocol import (
    GRPC_OPTIONS,
    PROTOCOL_VERSION,
    Launch,
    StepResult,
    WorkerInfo,
    WorkerStepError,
    info_from_proto,
    launch_to_proto,
    result_from_proto,
)
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


@dataclass(frozen=True)
class WorkerLinkConfig:
    """What the scheduler tells and shows the worker in each handshake."""

    token: str | None = None  # --worker-token, sent as `authorization: Bearer <token>`
    max_batch_tokens: int = 0  # the step budget the worker enforces (0: none announced)
    # --worker-step-timeout: a worker silent this long (no Welcome, result or Keepalive) is hung.
    silence_timeout_s: float = DEFAULT_SILENCE_TIMEOUT_S
    scheduler_id: str = field(default_factory=lambda: uuid.uuid4().hex)  # one per scheduler process


def keepalive_interval(silence_timeout_s: float) -> float:
    """How often the worker is asked to speak while a step computes: five times within the
    timeout, at most once a second."""
    return min(1.0, silence_timeout_s / 5)


class GrpcTransport:
    """Opens one channel and one Connect stream per session."""

    def __init__(
        self,
        target: str,
        credentials: grpc.ChannelCredentials | None = None,
        link: WorkerLinkConfig | None = None,
    ) -> None:
        self._target = target
        self._credentials = credentials  # None: plaintext
        self._link = link or WorkerLinkConfig()
        self._session: GrpcWorkerSession | None = None

    async def connect(self) -> WorkerSession:
        if self._session is not None:
            await self._session.close()
        options = GRPC_OPTIONS + KEEPALIVE_OPTIONS
        if self._credentials is None:
            channel = grpc.aio.insecure_channel(self._target, options=options)
        else:
            channel = grpc.aio.secure_channel(self._target, self._credentials, options=options)
        session = GrpcWorkerSession(self._target, channel, self._link)
        try:
            await session.handshake()
        except BaseException:
            await session.close()
            raise
        self._session = session
        return session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


class GrpcWorkerSession:
    """One Connect stream: launches written in order, results matched in order."""

    def __init__(self, target: str, channel: grpc.aio.Channel, link: WorkerLinkConfig) -> None:
        self._target = target
        self._channel = channel
        self._link = link
        metadata = (("authorization", f"Bearer {link.token}"),) if link.token else None
        self._call: WorkerCall = worker_pb2_grpc.WorkerStub(channel).Connect(metadata=metadata)
        # step id, its result, when it was sent
        self._pending: collections.deque[tuple[int, asyncio.Future[StepResult], float]] = collections.deque()
        self._reader: asyncio.Task[None] | None = None
        self._failure: WorkerUnavailable | None = None
        self.info: WorkerInfo
        self.last_heard = time.monotonic()

    async def handshake(self) -> None:
        link = self._link
        hello = worker_pb2.Hello(
            protocol_version=PROTOCOL_VERSION,
            scheduler_id=link.scheduler_id,
            max_batch_tokens=link.max_batch_tokens,
            keepalive_interval_s=keepalive_interval(link.silence_timeout_s),
        )
        timeout = link.silence_timeout_s
        try:
            await asyncio.wait_for(self._call.write(worker_pb2.SchedulerMessage(hello=hello)), timeout)
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
        if self._failure is not None:
            raise self._failure
        done: asyncio.Future[StepResult] = asyncio.get_running_loop().create_future()
        self._pending.append((launch.step_id, done, time.monotonic()))
        try:
            await self._call.write(worker_pb2.SchedulerMessage(launch=launch_to_proto(launch)))
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
            # InvalidStateError: the worker already ended the call (it was draining).
            self._fail_pending(WorkerUnavailable(f"launch of step {launch.step_id}: {exc!r}"))
        return done

    async def close(self) -> None:
        self._call.cancel()
        if self._reader is not None:
            self._reader.cancel()
        await self._channel.close()
        self._fail_pending(WorkerUnavailable("session closed"))

    async def _read_results(self) -> None:
        try:
            while (message := await self._call.read()) is not grpc.aio.EOF:
                self.last_heard = time.monotonic()
                self._deliver(cast(worker_pb2.WorkerMessage, message))
            self._fail_pending(WorkerUnavailable(f"{self._target}: the worker ended the session"))
        except grpc.aio.AioRpcError as exc:
            self._fail_pending(WorkerUnavailable(f"{self._target}: {exc.code().name}: {exc.details()}"))

    def _deliver(self, message: worker_pb2.WorkerMessage) -> None:
        if message.HasField("keepalive"):
            return
        step_id, done, sent_at = self._pending.popleft()
        if message.HasField("error"):
            done.set_exception(WorkerStepError(message.error.step_id, message.error.message))
            self._fail_pending(WorkerUnavailable(f"step {message.error.step_id} failed on the worker"))
            return
        rtt = max(time.monotonic() - sent_at - message.result.held_s, 0.0)  # the link's share of the wait
        result = result_from_proto(message.result, link_rtt_s=rtt)
        if result.step_id != step_id:
            done.set_exception(WorkerUnavailable(f"result of step {result.step_id}, expected {step_id}"))
            self._fail_pending(WorkerUnavailable("results out of launch order"))
            return
        done.set_result(result)

    def _fail_pending(self, failure: WorkerUnavailable) -> None:
        self._failure = self._failure or failure
        while self._pending:
            _, done, _ = self._pending.popleft()
            if not done.done():
                done.set_exception(failure)
