"""`stepahead serve [MODEL]`: a worker and a scheduler in one command, as `vllm serve MODEL`.

The worker listens on 127.0.0.1 only (a free port unless `--worker-port`), behind a shared
secret made for this run (no other local process can drive it), and the scheduler reaches it
over the worker's framed link on a unix socket in a private directory of this run (less CPU
per step than gRPC; `--link-socket`, `--worker unix:PATH`); the scheduler serves the
OpenAI-compatible HTTP API on `--port` (default 8000) and the gRPC Generation API on
`--grpc-port` (default 50051), both on `--host`. The HTTP API's /metrics holds the worker's
series with the scheduler's (the worker's own endpoint is on loopback, a free port). Every
other flag goes to the service that has it: the worker's (`--tp`, `--dtype`, `--kv-slots`,
...) to the worker, the scheduler's (`--frontends`, `--api-key`, `--tls-cert`, ...) to the
scheduler, `--log-level` and `--grace` to both. SIGTERM or SIGINT stops the scheduler first
(it drains its requests for `--grace` seconds), then the worker; if either exits on its own the
other is stopped and the command exits with its status. On Linux each service also ends if
this command is killed outright.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from scheduler_svc.frontend.api_config import ClientApiConfig
from scheduler_svc.process.config import DEFAULT_GRACE_S
from stepahead.serving import WORKER_TOKEN_ENV
from worker_svc.link_socket import MAX_SOCKET_PATH_BYTES

DEFAULT_MODEL = "smollm2"
STOP_MARGIN_S = 10.0  # past a service's --grace: time to flush and exit before it is killed
# Flags both services know that mean one thing for the pair: sent to both.
TO_BOTH = frozenset({"--log-level", "--grace"})
# Flags both services know that serve means for the public API: the scheduler's. (--host,
# --port: serve's own; the worker token: made for the run, or $STEPAHEAD_WORKER_TOKEN.)
TO_SCHEDULER = frozenset(
    {"--tls-cert", "--tls-key", "--tls-ca", "--metrics-host", "--metrics-port", "--trace-file"}
)

# The service becomes the child process itself (exec), after asking the kernel to send it
# SIGTERM when this process dies (Linux: PR_SET_PDEATHSIG), so that no service outlives it.
DIE_WITH_PARENT_THEN_EXEC = (
    "import ctypes, os, signal, sys\n"
    "if sys.platform == 'linux':\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"
    "    if os.getppid() != int(sys.argv[1]): sys.exit(1)\n"
    "os.execv(sys.argv[2], sys.argv[2:])"
)


@dataclass(frozen=True)
class ServePlan:
    """What `stepahead serve` runs: each service's command line."""

    worker: tuple[str, ...]
    scheduler: tuple[str, ...]
    worker_port: int
    worker_token: str
    host: str
    http_port: int
    grpc_port: int
    grace_s: float


class FlagError(ValueError):
    pass


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="stepahead serve",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
        epilog="Other flags go to the worker or the scheduler, whichever has them "
        "(`stepahead worker --help`, `stepahead scheduler --help`).",
    )
    api = ClientApiConfig()
    p.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        help=f"smollm2, tiny, sim, a .gguf file or a checkpoint directory (default {DEFAULT_MODEL})",
    )
    p.add_argument("--model", dest="model_flag", metavar="MODEL", help="the same as MODEL")
    p.add_argument("--host", default=api.host, help="address of both APIs (0.0.0.0 for all)")
    p.add_argument(
        "--port", type=int, default=api.http_port, metavar="N", help="port of the OpenAI-compatible HTTP API"
    )
    p.add_argument(
        "--grpc-port", type=int, default=api.port, metavar="N", help="port of the gRPC Generation API"
    )
    p.add_argument(
        "--worker-port",
        type=int,
        default=0,
        metavar="N",
        help="the worker's port on 127.0.0.1 (0: a free one)",
    )
    return p


