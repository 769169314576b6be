"""Real worker and scheduler processes on 127.0.0.1, for tests and benchmarks."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stepahead.serving import API_KEY_ENV

LISTEN_RE = re.compile(r"listening on [\d.]+:(\d+)")
METRICS_RE = re.compile(r"(\w+) metrics on http://[\d.]+:(\d+)/metrics")
HTTP_RE = re.compile(r"HTTP on port (\d+)")
# Hang guards, not expectations: a service starts in 1-5 s on a machine of this kind (torch's
# import, a model's load) and stops in under a second; both are ten times that or more.
START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0


@dataclass
class Service:
    proc: subprocess.Popen[str]
    port: int
    output: list[str]
    name: str  # "worker" or "scheduler"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str:
        """The OpenAI-compatible API's base URL (the scheduler must run with --http-port)."""
        found = next(m for line in self.output if (m := HTTP_RE.search(line)))
        return f"http://127.0.0.1:{found.group(1)}"

    @property
    def metrics_url(self) -> str:
        """The service's own /metrics endpoint (it must run with --metrics-port >= 0)."""
        return self.metrics_urls[self.name]

    @property
    def metrics_urls(self) -> dict[str, str]:
        """Every /metrics endpoint the process serves, by service: "worker" and "scheduler"
        for a scheduler with an in-process worker."""
        found = (METRICS_RE.search(line) for line in self.output)
        return {m.group(1): f"http://127.0.0.1:{m.group(2)}/metrics" for m in found if m}

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM, then the exit code (SIGKILL if it does not stop in time)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise


def spawn_worker(
    args: list[str], port: int = 0, code: Path | None = None, module: str = "worker_svc"
) -> Service:
    """`module`: run as `python -m module` (one whose main is the worker's, with a fault a test
    puts in it, say)."""
    return _spawn(module, _with_free_metrics_port(args), port, code=code, name="worker")


def spawn_scheduler(
    worker_address: str,
    args: list[str],
    port: int = 0,
    api_key: str | None = None,
    fd_limit: int | None = None,
    code: Path | None = None,
) -> Service:
    """`api_key` reaches the scheduler in its environment, as an operator should pass it;
    `fd_limit` lowers its limit on open files (`ulimit -n`), and its frontends'."""
    flags = ["--worker", worker_address, *_with_http_off(_with_free_metrics_port(args))]
    env = {API_KEY_ENV: api_key} if api_key else {}
    return _spawn("scheduler_svc", flags, port, env, fd_limit=fd_limit, code=code)


def spawn_scheduler_in_process(worker_args: list[str], args: list[str], port: int = 0) -> Service:
    """A scheduler running the worker engine in its own process (no gRPC between them)."""
    worker_flags = shlex.join(_with_free_metrics_port(worker_args))
    return _spawn(
        "stepahead_colocated",
        ["--worker-flags", worker_flags, *_with_http_off(_with_free_metrics_port(args))],
        port,
        name="scheduler",
    )


def _with_free_metrics_port(args: list[str]) -> list[str]:
    """Tests run many services at once: their metrics take any free port unless told."""
    return args if "--metrics-port" in args else [*args, "--metrics-port", "0"]


def _with_http_off(args: list[str]) -> list[str]:
    """Schedulers serve HTTP only where a test asks for it (with a port of its own)."""
    return args if "--http-port" in args else [*args, "--http-port", "0"]


# argv: the limit on open files, then the command to become with it.
LIMIT_FILES_THEN_EXEC = (
    "import os, resource, sys; n = int(sys.argv[1]); "
    "resource.setrlimit(resource.RLIMIT_NOFILE, (n, n)); os.execv(sys.argv[2], sys.argv[2:])"
)


