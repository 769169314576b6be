"""How many launched batches the overlap loop keeps ahead of the one it processes.

At depth D the loop processes batch k once batches k+1 .. k+D are launched, so while it waits
for k's result, applies it and launches k+D+1, the worker still has D batches to run. The
device stays busy while

    link round trip + the scheduler's CPU work between a result and the next launch
        <= D x device step,

so D = 1 (one step ahead, the seed's loop) holds on a fast link; a link of one-way delay d
needs D >= (2d + CPU) / step. `--overlap-depth auto` measures the three terms, steadily, and
picks the smallest D that holds with a margin: deeper costs the tokens sampled after an
EOS or stop (up to D - 1 more per finish, never streamed) and holds finished requests' slots
a little longer, nothing else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_DEPTH = 8
AUTO = 0  # `--overlap-depth auto`


@dataclass(frozen=True)
class DepthConfig:
    depth: int = 1  # launched batches ahead of the one processed; AUTO: chosen from measurements
    max_depth: int = MAX_DEPTH  # auto never goes beyond
    margin: float = 1.25  # auto: the round trip and the CPU work may grow by this much
    smoothing: float = 0.1  # auto: weight of each new measurement in the running averages
    hold_steps: int = 50  # auto: a shallower depth must be enough this many steps running

    @property
    def auto(self) -> bool:
        return self.depth == AUTO


def parse_depth(value: str) -> int:
    """`--overlap-depth`: 1 .. MAX_DEPTH, or `auto` (AUTO)."""
    if value == "auto":
        return AUTO
    try:
        depth = int(value)
    except ValueError:
        raise ValueError(f"expected an integer or 'auto', got {value!r}") from None
    if not 1 <= depth <= MAX_DEPTH:
        raise ValueError(f"must be 1..{MAX_DEPTH} or 'auto', got {depth}")
    return depth


class Average:
    """An exponentially weighted running mean; None until the first sample."""

    def __init__(self, weight: float) -> None:
        self._weight = weight
        self.value: float | None = None

    def add(self, sample: float) -> None:
        self.value = sample if self.value is None else self.value + self._weight * (sample - self.value)


class OverlapDepth:
    """The loop's depth: the configured one, or with `auto` the one the measurements call for."""

    def __init__(self, config: DepthConfig) -> None:
        self.config = config
        self.current = 1 if config.auto else config.depth
        self.link_rtt = Average(config.smoothing)
        self.cpu = Average(config.smoothing)
        self.step = Average(config.smoothing)
        self._enough_for = 0  # steps running that a shallower depth would have held

    def observe(self, link_rtt_s: float | None, cpu_s: float, step_s: float) -> None:
        """One processed step: its link round trip (None: unknown), the scheduler's time from
        its result to the next launch, and its device time."""
        if link_rtt_s is not None:
            self.link_rtt.add(link_rtt_s)
        self.cpu.add(cpu_s)
        if step_s > 0:
            self.step.add(step_s)
        if self.config.auto:
            self._adjust(self.needed())

    def needed(self) -> int:
        """The smallest depth that keeps the device busy, with the margin; 1 until measured."""
        rtt, cpu, step = self.link_rtt.value or 0.0, self.cpu.value, self.step.value
        if cpu is None or not step:
            return 1
        depth = math.ceil((rtt + cpu) * self.config.margin / step)
        return max(1, min(depth, self.config.max_depth))

    def _adjust(self, needed: int) -> None:
        """Deeper at once (the device would wait); shallower only once it has held a while."""
        if needed >= self.current:
            self.current, self._enough_for = needed, 0
            return
        self._enough_for += 1
        if self._enough_for >= self.config.hold_steps:
            self.current, self._enough_for = self.current - 1, 0
