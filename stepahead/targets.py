"""Where a client's calls go: one scheduler, or replicas balanced with gRPC's `round_robin`.

A `--server` value is one HOST:PORT (a plain channel, as ever), several comma-separated, or one
gRPC target URI (dns:///NAME:PORT, ipv4:..., ipv6:...); the scheduler's CLI client and loadgen's
gRPC backend both open their channels here.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from stepahead.protocol import NO_BDP_PROBE

# NOTE: these resolvers can name several addresses, so a target using one gets round_robin;
# any other target keeps gRPC's default (pick_first), as a single scheduler always had.
RESOLVER_SCHEMES = ("dns:", "ipv4:", "ipv6:")
SERVICE_CONFIG = "grpc.service_config"
# NOTE: round_robin skips an address whose health service (grpc.health.v1) reports this service
# NOT_SERVING: a scheduler does while it has no worker session (its worker died or restarts), so
# new calls go to the replicas that can run them; calls it already accepted wait for its worker.
# When every replica is NOT_SERVING, a call fails at once with UNAVAILABLE.
HEALTH_CHECKED_SERVICE = "stepahead.v1.Generation"
ROUND_ROBIN = json.dumps(
    {
        "loadBalancingConfig": [{"round_robin": {}}],
        "healthCheckConfig": {"serviceName": HEALTH_CHECKED_SERVICE},
    }
)
ChannelOptions = tuple[tuple[str, str | int], ...]


@dataclass(frozen=True)
class ChannelTarget:
    """What a gRPC channel is opened with: its target string and the options it needs."""

    target: str
    options: ChannelOptions = ()


def split_servers(value: str) -> list[str]:
    """A `--server` value as a list: comma-separated HOST:PORTs, or one target URI taken whole
    (an ipv4: or ipv6: URI lists its addresses with commas itself). ValueError when one is empty,
    or for a dns: URI naming several hosts."""
    if value.startswith("dns:") and "," in value:
        raise ValueError(f"{value!r}: a dns: target names one host (list HOST:PORTs instead)")
    if value.startswith(RESOLVER_SCHEMES):
        return [value]
    servers = [part.strip() for part in value.split(",")]
    if not all(servers):
        raise ValueError(f"empty address in {value!r}: give HOST:PORT[,HOST:PORT...]")
    return servers


def channel_target(servers: Sequence[str]) -> ChannelTarget:
    """One HOST:PORT: the channel as ever (one scheduler). A target URI, or several HOST:PORTs:
    round_robin over every address, so that consecutive calls go to the next replica. The names
    of a list are resolved here, once (gRPC's ipv4:/ipv6: lists take addresses only); use
    dns:///NAME:PORT for a name gRPC should re-resolve. ValueError for a name that resolves to
    nothing usable."""
    if len(servers) == 1 and not servers[0].startswith(RESOLVER_SCHEMES):
        return ChannelTarget(servers[0])
    if len(servers) == 1:
        return ChannelTarget(servers[0], ((SERVICE_CONFIG, ROUND_ROBIN),))
    # NOTE: the authority (the :authority header, and the name TLS checks the certificates
    # against) would otherwise be the whole address list; the first server names them all.
    return ChannelTarget(
        address_list(servers), ((SERVICE_CONFIG, ROUND_ROBIN), ("grpc.default_authority", servers[0]))
    )


def address_list(servers: Sequence[str]) -> str:
    """An `ipv4:` target listing every address of the servers (`ipv6:` if one has no IPv4 one)."""
    parsed = [host_port(server) for server in servers]  # every one checked before any lookup
    resolved = [resolve(host, port) for host, port in parsed]
    for family, scheme in ((socket.AF_INET, "ipv4"), (socket.AF_INET6, "ipv6")):
        if all(addresses.get(family) for addresses in resolved):
            listed = (address for addresses in resolved for address in addresses[family])
            return f"{scheme}:{','.join(dict.fromkeys(listed))}"
    raise ValueError(f"{', '.join(servers)}: one gRPC address list cannot mix IPv4 and IPv6 servers")


def host_port(server: str) -> tuple[str, int]:
    """HOST:PORT or [IPV6]:PORT split; ValueError for anything else."""
    host, sep, port = server.rpartition(":")
    if not sep or not host or not port.isdigit() or server.startswith(RESOLVER_SCHEMES):
        raise ValueError(f"{server!r} is not HOST:PORT (a target URI goes alone)")
    return host.removeprefix("[").removesuffix("]"), int(port)


def resolve(host: str, port: int) -> dict[int, list[str]]:
    """The host's addresses by family, each with the port as an ipv4:/ipv6: target lists it."""
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise ValueError(f"cannot resolve {host}: {exc}") from exc
    addresses: dict[int, list[str]] = {}
    for family, _, _, _, sockaddr in found:
        ip = str(sockaddr[0])
        listed = f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"
        addresses.setdefault(family, []).append(listed)
    return addresses


def open_target(
    servers: Sequence[str],
    credentials: grpc.ChannelCredentials | None = None,
    options: ChannelOptions = (),
) -> grpc.aio.Channel:
    """A channel to one scheduler or round robin over replicas (`channel_target`), over TLS with
    `credentials`; `options` are added to the target's."""
    target = channel_target(servers)
    every = [*target.options, NO_BDP_PROBE, *options]
    if credentials is None:
        return grpc.aio.insecure_channel(target.target, options=every)
    return grpc.aio.secure_channel(target.target, credentials, options=every)
