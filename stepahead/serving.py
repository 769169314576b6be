"""Process plumbing both services share: health, reflection, TLS, signals, graceful stop."""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import math
import os
import signal
import socket
import sys
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from stepahead import event_loop
from stepahead.metrics import serve_metrics

API_KEY_ENV = "STEPAHEAD_API_KEY"  # the scheduler's API key, and what its clients send
log = logging.getLogger("stepahead.serving")

WORKER_TOKEN_ENV = "STEPAHEAD_WORKER_TOKEN"  # the worker link's shared secret, on both services


def add_worker_token_arg(parser: argparse.ArgumentParser, help_text: str) -> None:
    parser.add_argument(
        "--worker-token",
        default=os.environ.get(WORKER_TOKEN_ENV) or None,
        help=f"{help_text} (default: ${WORKER_TOKEN_ENV}, which, unlike the flag, does not show in the "
        "process list)",
    )


def announce(line: str) -> None:
    """A line on stdout that a parent process parses (a service's port, its metrics endpoint),
    written whole in one write.

    NOTE: print() writes the text and its newline apart; with PYTHONUNBUFFERED=1 (as
    `stepahead.processes` starts services) each is its own write to the pipe, and a log line from
    another thread on stderr (the same pipe) could land between them and run into the port."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


async def add_health_and_reflection(server: grpc.aio.Server, service_name: str) -> health.aio.HealthServicer:
    """Health (NOT_SERVING until `set_serving`) and reflection for `service_name`."""
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await set_serving(health_servicer, service_name, False)
    names = (service_name, health.SERVICE_NAME, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    return health_servicer


async def set_serving(health_servicer: health.aio.HealthServicer, service_name: str, serving: bool) -> None:
    """The overall ("") and the service's own status."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", service_name):
        await health_servicer.set(name, status)


def pem_file(path: str) -> bytes:
    """argparse type: the bytes of a PEM file, read once at startup."""
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {exc.strerror}") from exc


def add_tls_server_args(parser: argparse.ArgumentParser, client_ca_help: str) -> None:
    parser.add_argument(
        "--tls-cert", type=pem_file, metavar="PEM", help="serve TLS with this certificate chain (PEM)"
    )
    parser.add_argument("--tls-key", type=pem_file, metavar="PEM", help="private key of --tls-cert (PEM)")
    parser.add_argument("--tls-ca", type=pem_file, metavar="PEM", help=client_ca_help)


def check_tls_server_args(
    parser: argparse.ArgumentParser, args: argparse.Namespace, client_ca_required: bool
) -> None:
    """Exits with a usage error on an incomplete set of --tls-* flags."""
    if (args.tls_cert is None) != (args.tls_key is None):
        parser.error("--tls-cert and --tls-key go together")
    if args.tls_ca is not None and args.tls_cert is None:
        parser.error("--tls-ca needs --tls-cert and --tls-key")
    if client_ca_required and args.tls_cert is not None and args.tls_ca is None:
        parser.error("--tls-ca is required with --tls-cert: only clients with a certificate it signed get in")


@dataclass(frozen=True)
class TlsFiles:
    """PEM bytes read once at start-up: a certificate chain and its key, and a CA (a server's:
    the one client certificates must be signed by; a client's: the one it trusts)."""

    cert: bytes | None = None
    key: bytes | None = None
    ca: bytes | None = None


def tls_files(args: argparse.Namespace, prefix: str = "tls") -> TlsFiles:
    """The --{prefix}-cert, -key and -ca flags a parser of `add_tls_server_args` read."""
    cert, key, ca = (getattr(args, f"{prefix}_{part}") for part in ("cert", "key", "ca"))
    return TlsFiles(cert, key, ca)


def server_credentials(tls: TlsFiles) -> grpc.ServerCredentials | None:
    """TLS from --tls-cert/--tls-key, or None (plaintext); with --tls-ca every client must
    present a certificate that CA signed (mutual TLS)."""
    if tls.cert is None:
        return None
    assert tls.key is not None  # the flags go together
    return grpc.ssl_server_credentials(
        [(tls.key, tls.cert)],
        root_certificates=tls.ca,
        require_client_auth=tls.ca is not None,
    )


def describe_tls(tls: TlsFiles) -> str:
    if tls.cert is None:
        return "plaintext"
    return "mutual TLS" if tls.ca is not None else "TLS"


class PortInUse(RuntimeError):
    """A port a service must bind is taken; the message names the flag that moves it."""

    @classmethod
    def binding(cls, host: str, port: int, exc: OSError, flag: str) -> PortInUse:
        return cls(f"cannot listen on {host}:{port} ({exc.strerror}): choose another with {flag}")


def address_family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


