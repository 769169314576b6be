"""The worker's gRPC service: one Connect session at a time over the engine. The session itself
(`WorkerServicer.session`) is the same on the framed link of `link_socket`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

import grpc
from grpc_health.v1 import health
from prometheus_client import CollectorRegistry, Counter

from stepahead.auth import BearerTokenInterceptor
from stepahead.protocol import (
    GRPC_OPTIONS,
    PROTOCOL_VERSION,
    StepResult,
    info_to_proto,
    launch_from_proto,
    result_to_proto,
    speculative_from_hello,
)
from stepahead.serving import NO_PORT_SHARING, add_health_and_reflection, add_port
from stepahead.v1 import worker_pb2, worker_pb2_grpc
from worker_svc.engine import SessionEnded, WorkerEngine
from worker_svc.launch_check import LaunchError

log = logging.getLogger("stepahead.worker")

SERVICE_NAME = "stepahead.v1.Worker"

# The scheduler pings an idle link to find a dead worker fast: allow it.
KEEPALIVE_SERVER_OPTIONS = [
    ("grpc.http2.min_ping_interval_without_data_ms", 1_000),
    ("grpc.keepalive_permit_without_calls", 1),
]

_InFlight = tuple[int, "asyncio.Future[StepResult]", float] | None  # step, result, when read


DEFAULT_SCHEDULER_TIMEOUT_S = 10.0
DEFAULT_KEEPALIVE_INTERVAL_S = 1.0  # when the Hello names none


class _Session:
    """One scheduler's stream: launches queued in order, results sent in order."""

    def __init__(self, scheduler_id: str, peer: str) -> None:
        self.scheduler_id = scheduler_id
        self.peer = peer
        self.epoch = 0
        self.ticket = 0  # the engine's ticket for this session's launches
        self.keepalive_interval_s = DEFAULT_KEEPALIVE_INTERVAL_S
        self.in_flight: asyncio.Queue[_InFlight] = asyncio.Queue()
        self.unanswered = 0  # launches taken whose result has not been sent
        self.superseded = False
        self.reader: asyncio.Task[None] | None = None
        self.closed = asyncio.Event()

    def end(self) -> None:
        self.in_flight.put_nowait(None)


class SessionPeer(Protocol):
    """What a session needs of its connection: who it is, and how to end it with a status (a gRPC
    call's context is one; the framed link has its own)."""

    def peer(self) -> str: ...

    async def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn: ...


