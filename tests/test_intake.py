"""The core's intake (`scheduler_svc.contract.Intake`): what frontend processes send while the
core awaits a step stays in their sockets, and is read at once when the step's result is back,
before the next pick; a step longer than `CoreConfig.intake_hold_s` reads it as it comes.

Over real unix sockets, with a host worker whose results the test releases (`FakeWorker(hold=
True)`), so that a step in flight is forced, not hoped for; the socket's queued bytes (FIONREAD)
show that a frame has arrived and is not read."""

from __future__ import annotations

import asyncio
import fcntl
import socket
import struct
import tempfile
import termios
from collections.abc import Callable
from typing import Any

import pytest

from scheduler_svc.engine.core import CoreConfig, EngineCore
from scheduler_svc.engine.request import Request
from scheduler_svc.frontend.frontend import Frontend, FrontendConfig
from scheduler_svc.process.link.core_side import CoreLink
from scheduler_svc.process.link.frontend_side import RemoteCore
from stepahead.event_loop import EVENT_LOOP_ENV
from stepahead.event_loop import run as run_loop
from stepahead.framing import FrameProtocol
from stepahead.packed import I32, pack
from stepahead.v1 import core_pb2
from tests.fake_worker import FakeWorker
from tests.harness import params

HANG_GUARD_S = 30.0
LOOPS = ["uvloop", "asyncio"]


def queued(fd: int) -> int:
    """Bytes in the socket not yet read."""
    got = fcntl.ioctl(fd, termios.FIONREAD, struct.pack("i", 0))
    return int(struct.unpack("i", got)[0])


