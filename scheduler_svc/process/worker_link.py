"""What both worker transports share (`grpc_transport`, `socket_transport`): the link's settings,
the Hello, one live session at a time, and a session's pending steps, whose results arrive in
launch order."""

from __future__ import annotations

import asyncio
import collections
import time
import uuid
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from scheduler_svc.engine.transport import DEFAULT_SILENCE_TIMEOUT_S, WorkerSession, WorkerUnavailable
from stepahead.protocol import (
    PROTOCOL_VERSION,
    StepResult,
    WorkerStepError,
    result_from_proto,
    speculative_to_proto,
)
from stepahead.speculative import SpeculativeConfig
from stepahead.v1 import worker_pb2


@dataclass(frozen=True)
class WorkerLinkConfig:
    """What the scheduler tells and shows the worker in each handshake."""

    token: str | None = (
        None  # --worker-token: gRPC's `authorization: Bearer <token>`, the Hello's on a socket
    )
    max_batch_tokens: int = 0  # the step budget the worker enforces (0: none announced)
    # --worker-step-timeout: a worker silent this long (no Welcome, result or Keepalive) is hung.
    silence_timeout_s: float = DEFAULT_SILENCE_TIMEOUT_S
    scheduler_id: str = field(default_factory=lambda: uuid.uuid4().hex)  # one per scheduler process
    speculative: SpeculativeConfig | None = None  # --speculative-config, announced in each Hello


def keepalive_interval(silence_timeout_s: float) -> float:
    """How often the worker is asked to speak while a step computes: five times within the
    timeout, at most once a second."""
    return min(1.0, silence_timeout_s / 5)


def hello(link: WorkerLinkConfig, token: str = "") -> worker_pb2.SchedulerMessage:
    message = worker_pb2.Hello(
        protocol_version=PROTOCOL_VERSION,
        scheduler_id=link.scheduler_id,
        max_batch_tokens=link.max_batch_tokens,
        keepalive_interval_s=keepalive_interval(link.silence_timeout_s),
        token=token,
    )
    if link.speculative is not None:
        message.speculative.CopyFrom(speculative_to_proto(link.speculative))
    return worker_pb2.SchedulerMessage(hello=message)


class PendingSteps:
    """A session's launched steps awaiting their results: each result resolves the oldest; a
    step error, a result out of order or the session's end fails every one still pending, and
    every launch after it."""

    def __init__(self) -> None:
        # step id, its result, when it was sent
        self._pending: collections.deque[tuple[int, asyncio.Future[StepResult], float]] = collections.deque()
        self.failure: WorkerUnavailable | None = None

    def add(self, step_id: int) -> asyncio.Future[StepResult]:
        """The future of a step about to be sent; raises the session's failure if it has one."""
        if self.failure is not None:
            raise self.failure
        done: asyncio.Future[StepResult] = asyncio.get_running_loop().create_future()
        self._pending.append((step_id, done, time.monotonic()))
        return done

    def deliver(self, message: worker_pb2.WorkerMessage) -> None:
        """A message of the worker after its Welcome (Keepalives are nobody's)."""
        if message.HasField("keepalive"):
            return
        if not self._pending:
            self.fail(WorkerUnavailable("a result of no launched step"))
            return
        step_id, done, sent_at = self._pending.popleft()
        if message.HasField("error"):
            done.set_exception(WorkerStepError(message.error.step_id, message.error.message))
            self.fail(WorkerUnavailable(f"step {message.error.step_id} failed on the worker"))
            return
        rtt = max(time.monotonic() - sent_at - message.result.held_s, 0.0)  # the link's share of the wait
        try:
            result = result_from_proto(message.result, link_rtt_s=rtt)
        except ValueError as exc:  # not this protocol's result: the session cannot go on
            done.set_exception(WorkerUnavailable(f"step {step_id}: a malformed result: {exc}"))
            self.fail(WorkerUnavailable(f"a malformed result of step {step_id}"))
            return
        if result.step_id != step_id:
            done.set_exception(WorkerUnavailable(f"result of step {result.step_id}, expected {step_id}"))
            self.fail(WorkerUnavailable("results out of launch order"))
            return
        done.set_result(result)

    def fail(self, failure: WorkerUnavailable) -> None:
        self.failure = self.failure or failure
        while self._pending:
            _, done, _ = self._pending.popleft()
            if not done.done():
                done.set_exception(failure)


class StartingSession(WorkerSession, Protocol):
    async def start(self) -> None:
        """Connects and performs the handshake (WorkerUnavailable if it fails)."""
        ...


S = TypeVar("S", bound=StartingSession)


class OneSession(Generic[S]):
    """A transport's live session: `connect` closes it, then starts the next (`new_session`), so
    nothing of an old session (its connection, its reader, its pending results) touches the next."""

    def __init__(self) -> None:
        self._session: S | None = None

    def new_session(self) -> S:
        raise NotImplementedError

    async def connect(self) -> WorkerSession:
        if self._session is not None:
            await self._session.close()
        session = self.new_session()
        try:
            await session.start()
        except BaseException:
            await session.close()
            raise
        self._session = session
        return session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
