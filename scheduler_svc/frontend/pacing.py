"""How often a frontend wakes its clients' streams: every step while it keeps up, every few steps
once it falls behind.

A client's message costs the frontend (and the client) far more than a token does: gRPC's and
HTTP's per-message work is most of a frontend's CPU per token at one token a message. A frontend
that keeps up sends every token at once. One that falls behind (its event loop runs late: the
lag of a timer it sets itself) wakes a stream only every `factor` steps, so the tokens of those
steps merge into one message and messages per second stop growing with the token rate; it
halves the factor again once it has kept up for a while. A request's first token and its finish
are never held, and nothing is held longer than MAX_HOLD_S.

Only a frontend with many messages to send coalesces: below MIN_MESSAGES_PER_S due wakes a
second (a few clients, or slow steps), merging would save little CPU, and a loop that runs
late there is late for another reason (the model's forward taking the machine's cores), so
every token is sent at once whatever the lag. A held stream whose reader took its
tokens meanwhile (woken in an earlier step, read late) is not woken for what came since.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Protocol

PROBE_S = 0.02  # the lag probe's period
BEHIND_S = 0.004  # a smoothed lag above this: behind, coalesce more
CAUGHT_UP_S = 0.001  # below this for CALM_PROBES probes in a row: coalesce less
CALM_PROBES = 10
SMOOTHING = 0.3  # weight of the newest probe in the smoothed lag
MAX_FACTOR = 16  # steps whose tokens one message may carry
MAX_HOLD_S = 0.2  # a held stream is woken after this, steps or not
# Below this many due wakes a second (smoothed), nothing is held: at ~50 µs a message, 1,000 a
# second cost a frontend 5% of a core.
MIN_MESSAGES_PER_S = 1000.0


class Wakeable(Protocol):
    ready: asyncio.Event

    @property
    def due(self) -> bool:
        """Whether it still has a message's worth of news (its reader may have taken it while
        it was held)."""
        ...


class StreamPacer:
    """`release(streams)` once a step: the streams with tokens due are woken now, or held until
    every `factor`-th step."""

    def __init__(self, on_hold: Callable[[], None] = lambda: None) -> None:
        self._on_hold = on_hold  # counts a step whose due streams were held
        self.factor = 1
        self.lag_s = 0.0  # smoothed
        self.due_per_s = 0.0  # streams due a wake per second, held or not (smoothed)
        self._due_count = 0  # since the last probe
        self._held: set[Wakeable] = set()
        self._steps = 0
        self._calm = 0
        self._probe: asyncio.TimerHandle | None = None
        self._flush: asyncio.TimerHandle | None = None

    def release(self, streams: Sequence[Wakeable]) -> None:
        self._steps += 1
        self._due_count += len(streams)
        if self.factor == 1 and not self._held:
            for stream in streams:
                stream.ready.set()
            return
        self._held.update(streams)
        if self._steps % self.factor == 0:
            self.flush()
            return
        self._on_hold()
        if self._held and self._flush is None:
            self._flush = asyncio.get_running_loop().call_later(MAX_HOLD_S, self.flush)

    def flush(self) -> None:
        for stream in self._held:
            if stream.due:
                stream.ready.set()
        self._held.clear()
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None

    def watch(self) -> None:
        """Start probing the event loop's lag (a timer that re-arms itself), if not already."""
        if self._probe is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # driven by hand, without a loop: nothing to probe
                return
            self._due_count = 0
            self._probe = loop.call_later(PROBE_S, self._on_probe, time.perf_counter() + PROBE_S)

    def stop(self) -> None:
        """No more probes (the frontend has no streams left); held streams are woken."""
        if self._probe is not None:
            self._probe.cancel()
            self._probe = None
        self.flush()
        self.factor, self.lag_s, self.due_per_s, self._calm = 1, 0.0, 0.0, 0

    def _on_probe(self, due: float) -> None:
        """Lag in wall-clock time, not the loop's: uvloop's clock counts whole milliseconds, read
        once per loop turn (a timer may fire up to that much early, hence the floor at 0)."""
        now = time.perf_counter()
        elapsed = now - (due - PROBE_S)
        self.observe(max(0.0, now - due), self._due_count / elapsed)
        self._due_count = 0
        self._probe = asyncio.get_running_loop().call_later(PROBE_S, self._on_probe, now + PROBE_S)

    def observe(self, lag_s: float, due_per_s: float) -> None:
        """One probe's lag and rate of due wakes since the last: the factor doubles while
        behind, halves after a calm spell, and is 1 while few messages are due."""
        self.lag_s += SMOOTHING * (lag_s - self.lag_s)
        self.due_per_s += SMOOTHING * (due_per_s - self.due_per_s)
        if self.due_per_s < MIN_MESSAGES_PER_S:
            if self.factor > 1:
                self.factor, self._calm = 1, 0
                self.flush()
            return
        if self.lag_s > BEHIND_S:
            self.factor = min(self.factor * 2, MAX_FACTOR)
            self._calm = 0
        elif self.lag_s < CAUGHT_UP_S:
            self._calm += 1
            if self._calm >= CALM_PROBES and self.factor > 1:
                self.factor //= 2
                self._calm = 0
        else:
            self._calm = 0