class SessionMetrics:
    """Who opened sessions on this worker, and who was turned away."""

    def __init__(self, registry: CollectorRegistry, model: str, device: str) -> None:
        names, values = ["model", "device"], [model, device]
        refused = Counter(
            "stepahead_worker_sessions_refused",
            "Connect calls refused: reason=unauthenticated (no or wrong --worker-token) or busy "
            "(another scheduler's session is live).",
            [*names, "reason"],
            registry=registry,
        )
        self.refused = {r: refused.labels(*values, r) for r in ("unauthenticated", "busy")}
        self.takeovers = Counter(
            "stepahead_worker_session_takeovers",
            "Sessions replaced by a new session of the same scheduler.",
            names,
            registry=registry,
        ).labels(*values)
        self.scheduler_timeouts = Counter(
            "stepahead_worker_scheduler_timeouts",
            "Sessions ended because the scheduler sent nothing for --scheduler-timeout with no step pending.",
            names,
            registry=registry,
        ).labels(*values)


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(
        self,
        engine: WorkerEngine,
        metrics: SessionMetrics,
        scheduler_timeout_s: float = DEFAULT_SCHEDULER_TIMEOUT_S,
    ) -> None:
        self._engine = engine
        self.metrics = metrics
        self._scheduler_timeout_s = scheduler_timeout_s
        self._session: _Session | None = None
        self._draining = False

    async def drain(self, timeout_s: float) -> None:
        """Stop taking launches, finish and answer those already taken, end the session.

        NOTE: launches the scheduler sent after this are never run, and it
        hears the session end; it recomputes their requests on the next worker.
        """
        self._draining = True
        session = self._session
        if session is None or session.reader is None:
            return
        session.reader.cancel()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(session.closed.wait(), timeout_s)

    async def Connect(
        self,
        request_iterator: AsyncIterator[worker_pb2.SchedulerMessage],
        context: grpc.aio.ServicerContext,  # type: ignore[type-arg]
    ) -> AsyncIterator[worker_pb2.WorkerMessage]:
        # Closed with the call, whichever way it ends: the session's end runs at once, not at GC.
        async with contextlib.aclosing(self.session(request_iterator, context)) as messages:
            async for message in messages:
                yield message

    async def session(
        self, request_iterator: AsyncIterator[worker_pb2.SchedulerMessage], context: SessionPeer
    ) -> AsyncGenerator[worker_pb2.WorkerMessage, None]:
        """One scheduler's session: its Hello, then a result (or a Keepalive) per launch, in
        order, until it ends; a refusal or a takeover ends it through `context.abort`."""
        hello = await self._expect_hello(request_iterator, context)
        if self._draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is shutting down")
        await self._refuse_if_busy(hello, context)
        session = self._replace_session(hello.scheduler_id, context.peer())
        if hello.keepalive_interval_s > 0:
            session.keepalive_interval_s = hello.keepalive_interval_s
        budget = hello.max_batch_tokens or None
        try:
            speculative = speculative_from_hello(hello)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        welcome = asyncio.wrap_future(
            self._engine.begin_session(max_batch_tokens=budget, speculative=speculative)
        )
        session.ticket = self._engine.session_ticket
        try:
            # A step of the session before may still be computing: the forward thread is its.
            async for keepalive in _keepalives_until(welcome, session.keepalive_interval_s, 0):
                yield keepalive
            info = welcome.result()
            session.epoch = info.epoch
            log.info("session %d opened by %s (scheduler %s)", info.epoch, session.peer, hello.scheduler_id)
            yield worker_pb2.WorkerMessage(welcome=info_to_proto(info))
            session.reader = asyncio.create_task(self._read_launches(request_iterator, session))
            async for message in self._results(session):
                yield message
        finally:
            if session.reader is not None:
                session.reader.cancel()
            # Launches of this session still queued are dropped unrun: the next session's steps
            # wait behind none of them.
            self._engine.end_session(session.ticket)
            if self._session is session:
                self._session = None
            session.closed.set()
            log.info("session %d closed", session.epoch)
        if session.superseded:
            await context.abort(grpc.StatusCode.ABORTED, "a newer scheduler session replaced this one")

    async def GetStats(
        self,
        request: worker_pb2.GetStatsRequest,
        context: grpc.aio.ServicerContext,  # type: ignore[type-arg]
    ) -> worker_pb2.WorkerStats:
        s = self._engine.stats()
        return worker_pb2.WorkerStats(
            epoch=s.epoch,
            steps_executed=s.steps_executed,
            last_step_id=s.last_step_id,
            out_of_order_launches=s.out_of_order_launches,
            sentinel_reads=s.sentinel_reads,
            live_request_slots=s.live_request_slots,
        )

    async def _expect_hello(
        self, request_iterator: AsyncIterator[worker_pb2.SchedulerMessage], context: SessionPeer
    ) -> worker_pb2.Hello:
        try:
            first = await asyncio.wait_for(anext(request_iterator, None), self._scheduler_timeout_s)
        except TimeoutError:
            first = None
        if first is None or not first.HasField("hello"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "hello: the first message must be a Hello")
        elif first.hello.protocol_version != PROTOCOL_VERSION:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"hello.protocol_version: worker speaks {PROTOCOL_VERSION}, "
                f"scheduler {first.hello.protocol_version}",
            )
        return first.hello

    async def _refuse_if_busy(self, hello: worker_pb2.Hello, context: SessionPeer) -> None:
        """One scheduler at a time: only the scheduler of the live session may replace it.

        NOTE: a scheduler that died closes its socket (the session ends at once), one that hangs
        is dropped after --scheduler-timeout; a refused scheduler retries and gets in then.
        """
        live = self._session
        if live is None or live.closed.is_set() or live.scheduler_id == hello.scheduler_id:
            return
        self.metrics.refused["busy"].inc()
        log.warning(
            "refused a session from %s: session %d of %s is live", context.peer(), live.epoch, live.peer
        )
        await context.abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"session {live.epoch} of scheduler {live.peer} is live: one scheduler at a time",
        )

    def _replace_session(self, scheduler_id: str, peer: str) -> _Session:
        previous, self._session = self._session, _Session(scheduler_id, peer)
        if previous is not None and not previous.closed.is_set():
            log.info("session %d replaced by a new session of the same scheduler", previous.epoch)
            self.metrics.takeovers.inc()
            previous.superseded = True
            previous.end()
        return self._session

    async def _read_launches(
        self, request_iterator: AsyncIterator[worker_pb2.SchedulerMessage], session: _Session
    ) -> None:
        messages = aiter(request_iterator)
        try:
            while (message := await self._next_message(messages, session)) is not None:
                if session.superseded:
                    break
                read_at = time.monotonic()
                try:
                    launch = launch_from_proto(message.launch)
                except ValueError as exc:  # a column that is not a whole array, lists that differ
                    refused = asyncio.get_running_loop().create_future()
                    refused.set_exception(LaunchError(f"launch: {exc}"))
                    session.unanswered += 1
                    session.in_flight.put_nowait((message.launch.step_id, refused, read_at))
                    break  # the step's error ends the session (`_results`)
                done = asyncio.wrap_future(self._engine.submit(launch, session.ticket))
                done.add_done_callback(_retrieved)  # a session that ends leaves its results unread
                session.unanswered += 1
                session.in_flight.put_nowait((launch.step_id, done, read_at))
        finally:
            session.end()

    async def _next_message(
        self, messages: AsyncIterator[worker_pb2.SchedulerMessage], session: _Session
    ) -> worker_pb2.SchedulerMessage | None:
        """The next launch; None when the stream ends, or when the scheduler has sent nothing
        for --scheduler-timeout while no step of it is pending (a scheduler idles with a
        row-less launch every few seconds, so silence means it is stopped or gone)."""
        while True:
            next_message = asyncio.ensure_future(anext(messages, None))
            # The session may end while this read waits (the scheduler stopped): its error,
            # "RPC already finished", is then nobody's to read.
            next_message.add_done_callback(_retrieved)
            done, _ = await asyncio.wait({next_message}, timeout=self._scheduler_timeout_s)
            if done:
                return next_message.result()
            if not session.unanswered:
                next_message.cancel()
                self.metrics.scheduler_timeouts.inc()
                log.error(
                    "session %d: nothing from the scheduler for %.0fs; ending it",
                    *(session.epoch, self._scheduler_timeout_s),
                )
                return None
            await asyncio.wait({next_message})  # a step is still running: the silence is ours
            return next_message.result()

    async def _results(self, session: _Session) -> AsyncIterator[worker_pb2.WorkerMessage]:
        while (item := await session.in_flight.get()) is not None:
            step_id, done, read_at = item
            async for keepalive in _keepalives_until(done, session.keepalive_interval_s, step_id):
                yield keepalive
            try:
                result = done.result()
            except SessionEnded:  # a newer session of this scheduler replaced this one
                return
            except Exception as exc:  # the step failed: report it, end the session
                log.exception("step %d failed", step_id)
                yield worker_pb2.WorkerMessage(error=worker_pb2.StepError(step_id=step_id, message=str(exc)))
                return
            session.unanswered -= 1
            message = result_to_proto(result)
            message.held_s = time.monotonic() - read_at
            yield worker_pb2.WorkerMessage(result=message)


