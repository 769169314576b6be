"""Prometheus text exposition: parse a scrape, subtract two scrapes, read counters and histograms.

A scrape is a mapping from (sample name, labels) to value. Selectors match a subset of the
labels, so a service's constant labels (`mode`, `model`, `device`) never need to be named.
"""

from __future__ import annotations

import math
import urllib.request
from collections import defaultdict
from collections.abc import Mapping, Sequence

from prometheus_client.parser import text_string_to_metric_families

Labels = frozenset[tuple[str, str]]
Samples = Mapping[tuple[str, Labels], float]


def parse(text: str) -> dict[tuple[str, Labels], float]:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


# A hang guard, not an expectation: a scheduler's /metrics waits up to 3 s for its frontend
# processes' metrics (scheduler_svc/process/link.py METRICS_TIMEOUT_S); other scrapes take milliseconds.
SCRAPE_TIMEOUT_S = 60.0


def scrape(url: str, timeout_s: float = SCRAPE_TIMEOUT_S) -> dict[tuple[str, Labels], float]:
    with urllib.request.urlopen(url, timeout=timeout_s) as reply:
        return parse(reply.read().decode())


def delta(before: Samples, after: Samples) -> dict[tuple[str, Labels], float]:
    """after - before for every sample of `after`; a series absent before counts from 0.
    Meant for counters and histograms of one process (no resets between the scrapes)."""
    return {key: value - before.get(key, 0.0) for key, value in after.items()}


def total(samples: Samples, name: str, **selector: str) -> float:
    """The sum of every `name` sample whose labels include `selector` (0 when none does)."""
    wanted = selector.items()
    return sum(value for (n, labels), value in samples.items() if n == name and wanted <= labels)


def histogram_buckets(samples: Samples, name: str, **selector: str) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of histogram `name`, by increasing bound; series that
    match the selector are added bucket by bucket, as `sum by (le)` would."""
    counts: dict[float, float] = defaultdict(float)
    wanted = selector.items()
    for (n, labels), value in samples.items():
        if n == f"{name}_bucket" and wanted <= labels:
            counts[float(dict(labels)["le"])] += value
    return sorted(counts.items())


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """The q-quantile (0 < q <= 1) of cumulative buckets, as PromQL's `histogram_quantile`:
    linear interpolation inside the bucket holding rank q * count, the first bucket starting
    at 0, and the last finite bound when the rank lands in the +Inf bucket.

    None where PromQL answers NaN: no observation, fewer than two buckets, or no +Inf bucket.
    """
    if not 0 < q <= 1:
        raise ValueError(f"quantile must be in (0, 1], got {q}")
    if len(buckets) < 2 or not math.isinf(buckets[-1][0]):
        return None
    observations = buckets[-1][1]
    if observations <= 0:
        return None
    rank = q * observations
    index = next(i for i, (_, cumulative) in enumerate(buckets) if cumulative >= rank)
    if index == len(buckets) - 1:
        return buckets[-2][0]
    upper, cumulative = buckets[index]
    if index == 0:
        if upper <= 0:
            return upper
        lower, below = 0.0, 0.0
    else:
        lower, below = buckets[index - 1]
    return lower + (upper - lower) * (rank - below) / (cumulative - below)
