"""Frontend processes of one engine core: start them, restart one that dies, drain them.

Every frontend serves the one public port (SO_REUSEPORT: the kernel spreads new
connections over them) and attaches to the core over a unix socket in a private
directory. A frontend that dies takes its clients' connections with it (they see
UNAVAILABLE); the core ends its requests and frees their slots when its link closes,
and a new frontend takes its place.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import pickle
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable

from prometheus_client.core import Metric

from scheduler_svc.engine.core import EngineCore
from scheduler_svc.frontend.telemetry import FrontendTelemetry
from scheduler_svc.process.config import FrontendProcessConfig, SchedulerConfig
from scheduler_svc.process.frontend_metrics import parse_exposition
from scheduler_svc.process.link.core_side import CoreLink, RemoteFrontend
from stepahead.serving import reserve_shared_port

log = logging.getLogger("stepahead.supervisor")

START_TIMEOUT_S = 60.0
RESTART_BACKOFF_S = (0.5, 30.0)
STOP_MARGIN_S = 5.0  # beyond the grace: time for a frontend to flush and exit


class FrontendSupervisor:
    def __init__(
        self, core: EngineCore, config: SchedulerConfig, socket_path: str, exposition: Callable[[], bytes]
    ) -> None:
        self._core = core
        self._config = config
        self._count = config.frontends
        self._host = config.api.host
        self._port = config.api.port
        self._http_port = config.api.http_port
        self._socket_path = socket_path
        self._link = CoreLink(core, self._on_hello, exposition)
        core.intake = self._link
        self._procs: dict[int, FrontendProcess] = {}
        self._attached = {i: asyncio.Event() for i in range(self._count)}
        self._watchers: set[asyncio.Task[None]] = set()
        self._stopping = False
        self._port_guards: list[socket.socket] = []
        self._zeros = FrontendTelemetry(core.config.mode).registry  # names exist before any frontend
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> tuple[int, int]:
        """Starts every frontend and returns the public ports (gRPC, HTTP or 0) once all serve them."""
        self._loop = asyncio.get_running_loop()
        self._port = self._reserve(self._port, "--port")  # first: a port in use stops nothing running
        if self._http_port:
            self._http_port = self._reserve(self._http_port, "--http-port")
        await self._link.start(self._socket_path)
        for index in range(self._count):
            await self._spawn(index, restart_delay=None)
        waits = [asyncio.create_task(event.wait()) for event in self._attached.values()]
        _, pending = await asyncio.wait(waits, timeout=START_TIMEOUT_S)
        for task in pending:
            task.cancel()
        if pending:
            raise RuntimeError(f"{len(pending)} frontend processes did not start in {START_TIMEOUT_S:.0f}s")
        return self._port, self._http_port

    def _reserve(self, port: int, flag: str) -> int:
        guard = reserve_shared_port(self._host, port, flag)
        self._port_guards.append(guard)
        return int(guard.getsockname()[1])

    async def stop(self, grace_s: float) -> None:
        """SIGTERM every frontend (each drains for `grace_s`), then the link."""
        self._stopping = True
        for proc in self._procs.values():
            with contextlib.suppress(ProcessLookupError):
                proc.popen.send_signal(signal.SIGTERM)
        for proc in self._procs.values():
            try:
                await asyncio.wait_for(asyncio.shield(proc.exited), grace_s + STOP_MARGIN_S)
            except TimeoutError:
                proc.popen.kill()
        await self._link.stop()
        for guard in self._port_guards:
            guard.close()

    def metric_sources(self) -> list[Iterable[Metric]]:
        """Called from the /metrics thread: every frontend's exposition, asked over its link."""
        assert self._loop is not None
        texts = asyncio.run_coroutine_threadsafe(self._link.metrics_texts(), self._loop).result(10)
        return [self._zeros.collect(), *(parse_exposition(text) for text in texts)]

    # ---- processes -------------------------------------------------------------------------

    async def _spawn(self, index: int, restart_delay: float | None) -> None:
        """Starts frontend `index`, handing it its config on its stdin."""
        config = self._config
        given = FrontendProcessConfig(
            dataclasses.replace(config.frontend, index=index),
            dataclasses.replace(config.api, port=self._port, http_port=self._http_port),
            self._socket_path,
            config.grace_s,
            config.observability.log_level,
            config.frontend_nice,
        )
        proc = FrontendProcess.start(given)
        self._procs[index] = proc
        task = asyncio.create_task(self._watch(index, proc, restart_delay or RESTART_BACKOFF_S[0]))
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)

    async def _watch(self, index: int, proc: FrontendProcess, delay: float) -> None:
        code = await asyncio.shield(proc.exited)
        if self._stopping or code == 0:  # told to stop: it drained and left
            return
        pid = proc.popen.pid
        log.error("frontend %d (pid %d) exited with %s; restarting in %.1fs", index, pid, code, delay)
        self._core.telemetry.frontend_restarts.inc()
        await asyncio.sleep(delay)
        if not self._stopping:
            await self._spawn(index, min(delay * 2, RESTART_BACKOFF_S[1]))

    def _on_hello(self, frontend: RemoteFrontend) -> None:
        log.info("frontend %d (pid %d) serves port %d", frontend.index, frontend.pid, frontend.port)
        if frontend.index in self._attached:
            self._attached[frontend.index].set()
        self._core.telemetry.frontends.set(len(self._link.frontends))


class FrontendProcess:
    """A frontend process and a future of its exit code.

    Started with `subprocess.Popen`, not the event loop's own spawn: uvloop's (libuv's) forks,
    and fork runs gRPC's fork handlers in the child, which can abort it before it execs while
    this process has calls in flight (grpc/grpc#43055); Popen's vfork-and-exec runs none. Its
    exit is waited for by a thread of its own."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen
        loop = asyncio.get_running_loop()
        self.exited: asyncio.Future[int] = loop.create_future()

        def wait() -> None:
            code = popen.wait()
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits any more
                loop.call_soon_threadsafe(self._exit, code)

        threading.Thread(target=wait, name=f"frontend-{popen.pid}", daemon=True).start()

    @classmethod
    def start(cls, given: FrontendProcessConfig) -> FrontendProcess:
        """Starts a frontend process, handing it its config on its stdin."""
        command = [sys.executable, "-m", "scheduler_svc.process.frontend_process"]
        popen = subprocess.Popen(command, stdin=subprocess.PIPE)
        assert popen.stdin is not None
        popen.stdin.write(pickle.dumps(given))  # a few hundred bytes: the pipe holds them
        popen.stdin.close()
        return cls(popen)

    def _exit(self, code: int) -> None:
        if not self.exited.done():
            self.exited.set_result(code)
