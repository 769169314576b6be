"""When the overlap loop picks batch k+1: as late as the device allows.

Picked right after batch k-1 is processed, batch k+1 is fixed at the start of
forward k, so every request arriving during forward k waits for k+2: one step
more time to first token than in the serial loop, which picks after forward k.
Picking k+1 shortly before forward k is expected to end lets those arrivals
ride in k+1. A pick that wakes too late leaves the device idle, and on a busy
event loop wake-ups are late by up to milliseconds, so the margin before the
expected end is steered to an idle budget: over each window of late-picked
steps it widens if they left the device idle more than `idle_budget` of the
time, and narrows if far less. At a whole step wide, the pick is as early as
without it: the loop falls back to eager picking when wake-ups are that late.
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
    max_margin_fraction: float = 1.0  # of a step: at a whole step, the pick is as early as without
    window_steps: int = 32  # late-picked steps between two margin adjustments


class StepTimeModel:
    """A step's device time as `fixed + per_token x tokens`, fit on recent steps
    (least squares with exponential forgetting).

    NOTE: predictions are clamped to the range of times seen, so a batch larger
    than any before is predicted short: the pick comes early, never late.
    """

    def __init__(self, forgetting: float = 0.95) -> None:
        self._forgetting = forgetting
        self._n = self._sx = self._sy = self._sxx = self._sxy = 0.0
        self._shortest = float("inf")
        self._longest = 0.0
        self._seen = 0

    def observe(self, tokens: int, seconds: float) -> None:
        f = self._forgetting
        self._n = f * self._n + 1
        self._sx = f * self._sx + tokens
        self._sy = f * self._sy + seconds
        self._sxx = f * self._sxx + tokens * tokens
        self._sxy = f * self._sxy + tokens * seconds
        self._shortest = min(self._shortest, seconds)
        self._longest = max(self._longest, seconds)
        self._seen += 1

    def predict(self, tokens: int) -> float | None:
        if self._seen < 3:
            return None
        spread = self._n * self._sxx - self._sx * self._sx
        per_token = (self._n * self._sxy - self._sx * self._sy) / spread if spread > 1e-9 else 0.0
        per_token = max(per_token, 0.0)
        fixed = (self._sy - per_token * self._sx) / self._n
        return min(max(fixed + per_token * tokens, self._shortest), self._longest)


class LatePick:
    def __init__(self, config: LatePickConfig) -> None:
        self.config = config
        self.margin_s = config.initial_margin_s
        self._step_time = StepTimeModel()
        self._last_forward_end: float | None = None  # worker clock
        self._picked_late: dict[int, bool] = {}  # by step id, until its result is seen
        self.late_picks = 0  # picks held back so far
        self._window = (0, 0.0, 0.0)  # late-picked steps, their device gaps, their forward time

    def observe(self, num_tokens: int, result: StepResult) -> None:
        """Learn from a processed batch's device timing (in the worker's clock)."""
        if result.forward_end <= 0:  # no timing reported
            return
        gap = result.forward_start - self._last_forward_end if self._last_forward_end else 0.0
        if self._picked_late.pop(result.step_id, False):
            self._note_late_picked_step(max(gap, 0.0), result.forward_seconds)
        self._last_forward_end = result.forward_end
        if num_tokens:  # a launch that only released slots ran no forward
            self._step_time.observe(num_tokens, result.forward_seconds)

    def delay(self, in_flight_tokens: int, worker_now: float, next_step_id: int) -> float:
        """Seconds to wait before picking step `next_step_id` while a batch of
        `in_flight_tokens` tokens runs.

        NOTE: the in-flight batch started no later than when its predecessor,
        the batch just processed, ended; if it started later, the pick comes
        early, which costs time to first token, never device time.
        """
        step, started = self._step_time.predict(in_flight_tokens), self._last_forward_end
        if not self.config.enabled or step is None or started is None:
            return 0.0
        # Never longer than a step: a clock offset gone wrong must not stall the loop.
        wait = min(started + step - self.margin_s - worker_now, step)
        self._picked_late[next_step_id] = wait > 0
        self.late_picks += wait > 0
        return max(wait, 0.0)

    def _note_late_picked_step(self, gap: float, forward_seconds: float) -> None:
        steps, gaps, forwards = self._window
        self._window = (steps + 1, gaps + gap, forwards + forward_seconds)
        if steps + 1 >= self.config.window_steps:
            self._steer_margin(idle_share=(gaps + gap) / max(forwards + forward_seconds, 1e-9))
            self._window = (0, 0.0, 0.0)

    def _steer_margin(self, idle_share: float) -> None:
        c = self.config
        ceiling = max((self._step_time.predict(0) or 0.0) * c.max_margin_fraction, c.min_margin_s)
        if idle_share > c.idle_budget:
            self.margin_s = min(self.margin_s * 1.5 + c.min_margin_s, ceiling)
        elif idle_share < c.idle_budget / 4:
            self.margin_s = max(self.margin_s * 0.85, c.min_margin_s)
