"""The arrival process: when each request is sent, relative to the first one."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import numpy as np


def check_arrival_params(rate: float, burstiness: float) -> None:
    if not rate > 0:
        raise ValueError(f"request rate must be > 0 (inf sends everything at once), got {rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be a finite number > 0, got {burstiness}")


def arrival_intervals(rate: float, burstiness: float, rng: np.random.Generator) -> Iterator[float]:
    """Endless gaps in seconds between consecutive sends.

    Gamma-distributed with shape `burstiness` and mean 1/rate: shape 1 is a Poisson process,
    below 1 burstier, above 1 more regular (coefficient of variation 1/sqrt(shape)).
    An infinite rate gives zero gaps.
    """
    check_arrival_params(rate, burstiness)
    if math.isinf(rate):
        yield from itertools.repeat(0.0)
    scale = 1.0 / (rate * burstiness)
    while True:
        yield float(rng.gamma(burstiness, scale))


def send_offsets(rate: float, burstiness: float, rng: np.random.Generator) -> Iterator[float]:
    """Endless send times in seconds since the first send, which is at 0."""
    offset = 0.0
    for interval in arrival_intervals(rate, burstiness, rng):
        yield offset
        offset += interval
