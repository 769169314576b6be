"""The garbage collector in a serving process: start-up's heap frozen, young collections rare.

A service keeps what it loaded at start-up for its whole life (a model's modules, a tokenizer,
gRPC's and protobuf's descriptors, the HTTP stack: 50,000-190,000 tracked objects), and makes
per step and per token many small objects that die young, freed by their reference counts.
CPython's collector runs a young collection every 700 net container allocations and, every so
many of those, one that walks every tracked object, start-up's included: on this project's
machines a frontend spent about a tenth of its CPU per token in collections at concurrency 256,
and a full collection in the worker took 40-60 ms (three in a process's life, start-up's
included), a pause that any stream it lands in sees as one long gap between tokens.

`settle()`, once a process has loaded what it serves and before it serves: one collection of
what start-up left, the survivors frozen (`gc.freeze`: never walked again), and the young
generation's threshold raised to `STEPAHEAD_GC_THRESHOLD` (default `GEN0_THRESHOLD`), so a
collection runs only once that many more containers are alive than were freed. Cycles are
still collected, later. `STEPAHEAD_GC_THRESHOLD=0` leaves the collector as Python sets it.

`GcCollector`: collections and the seconds they took, by generation, and the objects `settle()`
froze, for a service's /metrics. The count is the one `settle()` read: `gc.get_freeze_count()`
walks the whole frozen list (about 16 ms for 400,000 objects), too dear for every scrape, and
in the worker a scrape's thread would hold the interpreter's lock from the forward for that long.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

GC_THRESHOLD_ENV = "STEPAHEAD_GC_THRESHOLD"
GEN0_THRESHOLD = 50_000  # net container allocations between young collections (Python's: 700)
GENERATIONS = (0, 1, 2)
log = logging.getLogger("stepahead.heap")
_frozen = 0  # the objects settle() froze (nothing else in a service freezes or unfreezes)


def threshold() -> int:
    """The young generation's threshold the environment asks for; 0: Python's own settings."""
    raw = os.environ.get(GC_THRESHOLD_ENV, str(GEN0_THRESHOLD))
    try:
        value = int(raw)
    except ValueError:
        raise SystemExit(f"{GC_THRESHOLD_ENV}={raw!r}: expected a whole number (0: Python's own)") from None
    if value < 0:
        raise SystemExit(f"{GC_THRESHOLD_ENV}={raw!r}: expected 0 or more")
    return value


def settle(service: str) -> None:
    """Collects and freezes what start-up left and raises the young generation's threshold, as
    `threshold()` says; logs what it did. Call once, when the process is about to serve."""
    young = threshold()
    if young == 0:
        log.info("%s: garbage collector left as Python sets it (%s=0)", service, GC_THRESHOLD_ENV)
        return
    global _frozen
    gc.collect()
    gc.freeze()
    _frozen = gc.get_freeze_count()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(young, middle, old)
    log.info(
        "%s: %d start-up objects frozen out of garbage collection; a young collection every %d net "
        "allocations",
        service,
        _frozen,
        young,
    )


class _Collections:
    """How many collections this process ran and how long they took, by generation, from one
    `gc.callbacks` hook (installed once a process, by the first `GcCollector`)."""

    def __init__(self) -> None:
        self.counts = dict.fromkeys(GENERATIONS, 0)
        self.seconds = dict.fromkeys(GENERATIONS, 0.0)
        self._started = 0.0
        gc.callbacks.append(self._on_collection)

    def _on_collection(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        generation = int(info["generation"])
        self.counts[generation] += 1
        self.seconds[generation] += time.perf_counter() - self._started


_collections: _Collections | None = None


class GcCollector(Collector):
    """The process's garbage collections since its first `GcCollector` was made, by generation:
    how many and the seconds they took; and how many objects `settle()` froze."""

    def __init__(self) -> None:
        global _collections
        if _collections is None:
            _collections = _Collections()
        self._collections = _collections

    def collect(self) -> Iterator[Metric]:
        counts = CounterMetricFamily(
            "stepahead_gc_collections", "Garbage collections this process ran", labels=["generation"]
        )
        seconds = CounterMetricFamily(
            "stepahead_gc_seconds", "Seconds this process spent in garbage collections", labels=["generation"]
        )
        for generation in GENERATIONS:
            counts.add_metric([str(generation)], self._collections.counts[generation])
            seconds.add_metric([str(generation)], self._collections.seconds[generation])
        yield counts
        yield seconds
        yield GaugeMetricFamily(
            "stepahead_gc_frozen_objects",
            "Objects frozen out of garbage collection",
            value=_frozen,
        )
