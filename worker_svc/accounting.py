"""Per completed step, on the copy thread: the worker's busy and idle time and live slots
(metrics) and the step's trace spans."""

from __future__ import annotations

from stepahead.protocol import Launch
from stepahead.trace import Tracer
from worker_svc.device_streams import StepTiming
from worker_svc.telemetry import WorkerMetrics

__all__ = ["StepAccounting"]


class StepAccounting:
    """Accounts each step as it completes, in launch order."""

    def __init__(self, metrics: WorkerMetrics, tracer: Tracer) -> None:
        self._metrics = metrics
        self._tracer = tracer
        self._last_forward_end: float | None = None
        self._live_after_last_step = False

    def new_session(self) -> None:
        """No request is live when a session begins: the gap before its first forward is not idle."""
        self._live_after_last_step = False

    def account(self, launch: Launch, timing: StepTiming, live_after: int) -> None:
        """Busy time per forward; the gap before it counts as idle if requests
        were live on the worker across it (the scheduler had work in hand)."""
        if self._live_after_last_step and self._last_forward_end is not None:
            gap = max(timing.forward_start - self._last_forward_end, 0.0)
            self._metrics.observe_gap(gap)
        self._last_forward_end = timing.forward_end
        self._live_after_last_step = live_after > 0
        self._metrics.live_slots.set(live_after)
        if not launch.num_rows:  # only released slots: no forward ran
            return
        mode = launch.forward_mode
        self._metrics.observe_forward(mode, timing.forward_seconds, timing.copy_seconds, launch.num_tokens)
        args = {"rows": launch.num_rows, "tokens": launch.num_tokens, "mode": mode}
        self._tracer.span(
            "device", f"forward {launch.step_id}", timing.forward_start, timing.forward_end, args
        )
        self._tracer.span("copy", f"copy {launch.step_id}", timing.forward_end, timing.copy_end)

    def speculated(self, drafts: int, draft_tokens: int, accepted: int) -> None:
        """A step's verify rows: `drafts` of them proposed `draft_tokens` drafts, of which
        `accepted` were accepted (vLLM's meanings)."""
        self._metrics.spec_drafts.inc(drafts)
        self._metrics.spec_draft_tokens.inc(draft_tokens)
        self._metrics.spec_accepted_tokens.inc(accepted)
