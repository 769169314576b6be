"""python -m bench.link_delay --listen 127.0.0.1:PORT --target 127.0.0.1:PORT --delay-ms D:
a TCP proxy that delays each direction by D ms, for a slow worker link in tests and benchmarks.

Each chunk read from one side is written to the other D ms after it was read, in order, so
the link has a one-way delay of D ms (a round trip of 2D) and the bandwidth of loopback. The
machine's own network settings are left alone. A connection to the proxy opens one to the
target; either side closing closes both.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field

CHUNK_BYTES = 1 << 16


@dataclass
class LinkDelay:
    """The proxy: `start()`, then connect to `port`; `close()` ends every connection."""

    target_host: str
    target_port: int
    delay_s: float
    listen_host: str = "127.0.0.1"
    listen_port: int = 0
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._accept, self.listen_host, self.listen_port)
        return self.port

    @property
    def port(self) -> int:
        assert self._server is not None, "start() first"
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            target_r, target_w = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            client_w.close()
            return
        pipes = [
            self._spawn(_pipe(client_r, target_w, self.delay_s)),
            self._spawn(_pipe(target_r, client_w, self.delay_s)),
        ]
        await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        for pipe in pipes:
            pipe.cancel()
        for writer in (client_w, target_w):
            writer.close()

    def _spawn(self, coroutine: Coroutine[None, None, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    """Copies reader to writer, each chunk `delay_s` after it was read (a reader task and a
    writer task, so that reading never waits for the delay)."""
    chunks: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
    writing = asyncio.create_task(_write_delayed(chunks, writer))
    try:
        while chunk := await reader.read(CHUNK_BYTES):
            chunks.put_nowait((time.monotonic() + delay_s, chunk))
        chunks.put_nowait((time.monotonic() + delay_s, b""))
        await writing
    finally:
        writing.cancel()


async def _write_delayed(chunks: asyncio.Queue[tuple[float, bytes]], writer: asyncio.StreamWriter) -> None:
    while True:
        due, chunk = await chunks.get()
        await asyncio.sleep(max(due - time.monotonic(), 0.0))
        if not chunk:
            with contextlib.suppress(OSError):
                writer.write_eof()
            return
        writer.write(chunk)
        await writer.drain()


@contextlib.contextmanager
def running(target: str, delay_ms: float) -> Iterator[str]:
    """This proxy in a process of its own in front of `target` (HOST:PORT), delaying each
    direction by `delay_ms`; yields the address to connect to instead (`target` itself at 0)."""
    # Hang guards of the test processes (imported here: the proxy's own process needs no gRPC).
    from stepahead.processes import START_TIMEOUT_S, STOP_TIMEOUT_S

    if not delay_ms:
        yield target
        return
    command = [sys.executable, "-m", "bench.link_delay", "--target", target, "--delay-ms", f"{delay_ms:g}"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        stdout = proc.stdout
        assert stdout is not None
        first_line: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: first_line.put(stdout.readline()), daemon=True).start()
        try:
            line = first_line.get(timeout=START_TIMEOUT_S)
        except queue.Empty:
            raise RuntimeError(f"bench.link_delay did not start within {START_TIMEOUT_S:g}s") from None
        found = re.search(r"listening on ([\d.]+:\d+)", line)
        assert found, "bench.link_delay did not start"
        yield found.group(1)
    finally:
        proc.terminate()
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise


def _address(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    return host or "127.0.0.1", int(port)


async def _serve(args: argparse.Namespace) -> None:
    (host, port), (target_host, target_port) = _address(args.listen), _address(args.target)
    proxy = LinkDelay(target_host, target_port, args.delay_ms / 1e3, host, port)
    port = await proxy.start()
    print(
        f"link delay {args.delay_ms:g} ms each way, listening on {host}:{port}, to {args.target}", flush=True
    )
    try:
        await asyncio.Event().wait()
    finally:
        await proxy.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.link_delay", description=__doc__.splitlines()[0])
    p.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to accept on (port 0: any)")
    p.add_argument("--target", required=True, help="HOST:PORT to forward to")
    p.add_argument("--delay-ms", type=float, required=True, help="one-way delay of each direction")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(p.parse_args(argv)))


if __name__ == "__main__":
    main()