# NOTE: gRPC servers on Linux set SO_REUSEPORT by default, so a second service on a taken
# port would silently share it. Single servers turn it off; frontends that share the public
# port on purpose (--frontends N) turn it on.
NO_PORT_SHARING = [("grpc.so_reuseport", 0)]
PORT_SHARING = [("grpc.so_reuseport", 1)]


def reserve_shared_port(host: str, port: int, flag: str) -> socket.socket:
    """A port for processes that share it: checked free, then held with SO_REUSEPORT (not
    listening, so it takes no connections) so that only processes of this user can join it."""
    family = address_family(host)
    with socket.socket(family) as probe:
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise PortInUse.binding(host, port, exc, flag) from exc
        port = int(probe.getsockname()[1])
    guard = socket.socket(family)
    guard.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    guard.bind((host, port))
    return guard


def add_port(
    server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None, flag: str = "--port"
) -> int:
    """Binds `address` (plaintext when `credentials` is None); returns the port bound."""
    try:
        if credentials is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, credentials)
    except RuntimeError as exc:
        raise PortInUse(f"cannot listen on {address} (in use?): choose another with {flag}") from exc


def run_service(name: str, main: Coroutine[Any, Any, None]) -> None:
    """run_loop(main); a port in use ends the process with the flag to change (exit code 1)."""
    try:
        run_loop(main)
    except PortInUse as exc:
        sys.exit(f"{name}: {exc}")


def run_loop(main: Coroutine[Any, Any, None]) -> None:
    """`event_loop.run(main)` (uvloop where installed), with running out of file descriptors
    said once a while (see `ResourceErrors`) rather than at every failed accept."""

    async def quiet() -> None:
        asyncio.get_running_loop().set_exception_handler(ResourceErrors())
        log.info("event loop: %s", event_loop.running())
        await main

    event_loop.run(quiet())


class ResourceErrors:
    """An event loop's exception handler: asyncio's own, except for errors of a resource the
    process has run out of (file descriptors, socket buffers), which it reports at every
    failed accept, with a traceback: thousands of lines a second, when the server least
    needs them. Those are logged once per `interval_s`, counted, without the traceback."""

    ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})

    def __init__(self, interval_s: float = 60.0) -> None:
        self._interval_s = interval_s
        self._last = -math.inf
        self._unreported = 0

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        error = context.get("exception")
        if not (isinstance(error, OSError) and error.errno in self.ERRNOS):
            loop.default_exception_handler(context)
            return
        self._unreported += 1
        now = time.monotonic()
        if now - self._last < self._interval_s:
            return
        self._last = now
        log.error(
            "%s: %s (%d times since the last report, which comes at most every %gs); raise the "
            "limit on open files (ulimit -n) or lower the load",
            context.get("message", "out of a resource"),
            error.strerror,
            self._unreported,
            self._interval_s,
        )
        self._unreported = 0


def add_observability_args(parser: argparse.ArgumentParser, default_metrics_port: int) -> None:
    parser.add_argument(
        "--metrics-host", default=MetricsEndpoint.host, help="address of the /metrics endpoint"
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=default_metrics_port,
        help="Prometheus /metrics port (0: any free port, -1: off)",
    )
    parser.add_argument(
        "--trace-file",
        type=Path,
        default=None,
        help="write a Chrome trace-event JSON timeline of every step here",
    )


@dataclass(frozen=True)
class MetricsEndpoint:
    host: str = "127.0.0.1"
    port: int = -1  # 0: any free port, -1: off


def metrics_endpoint(args: argparse.Namespace) -> MetricsEndpoint:
    """The endpoint the flags of `add_observability_args` name."""
    return MetricsEndpoint(args.metrics_host, args.metrics_port)


def start_metrics(registry: CollectorRegistry, endpoint: MetricsEndpoint, service: str) -> None:
    """Serves /metrics on the running event loop (a thread of its own when none runs); the
    port is bound before this returns, so a taken one raises PortInUse at once."""
    if endpoint.port >= 0:
        try:
            port = serve_metrics(registry, endpoint.host, endpoint.port)
        except OSError as exc:
            raise PortInUse(
                f"cannot serve /metrics on {endpoint.host}:{endpoint.port} ({exc.strerror}): "
                "choose another with --metrics-port (0: any free port, -1: off)"
            ) from exc
        announce(f"{service} metrics on http://{endpoint.host}:{port}/metrics")


def stop_event_on_signals() -> asyncio.Event:
    """An event set by the first SIGINT or SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def graceful_stop(
    server: grpc.aio.Server, health_servicer: health.aio.HealthServicer, grace_s: float
) -> None:
    """Health goes NOT_SERVING first, then the server drains for `grace_s`."""
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace_s)
