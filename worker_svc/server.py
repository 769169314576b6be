"""The worker's gRPC service: one Connect session at a time over the engine."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health

from stepahead.protocol import (
    GRPC_OPTIONS,
    PROTOCOL_VERSION,
    StepResult,
    info_to_proto,
    launch_from_proto,
    result_to_proto,
)
from stepahead.serving import NO_PORT_SHARING, add_health_and_reflection, add_port
from stepahead.v1 import worker_pb2, worker_pb2_grpc
from worker_svc.engine import WorkerEngine

log = logging.getLogger("stepahead.worker")

SERVICE_NAME = "stepahead.v1.Worker"

# The scheduler pings an idle link to find a dead worker fast: allow it.
KEEPALIVE_SERVER_OPTIONS = [
    ("grpc.http2.min_ping_interval_without_data_ms", 1_000),
    ("grpc.keepalive_permit_without_calls", 1),
]

_InFlight = tuple[int, "asyncio.Future[StepResult]"] | None


class _Session:
    """One scheduler's stream: launches queued in order, results sent in order."""

    def __init__(self) -> None:
        self.in_flight: asyncio.Queue[_InFlight] = asyncio.Queue()
        self.superseded = False
        self.reader: asyncio.Task[None] | None = None
        self.closed = asyncio.Event()

    def end(self) -> None:
        self.in_flight.put_nowait(None)


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, engine: WorkerEngine) -> None:
        self._engine = engine
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
        await self._expect_hello(request_iterator, context)
        if self._draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is shutting down")
        session = self._replace_session()
        info = await asyncio.wrap_future(self._engine.begin_session())
        log.info("session %d opened by %s", info.epoch, context.peer())
        yield worker_pb2.WorkerMessage(welcome=info_to_proto(info))
        session.reader = asyncio.create_task(self._read_launches(request_iterator, session))
        try:
            async for message in self._results(session):
                yield message
        finally:
            session.reader.cancel()
            if self._session is session:
                self._session = None
            session.closed.set()
            log.info("session %d closed", info.epoch)
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
        self,
        request_iterator: AsyncIterator[worker_pb2.SchedulerMessage],
        context: grpc.aio.ServicerContext,  # type: ignore[type-arg]
    ) -> None:
        first = await anext(request_iterator, None)
        if first is None or not first.HasField("hello"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "hello: the first message must be a Hello")
        elif first.hello.protocol_version != PROTOCOL_VERSION:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"hello.protocol_version: worker speaks {PROTOCOL_VERSION}, "
                f"scheduler {first.hello.protocol_version}",
            )

    def _replace_session(self) -> _Session:
        previous, self._session = self._session, _Session()
        if previous is not None:
            previous.superseded = True
            previous.end()
        return self._session

    async def _read_launches(
        self, request_iterator: AsyncIterator[worker_pb2.SchedulerMessage], session: _Session
    ) -> None:
        try:
            async for message in request_iterator:
                if session.superseded:
                    break
                launch = launch_from_proto(message.launch)
                done = asyncio.wrap_future(self._engine.submit(launch))
                session.in_flight.put_nowait((launch.step_id, done))
        finally:
            session.end()

    async def _results(self, session: _Session) -> AsyncIterator[worker_pb2.WorkerMessage]:
        while (item := await session.in_flight.get()) is not None:
            step_id, done = item
            try:
                result = await done
            except Exception as exc:  # the step failed: report it, end the session
                log.exception("step %d failed", step_id)
                yield worker_pb2.WorkerMessage(error=worker_pb2.StepError(step_id=step_id, message=str(exc)))
                return
            yield worker_pb2.WorkerMessage(result=result_to_proto(result))


@dataclass(frozen=True)
class WorkerServer:
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    servicer: WorkerServicer


async def build_server(
    engine: WorkerEngine, host: str, port: int, credentials: grpc.ServerCredentials | None = None
) -> WorkerServer:
    """Plaintext unless `credentials`; health and reflection share the port and its TLS."""
    server = grpc.aio.server(options=GRPC_OPTIONS + KEEPALIVE_SERVER_OPTIONS + NO_PORT_SHARING)
    servicer = WorkerServicer(engine)
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    health_servicer = await add_health_and_reflection(server, SERVICE_NAME)
    bound = add_port(server, f"{host}:{port}", credentials)
    return WorkerServer(server, bound, health_servicer, servicer)
