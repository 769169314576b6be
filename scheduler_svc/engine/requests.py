"""The request table: every live request of the engine core, by key (request id, completion
index) and by handle (owner, handle), and the two queues they sit in: the waiting queue and the
running list. It records and looks up; who moves between the queues, and when, is decided by
admission (`admission.py`), preemption (`running.py`) and the policy's endings (`policy.py`).
"""

from __future__ import annotations

import collections
from array import array

from scheduler_svc.contract import MAX_COMPLETIONS, OutputSink
from scheduler_svc.engine.request import Request


class RequestTable:
    def __init__(self) -> None:
        self.requests: dict[tuple[str, int], Request] = {}  # by (request id, completion index)
        self._by_handle: dict[tuple[OutputSink | None, int], Request] = {}
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        # The running requests' request slots, in running order: the pick's column of them read
        # without a walk of the requests (`RunningManager._running_slots`).
        self.running_slots: array[int] = array("q")
        self._arrivals = 0
        self.version = 0  # changes whenever the running list does

    def add(self, req: Request) -> None:
        """A new request, numbered in arrival order, at the tail of the waiting queue."""
        self._arrivals += 1
        req.arrival_seq = self._arrivals
        self.requests[req.key] = req
        self._by_handle[req.owner, req.handle] = req
        self.waiting.append(req)

    def completions(self, rid: str) -> list[Request]:
        """Every live completion of the request id."""
        return [r for i in range(MAX_COMPLETIONS) if (r := self.requests.get((rid, i))) is not None]

    def by_handle(self, owner: OutputSink | None, handle: int) -> Request | None:
        return self._by_handle.get((owner, handle))

    def owned_by(self, owner: OutputSink) -> list[Request]:
        """Every live request of the frontend."""
        return [req for (o, _), req in self._by_handle.items() if o is owner]

    def start(self, req: Request) -> None:
        """The head of the waiting queue, admitted (it holds a request slot), joins the running
        list."""
        assert self.waiting[0] is req and req.req_slot is not None
        self.waiting.popleft()
        self.running.append(req)
        self.running_slots.append(req.req_slot)
        self.version += 1

    def requeue(self, req: Request) -> None:
        """A running request goes back to the head of the waiting queue (to be recomputed)."""
        if not self._leave_running(req):
            raise ValueError(f"request {req.rid} requeued while not running")
        self.waiting.appendleft(req)

    def forget(self, req: Request) -> None:
        self.requests.pop(req.key, None)
        self._by_handle.pop((req.owner, req.handle), None)
        if not self._leave_running(req) and req in self.waiting:
            self.waiting.remove(req)

    def clear_queues(self) -> None:
        self.version += 1
        self.running.clear()
        del self.running_slots[:]
        self.waiting.clear()

    def _leave_running(self, req: Request) -> bool:
        """Whether `req` was running (it no longer is)."""
        try:
            i = self.running.index(req)
        except ValueError:
            return False
        del self.running[i]
        del self.running_slots[i]
        self.version += 1
        return True
