"""The frontends' metrics on the core's /metrics endpoint: each frontend process's exposition,
parsed and summed as one service's."""

from __future__ import annotations

import logging
import urllib.request
from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

MetricSource = Callable[[], list[Iterable[Metric]]]
REMOTE_TIMEOUT_S = 2.0  # a scrape waits this long for the worker's exposition at most

log = logging.getLogger("stepahead.metrics")


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


class Merged(Collector):
    """Several collectors' families as one exposition: families of one name and type (both
    services' process metrics, say) become one family holding every sample (their labels tell
    them apart). A later family whose name an earlier one of another type holds is left out (a
    name has one type in an exposition): the worker's `stepahead_batch_tokens` counter beside
    the scheduler's histogram of that name; the worker's own endpoint still serves it."""

    def __init__(self, *collectors: Collector) -> None:
        self._collectors = collectors
        self._clashes: set[str] = set()

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for collector in self._collectors:
            for family in collector.collect():
                kept = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                if kept.type != family.type:
                    if family.name not in self._clashes:
                        self._clashes.add(family.name)
                        log.warning(
                            "metrics: %s is a %s here and a %s there: left out",
                            family.name,
                            kept.type,
                            family.type,
                        )
                    continue
                kept.samples += family.samples
        yield from merged.values()


class RemoteExposition(Collector):
    """Another process's exposition, fetched over HTTP at each collection; nothing (and a
    warning) when it does not answer in time."""

    def __init__(self, url: str, timeout_s: float = REMOTE_TIMEOUT_S) -> None:
        self._url, self._timeout_s = url, timeout_s

    def collect(self) -> Iterator[Metric]:
        try:
            with urllib.request.urlopen(self._url, timeout=self._timeout_s) as reply:
                text = reply.read()
        except OSError as exc:
            log.warning("no metrics from %s: %s", self._url, exc)
            return
        for family in parse_exposition(text):  # creation times stay the worker's own business
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            if family.samples:
                yield family