def _spawn(
    module: str,
    args: list[str],
    port: int,
    extra_env: dict[str, str] | None = None,
    name: str = "",
    fd_limit: int | None = None,
    code: Path | None = None,
) -> Service:
    """`code`: run the service from this source tree (another checkout of the project, e.g. a
    benchmark's baseline) instead of this one."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(extra_env or {}))
    if code is not None:
        env["PYTHONPATH"] = str(code)

    command = [sys.executable, "-m", module, "--port", str(port), *args]
    if fd_limit is not None:
        # The limit is set by the new interpreter before it becomes the service (exec), not by a
        # `preexec_fn` here: Python code between fork and exec runs gRPC's fork handlers, which
        # (grpcio 1.80+, grpc/grpc#43055) can abort the child when this process has channels.
        command = [sys.executable, "-c", LIMIT_FILES_THEN_EXEC, str(fd_limit), *command]
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=code,
    )
    lines: list[str] = []
    listening = threading.Event()
    threading.Thread(target=_drain, args=(proc, lines, listening), daemon=True).start()
    listening.wait(START_TIMEOUT_S)
    if match := next((m for line in list(lines) if (m := LISTEN_RE.search(line))), None):
        return Service(proc, int(match.group(1)), lines, name or module.removesuffix("_svc"))
    proc.kill()
    exit_code = proc.wait()
    why = f"exited with {exit_code}" if listening.is_set() else f"did not start within {START_TIMEOUT_S:g}s"
    raise RuntimeError(f"{module} {why}:\n{''.join(lines)}")


def _drain(proc: subprocess.Popen[str], lines: list[str], listening: threading.Event) -> None:
    """Keep reading the child's output, so it never blocks on a full pipe; `listening` is set
    once it says where it listens, or once it exits."""
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if LISTEN_RE.search(line):
            listening.set()
    listening.set()


def open_channel(address: str, credentials: grpc.ChannelCredentials | None = None) -> grpc.Channel:
    """A plaintext channel, or a TLS one with `credentials`."""
    if credentials is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, credentials)


FRONTEND_METADATA = (
    "stepahead-frontend"  # which of a scheduler's frontends answered (scheduler_svc/frontend/grpc_api.py)
)


def wait_serving(
    address: str,
    timeout_s: float = START_TIMEOUT_S,
    credentials: grpc.ChannelCredentials | None = None,
    frontends: int = 1,
) -> None:
    """Until the service at `address` answers its health check SERVING; for a scheduler with
    several frontend processes on the port, until each of `frontends` of them has (a new
    connection lands on any one of them, and each learns of the worker on its own)."""
    deadline = time.monotonic() + timeout_s
    serving: set[str] = set()
    while time.monotonic() < deadline:
        # A connection of its own each time, so that probes reach every frontend.
        options = [("grpc.use_local_subchannel_pool", 1)]
        channel = (
            grpc.insecure_channel(address, options)
            if credentials is None
            else grpc.secure_channel(address, credentials, options)
        )
        with channel:
            stub = health_pb2_grpc.HealthStub(channel)
            try:
                reply, call = stub.Check.with_call(  # type: ignore[attr-defined]
                    health_pb2.HealthCheckRequest(service=""), timeout=max(deadline - time.monotonic(), 0.1)
                )
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    serving.add(str(dict(call.initial_metadata()).get(FRONTEND_METADATA, address)))
                    if len(serving) >= frontends:
                        return
                    continue
            except grpc.RpcError:
                pass
        time.sleep(0.05)
    raise TimeoutError(f"{address} not SERVING after {timeout_s}s (frontends serving: {sorted(serving)})")


def frontend_count(scheduler_args: list[str]) -> int:
    """How many frontend processes the scheduler's flags ask for (1 when not said; 0 serves
    from the core's own process, which is one frontend too)."""
    flags = list(scheduler_args)
    count = int(flags[flags.index("--frontends") + 1]) if "--frontends" in flags else 1
    return max(count, 1)


Link = Literal["grpc", "socket"]  # how the scheduler reaches its worker


@contextmanager
def link_socket() -> Iterator[tuple[list[str], str]]:
    """A worker's flags to serve its framed link on a unix socket in a private directory made for
    it (removed on exit), and the scheduler's `--worker` to reach it there."""
    # In the system's temporary directory: a short path, as a socket's address must be.
    with tempfile.TemporaryDirectory(prefix="stepahead-") as directory:
        path = Path(directory) / "worker.sock"
        yield ["--link-socket", str(path)], f"unix:{path}"


@contextmanager
def serving_pair(
    worker_args: list[str],
    scheduler_args: list[str] = (),  # type: ignore[assignment]
    *,
    worker_credentials: grpc.ChannelCredentials | None = None,
    scheduler_credentials: grpc.ChannelCredentials | None = None,
    api_key: str | None = None,
    code: Path | None = None,
    link: Link = "grpc",
) -> Iterator[tuple[Service, Service]]:
    """A worker and a scheduler connected to it, both SERVING; stopped on exit. The credentials
    are what a client needs to reach each one when it serves TLS (health checks need no key);
    `code`: both run from that source tree; `link`: gRPC to the worker's port, or its framed
    link socket."""
    with contextlib.ExitStack() as stack:
        worker_flags, target = stack.enter_context(link_socket()) if link == "socket" else ([], "")
        yield stack.enter_context(
            _pair(
                [*worker_args, *worker_flags],
                target,
                scheduler_args,
                worker_credentials,
                scheduler_credentials,
                api_key,
                code,
            )
        )


OUTPUT_TAIL_LINES = 40  # of each service's output, in the error of one that never served


@contextmanager
def _output_on_timeout(*services: Service) -> Iterator[None]:
    """A service that listens but never becomes SERVING: the error carries what each of
    `services` printed last (and whether it still runs), so a failure says why."""
    try:
        yield
    except TimeoutError as timeout:
        parts = [str(timeout)]
        for service in services:
            state = "running" if service.proc.poll() is None else f"exited with {service.proc.returncode}"
            tail = "".join(list(service.output)[-OUTPUT_TAIL_LINES:])
            parts.append(f"--- {service.name} ({state}), last output:\n{tail}")
        raise TimeoutError("\n".join(parts)) from timeout


@contextmanager
def _pair(
    worker_args: list[str],
    target: str,
    scheduler_args: list[str],
    worker_credentials: grpc.ChannelCredentials | None,
    scheduler_credentials: grpc.ChannelCredentials | None,
    api_key: str | None,
    code: Path | None,
) -> Iterator[tuple[Service, Service]]:
    worker = spawn_worker(worker_args, code=code)
    scheduler = None
    try:
        with _output_on_timeout(worker):
            wait_serving(worker.address, credentials=worker_credentials)
        target = target or worker.address
        scheduler = spawn_scheduler(target, list(scheduler_args), api_key=api_key, code=code)
        with _output_on_timeout(scheduler, worker):
            wait_serving(
                scheduler.address,
                credentials=scheduler_credentials,
                frontends=frontend_count(list(scheduler_args)),
            )
        yield worker, scheduler
    finally:
        for service in (scheduler, worker):
            if service is not None and service.proc.poll() is None:
                service.stop()
