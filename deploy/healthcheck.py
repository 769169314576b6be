"""gRPC health check for the Stepahead containers: exit 0 iff HOST:PORT reports SERVING.

    python deploy/healthcheck.py HOST:PORT [--service NAME] [--timeout SECONDS]
        [--tls-ca PEM [--tls-cert PEM --tls-key PEM] [--server-name NAME]]

Asks grpc.health.v1.Health/Check (the overall status, service "", by default), so no
grpc_health_probe binary is needed in the image. A service that serves TLS is asked over TLS:
`--tls-ca` is the CA its certificate is checked against, `--tls-cert`/`--tls-key` a client
certificate where it requires one (the worker always does: its link is mutual TLS), and
`--server-name` the name its certificate carries when HOST is not it (a probe asks 127.0.0.1).
Exit codes: 0 SERVING, 1 anything else (NOT_SERVING, unreachable, timeout, TLS refused, error).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


@dataclass(frozen=True)
class Tls:
    ca: bytes
    cert: bytes | None = None
    key: bytes | None = None
    server_name: str | None = None

    def channel(self, address: str) -> grpc.Channel:
        credentials = grpc.ssl_channel_credentials(self.ca, self.key, self.cert)
        options = [] if self.server_name is None else [("grpc.ssl_target_name_override", self.server_name)]
        return grpc.secure_channel(address, credentials, options)


def check(address: str, service: str = "", timeout_s: float = 3.0, tls: Tls | None = None) -> str:
    """The status name the server reports, or why there is none."""
    with grpc.insecure_channel(address) if tls is None else tls.channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(  # type: ignore[attr-defined]
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python deploy/healthcheck.py",
        description="Exit 0 iff HOST:PORT reports SERVING on grpc.health.v1.Health.",
    )
    p.add_argument("address", help="HOST:PORT of a worker or a scheduler")
    p.add_argument("--service", default="", help="service name to ask about ('' is the whole server)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    p.add_argument("--tls-ca", type=Path, metavar="PEM", help="ask over TLS, trusting this CA")
    p.add_argument("--tls-cert", type=Path, metavar="PEM", help="client certificate (a worker needs one)")
    p.add_argument("--tls-key", type=Path, metavar="PEM", help="private key of --tls-cert")
    p.add_argument("--server-name", help="the name the service's certificate carries, when not HOST")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if (args.tls_cert is None) != (args.tls_key is None):
        p.error("--tls-cert and --tls-key go together")
    if args.tls_ca is None and (args.tls_cert is not None or args.server_name is not None):
        p.error("--tls-cert and --server-name need --tls-ca")
    tls = None
    if args.tls_ca is not None:
        tls = Tls(
            args.tls_ca.read_bytes(),
            None if args.tls_cert is None else args.tls_cert.read_bytes(),
            None if args.tls_key is None else args.tls_key.read_bytes(),
            args.server_name,
        )
    status = check(args.address, args.service, args.timeout, tls)
    print(f"{args.address}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
