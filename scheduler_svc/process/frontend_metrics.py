"""The frontends' metrics on the core's /metrics endpoint: each frontend process's exposition,
parsed and summed as one service's."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

MetricSource = Callable[[], list[Iterable[Metric]]]


class FrontendMetrics(Collector):
    """The frontends' metrics summed over every frontend, as one service's: counters and
    histogram buckets add up; `_created` samples are left out."""

    def __init__(self, sources: MetricSource) -> None:
        self._sources = sources

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        totals: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
        for source in self._sources():
            for family in source:
                merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                samples = totals.setdefault(family.name, {})
                for s in family.samples:
                    if not s.name.endswith("_created"):
                        key = (s.name, tuple(sorted(s.labels.items())))
                        samples[key] = samples.get(key, 0.0) + s.value
        for name, family in merged.items():
            for (sample, labels), value in totals[name].items():
                family.add_sample(sample, dict(labels), value)
            yield family


def parse_exposition(text: bytes) -> list[Metric]:
    return list(text_string_to_metric_families(text.decode()))
