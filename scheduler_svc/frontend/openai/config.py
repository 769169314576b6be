"""How much an HTTP client may hold of a frontend: the limits a connection and a request body
are held to (enforced in `limits` and `routes`). No HTTP import here: the scheduler
parses its flags without loading the HTTP stack."""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class HttpLimits:
    max_head_bytes: int = 32 * 1024  # request line and headers together: 431 beyond
    max_headers: int = 100  # header fields: 431 beyond
    # From the connection (or the end of the last response) to a whole request head: 408 beyond
    # (slowloris); an idle kept-alive connection is closed.
    head_timeout_s: float = 10.0
    body_pause_timeout_s: float = 30.0  # a request body that sends nothing this long: 408


def allowed_hosts(text: str) -> tuple[str, ...]:
    """argparse type of --allowed-hosts: comma-separated names, lower-cased; `*` alone is any
    host, `*.example.com` any name under example.com."""
    hosts = tuple(name.strip().lower() for name in text.split(",") if name.strip())
    for name in hosts:
        if "*" in name and name != "*" and not (name.startswith("*.") and "*" not in name[2:]):
            raise argparse.ArgumentTypeError(f"{name!r}: a wildcard is `*` alone or a leading `*.`")
    return hosts


def host_allowed(host_header: str, allowed: tuple[str, ...]) -> bool:
    """Whether a request's Host header (its port aside) names one of `allowed`; () allows any."""
    if not allowed or "*" in allowed:
        return True
    host = host_header.strip().lower()
    if host.startswith("["):  # an IPv6 address, its port after the bracket
        host = host[: host.find("]") + 1]
    else:
        host = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    return any(host == name or (name.startswith("*.") and host.endswith(name[1:])) for name in allowed)
