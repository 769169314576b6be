"""Prometheus plumbing both services share: constant labels and the HTTP endpoint."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector


class ConstLabels(Collector):
    """Adds a service's constant labels to every sample of another collector."""

    def __init__(self, inner: Collector, labels: dict[str, str]) -> None:
        self._inner = inner
        self._labels = labels

    def collect(self) -> Iterator[Metric]:
        for family in self._inner.collect():
            labeled = Metric(family.name, family.documentation, family.type, family.unit)
            for s in family.samples:
                labeled.add_sample(s.name, {**s.labels, **self._labels}, s.value, s.timestamp, s.exemplar)
            yield labeled


def new_registry(const_labels: dict[str, str]) -> CollectorRegistry:
    """A registry with process metrics (CPU, memory) under the service's labels."""
    registry = CollectorRegistry()
    registry.register(ConstLabels(ProcessCollector(registry=None), const_labels))
    return registry


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> int:
    """Serve /metrics in a background thread; returns the bound port."""
    server, _ = start_http_server(port, addr=host, registry=registry)
    return int(server.server_port)
