"""The worker link, over gRPC and over the worker's framed link socket: one object per session,
so nothing of an old session reaches the next; the socket's own access rules."""

from __future__ import annotations

import asyncio
import socket
import stat
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import pytest

from bench.promtext import scrape, total
from scheduler_svc.engine.transport import WorkerTransport, WorkerUnavailable
from scheduler_svc.process.grpc_transport import GrpcTransport
from scheduler_svc.process.socket_transport import SocketTransport, socket_path
from scheduler_svc.process.worker_link import WorkerLinkConfig
from stepahead.processes import Link, Service, link_socket, spawn_worker, wait_serving
from stepahead.protocol import Launch, NewRequest
from tests.live import CALL_TIMEOUT_S
from tests.test_worker_engine import prefill
from worker_svc.link_socket import bind_private

pytestmark = pytest.mark.anyio

# No core here sends the idle heartbeats a scheduler does: the worker's timeout for a silent
# session is a hang guard's, so the pauses between the test's steps never end one.
SIM = ["--model", "sim", "--sim-step-ms", "1", "--scheduler-timeout", str(CALL_TIMEOUT_S)]
T = TypeVar("T")
LINKS: tuple[Link, ...] = ("grpc", "socket")


async def within(step: Awaitable[T]) -> T:
    """`step`, with a hang guard (milliseconds expected)."""
    return await asyncio.wait_for(step, CALL_TIMEOUT_S)


@contextmanager
def worker_and_target(link: Link, *flags: str) -> Iterator[tuple[Service, str]]:
    """A sim worker, and where a scheduler reaches it over `link`."""
    with link_socket() as (socket_flags, socket_target):
        worker = spawn_worker([*SIM, *flags, *(socket_flags if link == "socket" else [])])
        try:
            wait_serving(worker.address)
            yield worker, socket_target if link == "socket" else worker.address
        finally:
            worker.stop()


def transport_to(target: str, link: WorkerLinkConfig | None = None) -> WorkerTransport:
    path = socket_path(target)
    return GrpcTransport(target, link=link) if path is None else SocketTransport(path, link)


@pytest.mark.parametrize("link", LINKS)
async def test_a_new_session_is_untouched_by_the_old_one(link: Link) -> None:
    with worker_and_target(link) as (_, target):
        transport = transport_to(target)
        old = await within(transport.connect())
        new = await within(transport.connect())  # closes the old session first
        assert new.info.epoch > old.info.epoch
        with pytest.raises(WorkerUnavailable):
            await within(old.launch(Launch(step_id=1)))
        result = await within(await within(new.launch(Launch(step_id=1))))
        assert (result.step_id, result.epoch) == (1, new.info.epoch)
        await within(old.close())  # a late close of the old one must not end the new one
        result = await within(await within(new.launch(Launch(step_id=2))))
        assert result.step_id == 2
        await within(transport.close())


async def test_the_socket_is_this_users_only_and_asks_the_worker_token() -> None:
    with worker_and_target("socket", "--worker-token", "s3cret") as (worker, target):
        path = Path(target.removeprefix("unix:"))
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        for wrong in (None, "guess"):
            with pytest.raises(WorkerUnavailable, match="UNAUTHENTICATED"):
                await within(transport_to(target, WorkerLinkConfig(token=wrong)).connect())
        transport = transport_to(target, WorkerLinkConfig(token="s3cret"))
        session = await within(transport.connect())
        assert (await within(await within(session.launch(Launch(step_id=1))))).step_id == 1
        # A second scheduler is refused while this one's session lives, as on gRPC.
        with pytest.raises(WorkerUnavailable, match="FAILED_PRECONDITION"):
            await within(transport_to(target, WorkerLinkConfig(token="s3cret")).connect())
        await within(transport.close())
        refused = {
            r: total(scrape(worker.metrics_url), "stepahead_worker_sessions_refused_total", reason=r)
            for r in ("unauthenticated", "busy")
        }
        assert refused == {"unauthenticated": 2, "busy": 1}


async def test_a_dead_worker_fails_the_sessions_pending_steps_at_once() -> None:
    """A worker process that dies closes its socket: every launched step fails, and so does the
    next launch, without waiting for a timeout."""
    with worker_and_target("socket", "--sim-step-ms", "2000") as (worker, target):
        session = await within(transport_to(target).connect())
        # Each step runs a forward (2 s on the sim), so neither can end before the kill: a step
        # with no rows would answer at once.
        steps = [
            prefill(i, i, [1, 2], [2 * i, 2 * i + 1], new_requests=[NewRequest(i, 0.0, 1.0, 0, 0)])
            for i in (1, 2)
        ]
        pending = [await within(session.launch(step)) for step in steps]
        worker.proc.kill()
        for step in pending:
            with pytest.raises(WorkerUnavailable, match="ended the session"):
                await within(step)
        with pytest.raises(WorkerUnavailable):
            await within(session.launch(Launch(step_id=3)))
        with pytest.raises(WorkerUnavailable):
            await within(transport_to(target).connect())


def test_the_link_socket_replaces_a_stale_socket_and_refuses_any_other_file(tmp_path: Path) -> None:
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as left_behind:
        left_behind.bind(str(stale))  # a socket file no process listens on
    bind_private(stale).close()
    other = tmp_path / "notes.txt"
    other.write_text("keep me")
    with pytest.raises(ValueError, match=r"--link-socket .*exists and is not a socket"):
        bind_private(other)
    assert other.read_text() == "keep me"
    with pytest.raises(ValueError, match=r"--link-socket .*longer than"):
        bind_private(tmp_path / ("x" * 120))
