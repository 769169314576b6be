"""The worker's session: its ticket, epoch, launch limits and step counters, and the order
check of its launches."""

from __future__ import annotations

import time

from worker_svc.launch_check import LaunchError, LaunchLimits, step_budget

__all__ = ["EngineSession"]


class EngineSession:
    """The live session's state; `reset` starts the next one (on the forward thread)."""

    def __init__(self, kv_slots: int, request_slots: int, max_context_len: int, vocab_size: int) -> None:
        self._sizes = (kv_slots, request_slots, max_context_len, vocab_size)
        # Clock-based, so that a restarted worker's sessions never reuse an epoch.
        self.epoch = time.time_ns() // 1_000_000
        self.last_step_id = 0
        self.steps_executed = 0
        self.out_of_order = 0
        self.limits = self.limits_for(None)
        # The live session's ticket: a launch submitted under another is dropped unrun when its
        # turn comes (written on the caller's thread, read on the forward thread).
        self.ticket = 0

    def limits_for(self, max_batch_tokens: int | None, draft_tokens: int = 0) -> LaunchLimits:
        """What a session announced with `max_batch_tokens` (and `draft_tokens` per verify row
        under speculative decoding) checks launches against; ValueError if it is below 1."""
        kv_slots, request_slots, max_context_len, vocab_size = self._sizes
        budget = step_budget(kv_slots, max_batch_tokens)
        return LaunchLimits(kv_slots, request_slots, max_context_len, vocab_size, budget, draft_tokens)

    def end(self, ticket: int) -> None:
        """The session of `ticket` is over, if it is the live one."""
        if self.ticket == ticket:
            self.ticket += 1

    def check_order(self, step_id: int) -> None:
        if step_id != self.last_step_id + 1:
            self.out_of_order += 1
            raise LaunchError(f"step {step_id} launched after step {self.last_step_id}")
        self.last_step_id = step_id

    def reset(self, limits: LaunchLimits) -> None:
        """The next session: a new epoch, its limits, its counters at 0."""
        self.epoch += 1
        self.limits = limits
        self.last_step_id = 0
        self.steps_executed = 0
        self.out_of_order = 0
