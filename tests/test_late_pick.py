"""LatePick: when the overlap loop picks k+1, and how its margin is steered."""

from __future__ import annotations

from scheduler_svc.late_pick import LatePick, LatePickConfig
from stepahead.protocol import StepResult

STEP = 0.010


def decode_result(step_id: int, start: float) -> StepResult:
    return StepResult(step_id, [], forward_start=start, forward_end=start + STEP)


def test_waits_until_margin_before_the_in_flight_forward_ends() -> None:
    late = LatePick(LatePickConfig(enabled=True, initial_margin_s=0.002))
    late.observe("decode", decode_result(1, 100.0))  # ended at 100.010: step 2 runs since then
    delay = late.delay("decode", worker_now=100.011, next_step_id=3)
    assert abs(delay - (100.010 + STEP - 0.002 - 100.011)) < 1e-9


def test_no_wait_when_disabled_unpredictable_or_already_late() -> None:
    late = LatePick(LatePickConfig(enabled=True))
    assert late.delay("decode", 0.0, 2) == 0.0  # no step time learned yet
    late.observe("decode", decode_result(1, 100.0))
    assert late.delay("mixed", 100.011, 3) == 0.0  # a prefill's time is not predictable
    assert late.delay("decode", 100.019, 3) == 0.0  # past the deadline
    off = LatePick(LatePickConfig(enabled=False))
    off.observe("decode", decode_result(1, 100.0))
    assert off.delay("decode", 100.011, 3) == 0.0


def run_steps(late: LatePick, gap_after_late_pick: float, steps: int) -> None:
    """Steps that each pick late, and each leave the device `gap` idle."""
    start = 0.0
    for step in range(1, steps + 1):
        late.observe("decode", decode_result(step, start))
        late.delay("decode", start + STEP + 0.001, step + 2)
        start += STEP + gap_after_late_pick


def test_margin_widens_while_late_picks_idle_the_device_beyond_the_budget() -> None:
    late = LatePick(LatePickConfig(enabled=True, idle_budget=0.01, initial_margin_s=0.001))
    run_steps(late, gap_after_late_pick=0.002, steps=60)
    assert abs(late.margin_s - STEP * late.config.max_margin_fraction) < 1e-9


def test_margin_narrows_while_late_picks_cost_nothing() -> None:
    late = LatePick(LatePickConfig(enabled=True, initial_margin_s=0.004, min_margin_s=0.0005))
    run_steps(late, gap_after_late_pick=0.0, steps=300)
    assert late.margin_s == late.config.min_margin_s
