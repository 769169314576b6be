"""Histograms written by one event loop, read by scrapes from another thread.

prometheus_client's `Histogram.observe` takes a lock and two value locks per observation: a few
microseconds each, paid per token in a frontend and several times a step in the engine core.
Here an observation is a bisection and two additions, with no lock: only the loop's thread
writes. A scrape reads a copy of the counts and reports their sum as the count, so the `+Inf`
bucket and `_count` always agree (`_sum` may lag them by an observation in progress). The
exposition is prometheus_client's own (`HistogramMetricFamily`).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator
from typing import cast

from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

_le = cast(Callable[[float], str], floatToGoString)  # a bucket bound as Prometheus writes it


class LoopHistogramChild:
    """One label set's counts."""

    def __init__(self, bounds: list[float]) -> None:
        self._bounds = bounds
        self._counts = [0] * (len(bounds) + 1)  # the last one: above every bound
        self._sum = 0.0

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self._bounds, value)] += 1
        self._sum += value

    def observe_many(self, value: float, count: int) -> None:
        """`count` observations of one value (a step's rows that share their last token's time)."""
        self._counts[bisect.bisect_left(self._bounds, value)] += count
        self._sum += value * count

    def snapshot(self) -> tuple[list[tuple[str, float]], float]:
        """Cumulative buckets (`le`, count) and the sum."""
        counts, total = list(self._counts), self._sum
        cumulative, buckets = 0, []
        for bound, count in zip([*self._bounds, float("inf")], counts, strict=True):
            cumulative += count
            buckets.append((_le(bound), float(cumulative)))
        return buckets, total


class LoopHistogram(Collector):
    """A histogram family; `labels(...)` gives a child to observe, as prometheus_client's does."""

    def __init__(
        self, name: str, documentation: str, labelnames: tuple[str, ...], buckets: tuple[float, ...]
    ) -> None:
        self._name = name
        self._documentation = documentation
        self._labelnames = labelnames
        self._bounds = sorted(buckets)
        self._children: dict[tuple[str, ...], LoopHistogramChild] = {}

    def labels(self, *values: str) -> LoopHistogramChild:
        if len(values) != len(self._labelnames):
            raise ValueError(f"{self._name}: labels {self._labelnames}, got {values}")
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = LoopHistogramChild(self._bounds)
        return child

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self._name, self._documentation, labels=list(self._labelnames))
        for values, child in list(self._children.items()):
            buckets, total = child.snapshot()
            family.add_metric(list(values), buckets, total)
        yield family
