"""After the worker fails a step: which live request makes it fail.

A failed step (`StepError`) names the step, not a row, and ends the worker session: every live
request is then recomputed on the next session (`RunningManager.requeue_all`). A poison request,
one whose rows fail every step they are in (a fault in some path only it takes), would fail the
recompute too, and the next, and stall every other request until `--worker-retry-timeout` ended
them all. The quarantine finds it by halving and ends it alone:

- the live requests of the failed step are the suspects. Only the first half of them, the probe,
  runs; every other live request waits, parked, with those that arrive meanwhile;
- a probe member that emits a token has passed the step that failed (its recompute reaches the
  position that step was computing): it is preempted and parked, so that no later failure can
  name it;
- when every member of the probe has passed or ended, the next half of the suspects is probed;
  with none left the quarantine ends and the parked requests run again, oldest first;
- a failed step of several probe members makes them the suspects (those not probed yet are
  cleared: the fault was among the probe);
- a request that fails a step alone twice (once may be a transient fault) is the poison: it ends
  (`SchedulingPolicy.step_failed`), the other suspects are cleared and the quarantine ends.

A poison request in a failed step of n requests costs at most ceil(log2 n) + 2 failed steps; a
transient fault costs the probes' recomputes and no request. The steps before the first failure
are not slowed: the quarantine acts only while a probe runs.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from scheduler_svc.engine.request import Request
from scheduler_svc.engine.requests import RequestTable

FAILURES_ALONE = 2  # steps a request fails alone before it is taken for the poison


class Quarantine:
    def __init__(self, table: RequestTable, requeue: Callable[[Request], None]) -> None:
        """`requeue`: a running request back to the head of the waiting queue, to be recomputed
        (`RunningManager.requeue_for_recompute`)."""
        self.table = table
        self.requeue = requeue
        self.probe: dict[tuple[str, int], tuple[Request, int]] = {}  # key -> (it, outputs at failure)
        self.suspects: list[Request] = []  # not probed yet, in order
        self.parked: collections.deque[Request] = collections.deque()
        self._alone: dict[tuple[str, int], int] = {}  # steps failed alone, by request key

    @property
    def active(self) -> bool:
        """Whether a probe runs (only its members may be scheduled)."""
        return bool(self.probe)

    def failed(self, members: list[Request]) -> Request | None:
        """The step of `members` (its live requests, in row order) failed; returns the poison
        request when this failure identifies it (it is no longer tracked here)."""
        if not members:
            return None
        if len(members) == 1:
            key = members[0].key
            self._alone[key] = self._alone.get(key, 0) + 1
            if self._alone[key] >= FAILURES_ALONE:
                self._forget_key(key)
                self.probe, self.suspects = {}, []
                self._release()
                return members[0]
        self.probe, self.suspects = {}, list(members)
        self._advance()
        return None

    def hold_back(self) -> None:
        """Before a pick while a probe runs: the waiting requests that are not in it are parked."""
        waiting = self.table.waiting
        if all(self._probed(req) for req in waiting):
            return
        kept = [req for req in waiting if self._probed(req)]
        self.parked.extend(req for req in waiting if not self._probed(req))
        waiting.clear()
        waiting.extend(kept)

    def _probed(self, req: Request) -> bool:
        member = self.probe.get(req.key)
        return member is not None and member[0] is req

    def check(self) -> None:
        """After a step's results are applied: probe members that emitted a token have passed."""
        for key, (req, outputs) in list(self.probe.items()):
            if req.num_known - len(req.prompt_ids) > outputs:
                del self.probe[key]
                if req.req_slot is not None:  # running (a preempted one waits already)
                    self.requeue(req)
                self.table.waiting.remove(req)
                self.parked.append(req)
        self._advance()

    def forget(self, req: Request) -> None:
        """`req` ended (finished, aborted or failed)."""
        if not (self.probe or self.parked or self._alone):
            return
        self._forget_key(req.key)
        if req in self.parked:
            self.parked.remove(req)
        self._advance()

    def clear(self) -> None:
        """Every live request ended (`SchedulingPolicy.fail_all`)."""
        self.probe, self.suspects, self._alone = {}, [], {}
        self.parked.clear()

    def _forget_key(self, key: tuple[str, int]) -> None:
        self.probe.pop(key, None)
        self._alone.pop(key, None)
        self.suspects = [req for req in self.suspects if req.key != key]

    def _advance(self) -> None:
        """An empty probe takes the next half of the suspects; with none left, the end."""
        if self.probe:
            return
        live = self.table.requests
        while not self.probe and self.suspects:
            n = (len(self.suspects) + 1) // 2
            group, self.suspects = self.suspects[:n], self.suspects[n:]
            self.probe = {r.key: (r, r.num_known - len(r.prompt_ids)) for r in group if live.get(r.key) is r}
        if not self.probe:
            self._release()
            return
        for req, _ in self.probe.values():  # from the parked, to the head of the queue
            if req in self.parked:
                self.parked.remove(req)
                self.table.waiting.appendleft(req)

    def _release(self) -> None:
        """The quarantine is over: the parked requests wait at the head of the queue, oldest first."""
        if self.parked:
            self.table.waiting.extendleft(sorted(self.parked, key=lambda r: -r.arrival_seq))
            self.parked.clear()
        self._alone.clear()
