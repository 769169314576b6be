"""gRPC health check for the Stepahead containers: exit 0 iff HOST:PORT reports SERVING.

    python deploy/healthcheck.py HOST:PORT [--service NAME] [--timeout SECONDS]

Asks grpc.health.v1.Health/Check (the overall status, service "", by default), so no
grpc_health_probe binary is needed in the image. Exit codes: 0 SERVING, 1 anything
else (NOT_SERVING, unreachable, timeout, error).
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str = "", timeout_s: float = 3.0) -> str:
    """The status name the server reports, or why there is none."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(  # type: ignore[attr-defined]
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python deploy/healthcheck.py",
        description="Exit 0 iff HOST:PORT reports SERVING on grpc.health.v1.Health.",
    )
    p.add_argument("address", help="HOST:PORT of a worker or a scheduler")
    p.add_argument("--service", default="", help="service name to ask about ('' is the whole server)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    args = p.parse_args(argv)
    status = check(args.address, args.service, args.timeout)
    print(f"{args.address}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