async def until(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(HANG_GUARD_S):
        while not condition():
            await asyncio.sleep(0.002)


async def turns(n: int = 20) -> None:
    """Some turns of the event loop, time for it to read anything it would."""
    for _ in range(n):
        await asyncio.sleep(0.001)


def message(i: int) -> bytes:
    outputs = core_pb2.StepOutputs(token_ids=pack(I32, [i] * i))
    body = core_pb2.CoreMessage(outputs=outputs).SerializeToString()
    return struct.pack("<I", len(body)) + body


async def _paused_frames_wait_in_the_socket_and_resume_reads_them_at_once(loop_name: str) -> None:
    loop = asyncio.get_running_loop()
    assert type(loop).__module__.startswith(loop_name)
    ours, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    got: list[core_pb2.CoreMessage] = []
    lost: list[Exception | None] = []
    wire: FrameProtocol[core_pb2.CoreMessage] = FrameProtocol(
        core_pb2.CoreMessage.FromString, got.append, lost.append
    )
    await loop.connect_accepted_socket(lambda: wire, ours)
    fd = ours.fileno()
    peer.sendall(message(1))
    await until(lambda: len(got) == 1)  # read as it comes

    wire.pause_reading()
    wire.pause_reading()  # idempotent
    peer.sendall(message(2) + message(3))
    await until(lambda: queued(fd) > 0)
    await turns()
    assert len(got) == 1 and queued(fd) > 0  # held in the socket
    wire.resume_reading()  # reads them before it returns
    assert [len(m.outputs.token_ids) // 4 for m in got] == [1, 2, 3] and queued(fd) == 0
    wire.resume_reading()  # not paused: nothing to do

    # Read by the loop again; a connection that ends while paused is lost after the resume.
    peer.sendall(message(4))
    await until(lambda: len(got) == 4)
    wire.pause_reading()
    peer.sendall(message(5))
    peer.close()
    await turns()
    assert not lost
    wire.resume_reading()
    assert len(got) == 5
    await until(lambda: bool(lost))
    assert lost == [None] and not wire.open
    wire.pause_reading()  # closed: nothing to do
    wire.resume_reading()


@pytest.mark.parametrize("loop_name", LOOPS)
def test_paused_frames_wait_in_the_socket_and_resume_reads_them_at_once(
    loop_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(EVENT_LOOP_ENV, loop_name)
    run_loop(_paused_frames_wait_in_the_socket_and_resume_reads_them_at_once(loop_name))


class Served:
    """An overlap core over a held host worker, its `CoreLink` as intake, and one frontend
    attached over the link's socket; the core's `add` calls are recorded."""

    def __init__(self, tmp: str, hold_s: float) -> None:
        self.worker = FakeWorker(4096, 8, hold=True)
        self.core = EngineCore(self.worker, CoreConfig(mode="overlap", intake_hold_s=hold_s))
        self.link = CoreLink(self.core, lambda _: None, lambda: b"")
        self.core.intake = self.link
        self.path = f"{tmp}/core.sock"
        self.frontend = Frontend(FrontendConfig("overlap"))
        self.remote = RemoteCore(self.path, self.frontend, lambda: b"")
        self.added: list[str] = []
        add = self.core.add

        def recording(reqs: list[Request]) -> None:
            self.added.extend(r.rid for r in reqs)
            add(reqs)

        self.core.add = recording  # type: ignore[method-assign]
        self.tasks: list[asyncio.Task[Any]] = []

    async def start(self) -> None:
        await self.link.start(self.path)
        self.tasks.append(asyncio.create_task(self.remote.attach(0, 1, 2)))
        await until(lambda: bool(self.link.frontends))
        self.tasks.append(asyncio.create_task(self.core.run()))
        await until(lambda: self.frontend.tokenizer is not None)  # the worker's state has come

    def core_fd(self) -> int:
        (wire,) = self.link._connections
        return wire._fd

    def submit(self, rid: str) -> None:
        self.frontend.submit(rid, [1, 2, 3], params(8, ignore_eos=True))

    async def stop(self) -> None:
        await self.core.close()
        while self.worker._held:
            self.worker.complete_next()
        await self.link.stop()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def in_flight(served: Served) -> None:
    """r1's first two steps launched; the core awaits the first one's result."""
    served.submit("r1")
    await until(lambda: len(served.worker.launches) == 2)
    assert served.added == ["r1"]


async def _requests_sent_while_a_step_is_awaited_join_the_next_pick(loop_name: str, hold_s: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        served = Served(tmp, hold_s)
        await served.start()
        await in_flight(served)
        fd = served.core_fd()
        served.submit("r2")
        served.submit("r3")
        if hold_s:
            await until(lambda: queued(fd) > 0)
            await turns()
            assert served.added == ["r1"] and queued(fd) > 0  # unread while step 1 is awaited
        else:  # never held: read as they come
            await until(lambda: served.added == ["r1", "r2", "r3"])
        served.worker.complete_next()  # step 1's result: then step 3 is picked
        await until(lambda: len(served.worker.launches) == 3)
        assert served.added == ["r1", "r2", "r3"] and queued(fd) == 0
        assert len(served.worker.launches[2].new_requests) == 2  # r2 and r3 start at step 3
        await served.stop()


@pytest.mark.parametrize("hold_s", [HANG_GUARD_S, 0.0])
@pytest.mark.parametrize("loop_name", LOOPS)
def test_requests_sent_while_a_step_is_awaited_join_the_next_pick(
    loop_name: str, hold_s: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(EVENT_LOOP_ENV, loop_name)
    run_loop(_requests_sent_while_a_step_is_awaited_join_the_next_pick(loop_name, hold_s))


async def _a_step_longer_than_the_hold_reads_what_comes() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        served = Served(tmp, 0.02)
        await served.start()
        await in_flight(served)
        served.submit("r2")
        await until(lambda: served.added == ["r1", "r2"])  # read though step 1 is still awaited
        assert len(served.worker._held) == 2 and len(served.worker.launches) == 2
        served.worker.complete_next()
        await until(lambda: len(served.worker.launches) == 3)
        assert len(served.worker.launches[2].new_requests) == 1
        await served.stop()


def test_a_step_longer_than_the_hold_reads_what_comes() -> None:
    run_loop(_a_step_longer_than_the_hold_reads_what_comes())
