"""LatePick: when the overlap loop picks k+1, and how its margin is steered."""

from __future__ import annotations

import pytest

from scheduler_svc.engine.late_pick import LatePick, LatePickConfig, StepTimeModel
from stepahead.protocol import StepResult

STEP = 0.010
TOKENS = 64


def result(step_id: int, start: float, seconds: float = STEP) -> StepResult:
    return StepResult(step_id, [], forward_start=start, forward_end=start + seconds)


def warmed(config: LatePickConfig) -> LatePick:
    """Three steps of STEP seconds seen; the last ended at 100.010."""
    late = LatePick(config)
    for step, start in ((1, 99.980), (2, 99.990), (3, 100.0)):
        late.observe(TOKENS, result(step, start))
    return late


def test_waits_until_margin_before_the_in_flight_forward_ends() -> None:
    late = warmed(LatePickConfig(enabled=True, initial_margin_s=0.002))
    delay = late.delay(TOKENS, worker_now=100.011, next_step_id=5)
    assert delay == pytest.approx(100.010 + STEP - 0.002 - 100.011)


def test_no_wait_when_disabled_untrained_or_already_late() -> None:
    assert LatePick(LatePickConfig(enabled=True)).delay(TOKENS, 0.0, 2) == 0.0  # nothing learned
    late = warmed(LatePickConfig(enabled=True))
    assert late.delay(TOKENS, 100.019, 5) == 0.0  # past the deadline
    off = warmed(LatePickConfig(enabled=False))
    assert off.delay(TOKENS, 100.011, 5) == 0.0


def test_step_time_model_fits_fixed_plus_per_token_and_never_extrapolates_up() -> None:
    model = StepTimeModel()
    assert model.predict(10) is None
    for tokens in (10, 100, 300, 10, 100, 300):
        model.observe(tokens, 0.002 + 0.0001 * tokens)
    assert model.predict(200) == pytest.approx(0.022)
    assert model.predict(5000) == pytest.approx(0.032)  # clamped to the longest seen


def run_steps(late: LatePick, gap_after_late_pick: float, steps: int) -> None:
    """Steps that each pick late, and each leave the device `gap` idle."""
    start = 0.0
    for step in range(1, steps + 1):
        late.observe(TOKENS, result(step, start))
        late.delay(TOKENS, start + STEP + 0.001, step + 2)
        start += STEP + gap_after_late_pick


def test_margin_widens_while_late_picks_idle_the_device_beyond_the_budget() -> None:
    late = LatePick(LatePickConfig(enabled=True, idle_budget=0.01, initial_margin_s=0.001))
    run_steps(late, gap_after_late_pick=0.002, steps=400)
    # Grown until the pick is no longer late: within the last ms of the step, ~ eager picking.
    assert late.margin_s > STEP - 0.001


def test_margin_holds_within_a_window() -> None:
    late = LatePick(LatePickConfig(enabled=True, idle_budget=0.01, initial_margin_s=0.001))
    run_steps(late, gap_after_late_pick=0.002, steps=late.config.window_steps)  # one window, not closed
    assert late.margin_s == 0.001


def test_margin_narrows_while_late_picks_cost_nothing() -> None:
    late = LatePick(LatePickConfig(enabled=True, initial_margin_s=0.004, min_margin_s=0.0005))
    run_steps(late, gap_after_late_pick=0.0, steps=600)
    assert late.margin_s == late.config.min_margin_s
