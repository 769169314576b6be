"""A worker transport that executes launches on the host, for policy tests.

It keeps the worker's contract: a FutureMap indexed by request slot that
starts unwritten (reading an unwritten entry fails the step), launches in
step order, results in launch order. Tokens follow the sim device's rule, so
`sim_next_token` gives every request's expected output. With `hold=True`,
results resolve only when the test calls `complete_next()`.
"""

from __future__ import annotations

import asyncio
import collections
import time

from stepahead.protocol import Launch, StepResult, TokenizerSpec, WorkerInfo
from worker_svc.backends import sim_next_token


class FakeWorker:
    def __init__(self, kv_slots: int, request_slots: int, hold: bool = False) -> None:
        self.kv_slots = kv_slots
        self.request_slots = request_slots
        self.hold = hold
        self.launches: list[Launch] = []
        self.future_map: dict[int, int] = {}
        self.live_slots: set[int] = set()
        self.info = WorkerInfo(
            "fake", 258, 8192, (257,), 256, kv_slots, request_slots, "host", TokenizerSpec("byte")
        )
        self._held: collections.deque[tuple[asyncio.Future[StepResult], StepResult]] = collections.deque()

    @property
    def last_heard(self) -> float:
        """A host worker in the test's process: never silent."""
        return time.monotonic()

    async def connect(self) -> FakeWorker:
        """The worker is its own (only) session."""
        return self

    async def launch(self, launch: Launch) -> asyncio.Future[StepResult]:
        expected_step = len(self.launches) + 1
        assert launch.step_id == expected_step, f"step {launch.step_id} after {expected_step - 1}"
        self.launches.append(launch)
        result = StepResult(launch.step_id, self._execute(launch), 0.0)
        done: asyncio.Future[StepResult] = asyncio.get_running_loop().create_future()
        if self.hold:
            self._held.append((done, result))
        else:
            done.set_result(result)
        await asyncio.sleep(0)  # a real transport yields to the event loop here
        return done

    def complete_next(self) -> None:
        done, result = self._held.popleft()
        done.set_result(result)

    async def close(self) -> None:
        """Nothing to close."""

    def _execute(self, launch: Launch) -> list[int]:
        for slot in launch.released_slots:
            self.future_map.pop(slot, None)
            self.live_slots.remove(slot)
        for new in launch.new_requests:
            assert new.req_slot not in self.live_slots, f"slot {new.req_slot} registered twice"
            self.live_slots.add(new.req_slot)
        prompt = iter(launch.prompt_ids)
        sampled = []
        for slot, start, n, from_future, sample in launch.rows():
            assert slot in self.live_slots
            ids = [self.future_map[slot]] if from_future else [next(prompt) for _ in range(n)]
            if sample:
                token = sim_next_token(ids[-1], start + n)
                self.future_map[slot] = token
                sampled.append(token)
        assert next(prompt, None) is None, "prompt_ids longer than the rows"
        assert max(launch.kv_slots, default=0) < self.kv_slots
        return sampled
