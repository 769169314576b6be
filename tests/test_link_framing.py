"""The core-frontend link's wire (stepahead/framing.py) and both of its ends
(`CoreLink` on the core's side, `RemoteCore` on a frontend's) over a real unix socket."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import socket
import tempfile
from typing import Any

import pytest

import stepahead
from scheduler_svc.contract import CoreRequestSpec, SamplingParams, StepOutputs
from scheduler_svc.engine.core import CoreConfig, EngineCore
from scheduler_svc.engine.request import Request
from scheduler_svc.frontend.frontend import Frontend, FrontendConfig
from scheduler_svc.process.link.codec import params_from_proto, params_to_proto
from scheduler_svc.process.link.core_side import CoreLink, RemoteFrontend
from scheduler_svc.process.link.frontend_side import CoreGone, RemoteCore
from stepahead.event_loop import EVENT_LOOP_ENV
from stepahead.event_loop import run as run_loop
from stepahead.framing import HEADER, MAX_FRAME_BYTES, FrameProtocol
from stepahead.packed import I32, U64, pack
from stepahead.protocol import Constraint
from stepahead.v1 import core_pb2
from tests.harness import params

HANG_GUARD_S = 30.0


class FakeTransport:
    def __init__(self) -> None:
        self.written = bytearray()
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


def outputs_message(i: int) -> core_pb2.CoreMessage:
    return core_pb2.CoreMessage(
        outputs=core_pb2.StepOutputs(handles=pack(U64, range(i)), token_ids=pack(I32, range(i)))
    )


def test_frames_parse_in_order_however_the_bytes_are_cut() -> None:
    sender_transport = FakeTransport()
    sender: FrameProtocol[core_pb2.CoreMessage] = FrameProtocol(
        core_pb2.CoreMessage.FromString, lambda m: None, lambda e: None
    )
    sender.connection_made(sender_transport)  # type: ignore[arg-type]
    sent = [outputs_message(i) for i in range(40)]  # the first is empty: a zero-length frame
    for m in sent:
        sender.send(m)
    stream = bytes(sender_transport.written)
    assert len(stream) == sum(HEADER.size + m.ByteSize() for m in sent)
    rng = random.Random(7)
    for cuts in ([1] * len(stream), [len(stream)], [rng.randint(1, 300) for _ in range(len(stream))]):
        got: list[core_pb2.CoreMessage] = []
        receiver: FrameProtocol[core_pb2.CoreMessage] = FrameProtocol(
            core_pb2.CoreMessage.FromString, got.append, lambda e: None
        )
        receiver.connection_made(FakeTransport())  # type: ignore[arg-type]
        at = 0
        for cut in cuts:
            if at >= len(stream):
                break
            receiver.data_received(stream[at : at + cut])
            at += cut
        assert got == sent


def test_an_oversized_frame_closes_the_connection_and_a_closed_link_sends_nothing() -> None:
    transport = FakeTransport()
    got: list[core_pb2.CoreMessage] = []
    wire: FrameProtocol[core_pb2.CoreMessage] = FrameProtocol(
        core_pb2.CoreMessage.FromString, got.append, lambda e: None
    )
    wire.connection_made(transport)  # type: ignore[arg-type]
    wire.data_received(HEADER.pack(MAX_FRAME_BYTES + 1) + b"x" * 16)
    assert transport.closed and got == [] and not wire.open
    wire.send(outputs_message(3))
    assert transport.written == b""


def test_lost_is_reported_once_with_the_cause() -> None:
    lost: list[Exception | None] = []
    wire: FrameProtocol[core_pb2.CoreMessage] = FrameProtocol(
        core_pb2.CoreMessage.FromString, print, lost.append
    )
    wire.connection_made(FakeTransport())  # type: ignore[arg-type]
    cause = ConnectionResetError("peer gone")
    wire.connection_lost(cause)
    assert lost == [cause] and not wire.open


class CountingTransport:
    """A real transport whose `write` calls are counted."""

    def __init__(self, inner: asyncio.Transport) -> None:
        self.inner = inner
        self.writes = 0

    def write(self, data: bytes) -> None:
        self.writes += 1
        self.inner.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def _frames_go_to_the_socket_at_once_and_in_order_when_it_is_full(loop_name: str) -> None:
    loop = asyncio.get_running_loop()
    assert type(loop).__module__.startswith(loop_name)
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    got: list[core_pb2.CoreMessage] = []
    lost: list[Exception | None] = []
    sender_made: FrameProtocol[core_pb2.CoreMessage] = FrameProtocol(
        core_pb2.CoreMessage.FromString, got.append, lost.append
    )
    inner, sender = await loop.connect_accepted_socket(lambda: sender_made, left)
    counted = CountingTransport(inner)
    sender._transport = counted  # type: ignore[assignment]
    right.setblocking(False)
    # An idle peer's socket takes each small frame whole: no frame goes through the transport.
    small = [outputs_message(i % 7) for i in range(50)]
    for m in small:
        sender.send(m)
    assert counted.writes == 0
    # Frames past what the socket holds: the rest is queued by the transport, and so is every
    # frame after it while its queue is not empty; the peer reads them all in order.
    big = [
        core_pb2.CoreMessage(outputs=core_pb2.StepOutputs(token_ids=pack(I32, range(i, i + 30_000))))
        for i in range(40)
    ]
    for m in big:
        sender.send(m)
    assert counted.writes > 0 and inner.get_write_buffer_size() > 0
    reader: FrameProtocol[core_pb2.CoreMessage] = FrameProtocol(
        core_pb2.CoreMessage.FromString, got.append, lost.append
    )
    reader.connection_made(FakeTransport())  # type: ignore[arg-type]
    expected = small + big
    async with asyncio.timeout(HANG_GUARD_S):
        while len(got) < len(expected):
            try:
                reader.data_received(right.recv(1 << 20))
            except BlockingIOError:
                await asyncio.sleep(0.001)
    assert got == expected
    # A peer that is gone: the frame is dropped, the loss reported once by the transport.
    right.close()
    async with asyncio.timeout(HANG_GUARD_S):
        while not lost:
            sender.send(outputs_message(3))
            await asyncio.sleep(0.001)
    assert len(lost) == 1 and not sender.open
    sender.send(outputs_message(3))


@pytest.mark.parametrize("loop_name", ["uvloop", "asyncio"])
def test_frames_go_to_the_socket_at_once_and_in_order_when_it_is_full(
    loop_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(EVENT_LOOP_ENV, loop_name)
    run_loop(_frames_go_to_the_socket_at_once_and_in_order_when_it_is_full(loop_name))


def spec(handle: int) -> CoreRequestSpec:
    return CoreRequestSpec(handle, f"r{handle}", [1, 2, 3], params(4), 0.0, 0)


async def linked(tmp: str) -> tuple[EngineCore, CoreLink, list[RemoteFrontend], Frontend, RemoteCore]:
    core = EngineCore(None, CoreConfig())  # type: ignore[arg-type]  # no worker: nothing runs
    hellos: list[RemoteFrontend] = []
    link = CoreLink(core, hellos.append, lambda: b"# the service's metrics\n")
    await link.start(f"{tmp}/core.sock")
    frontend = Frontend(FrontendConfig(core.config.mode))
    remote = RemoteCore(f"{tmp}/core.sock", frontend, lambda: b"# frontend metrics\n")
    return core, link, hellos, frontend, remote


async def until(condition: Any) -> None:
    async with asyncio.timeout(HANG_GUARD_S):
        while not condition():
            await asyncio.sleep(0.005)


async def _both_ends_of_the_link_over_a_unix_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        core, link, hellos, frontend, remote = await linked(tmp)
        added: list[Request] = []
        aborted: list[tuple[Any, list[int]]] = []
        monkeypatch.setattr(core, "add", added.extend)
        monkeypatch.setattr(core, "abort_handles", lambda owner, handles: aborted.append((owner, handles)))
        delivered: list[StepOutputs] = []
        monkeypatch.setattr(frontend, "send", delivered.append)
        attached = asyncio.create_task(remote.attach(3, 4242, 8123))
        await until(lambda: hellos)
        (seen,) = hellos
        assert (seen.index, seen.pid, seen.port) == (3, 4242, 8123)
        assert link.frontends == {seen} and seen in core.frontends

        # Requests made in one loop turn leave as one batch; one aborted before it left never does.
        for handle in (1, 2, 3):
            remote.add(spec(handle))
        remote.abort(2)
        await until(lambda: added)
        assert [r.rid for r in added] == ["r1", "r3"] and all(r.owner is seen for r in added)
        remote.abort(1)
        await until(lambda: aborted)
        assert aborted == [(seen, [1])]

        # Step outputs, queries and answers.
        outputs = StepOutputs()
        outputs.add(1, 42, None)
        seen.send(outputs)
        await until(lambda: delivered)
        assert (delivered[0].handles, delivered[0].token_ids) == ([1], [42])
        assert await link.metrics_texts() == [b"# frontend metrics\n"]
        info = await remote.server_info()
        assert info.version == stepahead.__version__ and not info.worker_connected
        assert await remote.abort_request("nobody") is False
        assert await remote.exposition() == b"# the service's metrics\n"

        # The core goes away: the frontend's attach returns, its queries fail, the core detached it.
        await link.stop()
        await asyncio.wait_for(attached, HANG_GUARD_S)
        assert link.frontends == set() and seen not in core.frontends
        with pytest.raises(CoreGone):
            await remote.server_info()
        with pytest.raises(CoreGone):
            await remote.abort_request("r3")


async def _a_frontend_that_goes_away_is_detached_and_its_requests_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        core, link, hellos, _, remote = await linked(tmp)
        detached: list[Any] = []
        original = core.detach

        def detach(frontend: Any) -> None:
            detached.append(frontend)
            original(frontend)

        monkeypatch.setattr(core, "detach", detach)
        attached = asyncio.create_task(remote.attach(0, 1, 2))
        await until(lambda: hellos)
        await remote.close()
        await until(lambda: detached)
        assert detached == hellos and link.frontends == set()
        await asyncio.wait_for(attached, HANG_GUARD_S)
        await link.stop()


async def _a_connection_that_does_not_start_with_a_hello_is_closed() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        core, link, hellos, _, _ = await linked(tmp)
        reader, writer = await asyncio.open_unix_connection(f"{tmp}/core.sock")
        body = core_pb2.FrontendMessage(requests=core_pb2.RequestBatch(abort=[1])).SerializeToString()
        writer.write(HEADER.pack(len(body)) + body)
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), HANG_GUARD_S) == b""  # closed by the core
        assert hellos == [] and link.frontends == set() and core.frontends == set()
        writer.close()
        await link.stop()


async def _a_frontend_without_a_core_returns_from_attach() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        frontend = Frontend(FrontendConfig("overlap"))
        remote = RemoteCore(f"{tmp}/nobody.sock", frontend, lambda: b"")
        await asyncio.wait_for(remote.attach(0, 1, 2), HANG_GUARD_S)
        with pytest.raises(CoreGone):
            await remote.server_info()


def test_both_ends_of_the_link_over_a_unix_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    run_loop(_both_ends_of_the_link_over_a_unix_socket(monkeypatch))


def test_a_frontend_that_goes_away_is_detached_and_its_requests_end(monkeypatch: pytest.MonkeyPatch) -> None:
    run_loop(_a_frontend_that_goes_away_is_detached_and_its_requests_end(monkeypatch))


def test_a_connection_that_does_not_start_with_a_hello_is_closed() -> None:
    run_loop(_a_connection_that_does_not_start_with_a_hello_is_closed())


def test_a_frontend_without_a_core_returns_from_attach() -> None:
    run_loop(_a_frontend_without_a_core_returns_from_attach())


def test_sampling_parameters_cross_the_link_whole_zeros_included() -> None:
    """Every parameter the core reads comes through the link as the frontend set it: a zero the
    wire leaves out is read as that zero (not the dataclass's own default), and stop ids, logit
    bias and a constraint as sent; stop strings stay in the frontend."""
    rng = random.Random(5)
    constraints = [None, Constraint("json", '{"type": "object"}'), Constraint("regex", "")]
    cases = [
        SamplingParams(0, 0.0, 0.0, 0, 0, frozenset(), (), False, repetition_penalty=0.0),
        SamplingParams(1, 0.5, 1.0, 0, 1, frozenset(), ("stop",), True),
    ]
    for _ in range(20):
        cases.append(
            SamplingParams(
                rng.randrange(1, 4096),
                rng.choice([0.0, 0.25, 1.5]),
                rng.choice([0.0, 0.5, 1.0]),
                rng.randrange(0, 50),
                rng.randrange(0, 2**31),
                frozenset(rng.sample(range(300), rng.randrange(0, 4))),
                (),
                rng.random() < 0.5,
                logprobs=rng.random() < 0.5,
                top_logprobs=rng.randrange(0, 5),
                repetition_penalty=rng.choice([0.0, 1.0, 1.25]),
                presence_penalty=rng.choice([0.0, -0.5, 0.5]),
                frequency_penalty=rng.choice([0.0, 0.75]),
                min_tokens=rng.randrange(0, 8),
                logit_bias=tuple(sorted((t, rng.choice([-5.0, 0.5])) for t in rng.sample(range(300), 2))),
                constraint=rng.choice(constraints),
                min_p=rng.choice([0.0, 0.125]),
            )
        )
    for sent in cases:
        wire = core_pb2.CoreSampling.FromString(params_to_proto(sent).SerializeToString())
        got = params_from_proto(wire)
        assert got == dataclasses.replace(sent, stop=()), sent