async def _keepalives_until(
    pending: asyncio.Future[Any], interval_s: float, step_id: int
) -> AsyncIterator[worker_pb2.WorkerMessage]:
    """A Keepalive every `interval_s` until `pending` is done: the scheduler hears that this
    process is alive however long the step takes (a stopped process sends nothing)."""
    while not pending.done():
        await asyncio.wait({pending}, timeout=interval_s)
        if not pending.done():
            yield worker_pb2.WorkerMessage(keepalive=worker_pb2.Keepalive(step_id=step_id))


def _retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


@dataclass(frozen=True)
class WorkerServer:
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    servicer: WorkerServicer


@dataclass(frozen=True)
class WorkerAccess:
    credentials: grpc.ServerCredentials | None = None  # None: plaintext
    token: str | None = None  # --worker-token: required as `authorization: Bearer <token>`
    scheduler_timeout_s: float = DEFAULT_SCHEDULER_TIMEOUT_S


async def build_server(
    engine: WorkerEngine, host: str, port: int, access: WorkerAccess = WorkerAccess()
) -> WorkerServer:
    """Plaintext unless TLS credentials; health and reflection share the port and its TLS but
    need no token."""
    info = engine.info
    metrics = SessionMetrics(engine.metrics.registry, info.model, info.device)
    refused = metrics.refused["unauthenticated"].inc
    interceptors = [BearerTokenInterceptor(access.token, "worker token", refused)] if access.token else []
    server = grpc.aio.server(
        interceptors=interceptors, options=GRPC_OPTIONS + KEEPALIVE_SERVER_OPTIONS + NO_PORT_SHARING
    )
    servicer = WorkerServicer(engine, metrics, access.scheduler_timeout_s)
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    health_servicer = await add_health_and_reflection(server, SERVICE_NAME)
    bound = add_port(server, f"{host}:{port}", access.credentials)
    return WorkerServer(server, bound, health_servicer, servicer)
