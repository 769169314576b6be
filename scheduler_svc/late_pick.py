"""When the overlap loop picks batch k+1: as late as the device allows.

Picked right after batch k-1 is processed, batch k+1 is fixed at the start of
forward k, so every request arriving during forward k waits for k+2: one step
more time to first token than in the serial loop, which picks after forward k.
Picking k+1 shortly before forward k is expected to end lets those arrivals
ride in k+1. A pick that wakes too late leaves the device idle, and on a busy
event loop wake-ups are late by up to milliseconds, so the margin before the
expected end is steered to an idle budget: it widens while late picks cost
the device more than `idle_budget` of its time, and narrows while they cost less.
"""

from __future__ import annotations

from dataclasses import dataclass

from stepahead.protocol import StepResult


@dataclass(frozen=True)
class LatePickConfig:
    enabled: bool = False
    idle_budget: float = 0.01  # device idle caused by late picks, as a fraction of device time
    initial_margin_s: float = 0.003
    min_margin_s: float = 0.0005
    max_margin_fraction: float = 0.5  # of a step: beyond that, picking late gains little
    smoothing: float = 0.2  # weight of the newest step in the step-time and idle estimates


class LatePick:
    def __init__(self, config: LatePickConfig) -> None:
        self.config = config
        self.margin_s = config.initial_margin_s
        self._decode_step_s: float | None = None
        self._last_forward_end: float | None = None  # worker clock
        self._picked_late: dict[int, bool] = {}  # by step id, until its result is seen
        self._idle_share = 0.0  # recent device idle per late-picked step, as a share of the step

    def observe(self, forward_mode: str, result: StepResult) -> None:
        """Learn from a processed batch's device timing (in the worker's clock)."""
        if result.forward_end <= 0:  # no timing reported
            return
        gap = result.forward_start - self._last_forward_end if self._last_forward_end else 0.0
        if self._picked_late.pop(result.step_id, False):
            self._steer_margin(max(gap, 0.0) / max(result.forward_seconds, 1e-6))
        self._last_forward_end = result.forward_end
        if forward_mode == "decode":
            self._learn_step_time(result.forward_seconds)

    def delay(self, in_flight_mode: str, worker_now: float, next_step_id: int) -> float:
        """Seconds to wait before picking step `next_step_id` while a batch of
        `in_flight_mode` runs.

        NOTE: only a decode batch's time is predictable enough; it started when
        its predecessor, the batch just processed, ended.
        """
        step, started = self._decode_step_s, self._last_forward_end
        if not self.config.enabled or in_flight_mode != "decode" or step is None or started is None:
            return 0.0
        expected_end = started + step
        wait = expected_end - self.margin_s - worker_now
        self._picked_late[next_step_id] = wait > 0
        return max(wait, 0.0)

    def _learn_step_time(self, seconds: float) -> None:
        a = self.config.smoothing
        self._decode_step_s = (
            seconds if self._decode_step_s is None else (1 - a) * self._decode_step_s + a * seconds
        )

    def _steer_margin(self, idle_share: float) -> None:
        c = self.config
        self._idle_share = (1 - c.smoothing) * self._idle_share + c.smoothing * idle_share
        ceiling = max((self._decode_step_s or 0.0) * c.max_margin_fraction, c.min_margin_s)
        factor = 1.1 if self._idle_share > c.idle_budget else 0.98
        self.margin_s = min(max(self.margin_s * factor, c.min_margin_s), ceiling)
