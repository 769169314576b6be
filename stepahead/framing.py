"""The wire of the links between processes of one host (core and frontends; a worker and its
scheduler over the worker's --link-socket): length-prefixed protobuf frames on a unix stream socket.

Each frame is a 4-byte little-endian length and that many bytes of one serialized message. A
message is one `write` syscall (no completion thread, no HTTP/2 framing, flow-control window or
per-message task), and what arrives is parsed in the event loop's read callback: these links
carry a message or two per step each, so their cost per message is the scheduler's cost per step.
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar, cast

log = logging.getLogger("stepahead.link")

HEADER = struct.Struct("<I")
MAX_FRAME_BYTES = 1 << 30  # a longer frame is a broken peer, not a message
READ_CHUNK = 1 << 18  # what `resume_reading` reads a syscall


class Wire(Protocol):
    def SerializeToString(self) -> bytes: ...


M = TypeVar("M")


class FrameProtocol(asyncio.Protocol, Generic[M]):
    """One end of a link: `send` writes a frame, `on_frame` gets each parsed message in order,
    `on_lost` is called once when the connection ends (None: closed cleanly)."""

    def __init__(
        self,
        parse: Callable[[bytes], M],
        on_frame: Callable[[M], None],
        on_lost: Callable[[Exception | None], None],
    ) -> None:
        self._parse = parse
        self._on_frame = on_frame
        self._on_lost = on_lost
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._fd = -1  # the socket's, where frames may be written past the transport (see send)

    @property
    def open(self) -> bool:
        return self._transport is not None and not self._transport.is_closing()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None and os.name == "posix" and not os.get_blocking(sock.fileno()):
            self._fd = sock.fileno()

    def send(self, message: Wire) -> None:
        """Writes one frame, or queues what the socket does not take at once (nothing if the
        link is closed: its peer's loss is reported once, by `on_lost`).

        NOTE: written with `os.write`, which gives up the interpreter lock for the syscall, where
        the transport's write (uvloop's) keeps it. The write wakes the peer, which on a busy host
        may take this CPU on the spot; holding the lock meanwhile, a worker's event loop would
        stall its forward thread until it ran again (py-spy saw a quarter of the worker loop's
        lock-held time in this write). Only when the transport has nothing queued, so that
        frames stay in order.
        """
        if not self.open:
            return
        transport = self._transport
        assert transport is not None
        body = message.SerializeToString()
        frame = HEADER.pack(len(body)) + body
        if self._fd >= 0 and not transport.get_write_buffer_size():
            try:
                written = os.write(self._fd, frame)
            except OSError:  # full (EAGAIN), or broken: the transport queues it or meets the error
                written = 0
            if written == len(frame):
                return
            frame = frame[written:]
        transport.write(frame)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def pause_reading(self) -> None:
        """Leave what arrives in the socket until `resume_reading` (both idempotent)."""
        transport = self._transport
        if transport is not None and not transport.is_closing() and transport.is_reading():
            transport.pause_reading()

    def resume_reading(self) -> None:
        """Reads what arrived meanwhile, its frames reaching `on_frame` before this returns,
        then leaves the socket to the event loop again. An end or an error of the connection is
        left in the socket, for the transport to meet as it reads."""
        transport = self._transport
        if transport is None or transport.is_closing() or transport.is_reading():
            return
        while self._fd >= 0:
            try:
                data = os.read(self._fd, READ_CHUNK)
            except OSError:  # nothing more (EAGAIN), or a broken connection: the transport's
                break
            if data:
                self.data_received(data)
            if len(data) < READ_CHUNK or self._transport is None or transport.is_closing():
                break
        if not transport.is_closing():
            transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        view, start, end = memoryview(buffer), 0, len(buffer)
        try:
            while end - start >= HEADER.size:
                (size,) = HEADER.unpack_from(buffer, start)
                if size > MAX_FRAME_BYTES:
                    log.error("a %d-byte frame on the link: closing it", size)
                    self.close()
                    return
                if end - start - HEADER.size < size:
                    break
                start += HEADER.size
                message = self._parse(view[start : start + size].tobytes())
                start += size
                self._on_frame(message)
        finally:
            view.release()
            del buffer[:start]

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._on_lost(exc)