def split(argv: Sequence[str]) -> tuple[list[str], list[str], list[str]]:
    """Splits a command line into serve's own arguments (MODEL among them), the worker's flags
    and the scheduler's; FlagError names a flag no one has (or one that serve sets itself)."""
    from scheduler_svc.process.cli import build_parser as scheduler_parser
    from worker_svc.cli import build_parser as worker_parser

    own_actions = build_parser()._option_string_actions
    worker_actions = worker_parser()._option_string_actions
    scheduler_actions = scheduler_parser()._option_string_actions
    own: list[str] = []
    to_worker: list[str] = []
    to_scheduler: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        name, has_value, _ = token.partition("=")
        if not name.startswith("-"):
            own.append(token)  # MODEL (argparse refuses a second one)
            i += 1
            continue
        if name in ("--worker", "--http-port", "--worker-token", "--worker-metrics-url", "--link-socket"):
            raise FlagError(f"{name}: stepahead serve sets it (see --port, --grpc-port, --worker-port)")
        action = own_actions.get(name) or worker_actions.get(name) or scheduler_actions.get(name)
        if action is None:
            raise FlagError(f"{name}: no such flag on stepahead serve, the worker or the scheduler")
        group = list(argv[i : i + (1 if has_value or action.nargs == 0 else 2)])
        if not has_value and action.nargs != 0 and len(group) < 2:
            raise FlagError(f"{name}: expects a value")
        i += len(group)
        if name in own_actions:
            own += group
        elif name in TO_BOTH:
            to_worker += group
            to_scheduler += group
        elif name in scheduler_actions and (name in TO_SCHEDULER or name not in worker_actions):
            to_scheduler += group
        else:
            to_worker += group
    return own, to_worker, to_scheduler


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def plan(argv: Sequence[str], run_dir: Path) -> ServePlan:
    """Exits with a usage error naming the flag on a bad command line. `run_dir`: this run's
    private directory, where the worker's link socket is made."""
    p = build_parser()
    try:
        own, worker_flags, scheduler_flags = split(argv)
    except FlagError as exc:
        p.error(str(exc))
    args = p.parse_args(own)
    if args.model_tag and args.model_flag and args.model_tag != args.model_flag:
        p.error(f"MODEL {args.model_tag!r} and --model {args.model_flag!r} differ")
    model = args.model_flag or args.model_tag or DEFAULT_MODEL
    worker_port = args.worker_port or free_port()
    worker_metrics_port = free_port()  # on loopback; its series are on the HTTP API's /metrics
    grace = _grace(scheduler_flags)
    link_socket = run_dir / "worker.sock"
    link: tuple[str, ...] = ()
    if len(os.fsencode(link_socket)) > MAX_SOCKET_PATH_BYTES:  # a long $TMPDIR: gRPC on loopback
        worker_address = f"127.0.0.1:{worker_port}"
    else:
        link, worker_address = ("--link-socket", str(link_socket)), f"unix:{link_socket}"
    worker = (
        "-m",
        "worker_svc",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(worker_port),
        "--metrics-host",
        "127.0.0.1",
        "--metrics-port",
        str(worker_metrics_port),
        *link,
        *worker_flags,
    )
    scheduler = (
        "-m",
        "scheduler_svc",
        "--worker",
        worker_address,
        "--host",
        args.host,
        "--port",
        str(args.grpc_port),
        "--http-port",
        str(args.port),
        "--worker-metrics-url",
        f"http://127.0.0.1:{worker_metrics_port}/metrics",
        *scheduler_flags,
    )
    token = os.environ.get(WORKER_TOKEN_ENV) or secrets.token_urlsafe(24)
    return ServePlan(worker, scheduler, worker_port, token, args.host, args.port, args.grpc_port, grace)


def _grace(scheduler_flags: list[str]) -> float:
    for i, flag in enumerate(scheduler_flags):
        if flag == "--grace" and i + 1 < len(scheduler_flags):
            return float(scheduler_flags[i + 1])
        if flag.startswith("--grace="):
            return float(flag.partition("=")[2])
    return DEFAULT_GRACE_S


class Pair:
    """The two services: the worker first, the scheduler once the worker listens (it would
    only retry meanwhile). `stop` ends the scheduler first, then the worker."""

    def __init__(self, served: ServePlan) -> None:
        self.plan = served
        self._env = {**os.environ, WORKER_TOKEN_ENV: served.worker_token}
        self.exited = threading.Event()
        self.worker = self._start(served.worker)
        self.scheduler: subprocess.Popen[bytes] | None = None

    def start_scheduler(self) -> None:
        self.scheduler = self._start(self.plan.scheduler)

    def worker_listens(self) -> bool:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            return s.connect_ex(("127.0.0.1", self.plan.worker_port)) == 0

    def _start(self, args: tuple[str, ...]) -> subprocess.Popen[bytes]:
        proc = _start(args, self._env)
        threading.Thread(target=self._watch, args=(proc,), daemon=True).start()
        return proc

    def _watch(self, proc: subprocess.Popen[bytes]) -> None:
        proc.wait()
        self.exited.set()

    def stop(self) -> None:
        for proc in (self.scheduler, self.worker):
            if proc is not None:
                _stop(proc, self.plan.grace_s + STOP_MARGIN_S)

    def status(self) -> int:
        """0 when both ended cleanly, else the first nonzero exit status (128 + N for signal N)."""
        for proc in (self.scheduler, self.worker):
            code = None if proc is None else proc.poll()
            if code:
                return code if code > 0 else 128 - code
        return 0


def _start(args: tuple[str, ...], env: dict[str, str]) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-c", DIE_WITH_PARENT_THEN_EXEC, str(os.getpid()), sys.executable, *args]
    # Their own process group: a terminal's Ctrl-C reaches this command only, which then stops
    # the scheduler before the worker (a worker gone first would fail the requests draining).
    return subprocess.Popen(command, env=env, start_new_session=True)


def _stop(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def banner(served: ServePlan) -> str:
    host = "127.0.0.1" if served.host in ("0.0.0.0", "::") else served.host
    return (
        f"\n  Stepahead is starting ({served.worker[3]}). Once it listens:\n"
        f"    OpenAI-compatible API  http://{host}:{served.http_port}/v1\n"
        f"    gRPC Generation API    {host}:{served.grpc_port}\n"
        f"  e.g. curl -s http://{host}:{served.http_port}/v1/chat/completions "
        "-H 'Content-Type: application/json' \\\n"
        '      -d \'{"model": "'
        + served.worker[3]
        + '", "messages": [{"role": "user", "content": "Hello!"}]}\'\n'
        "  Ctrl-C stops it.\n"
    )


def main(argv: Sequence[str] | None = None) -> None:
    run_dir = Path(tempfile.mkdtemp(prefix="stepahead-"))  # mode 0700: this user's only
    try:
        _serve(plan(sys.argv[1:] if argv is None else argv, run_dir))
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _serve(served: ServePlan) -> None:
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(banner(served), file=sys.stderr, flush=True)
    pair = Pair(served)
    while not (stop.is_set() or pair.exited.is_set() or pair.worker_listens()):
        time.sleep(0.1)
    if not (stop.is_set() or pair.exited.is_set()):
        pair.start_scheduler()
    while not (stop.is_set() or pair.exited.is_set()):
        time.sleep(0.1)
    pair.stop()
    code = pair.status()
    sys.exit(code if code or stop.is_set() else 1)  # a service that ended on its own is a failure
