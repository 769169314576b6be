"""The request table: every live request of the engine core, by key (request id, completion
index) and by handle (owner, handle), and the two queues they sit in: the waiting queue and the
running list. It records and looks up; who moves between the queues, and when, is decided by
admission (`admission.py`), preemption (`running.py`) and the policy's endings (`policy.py`).
"""

from __future__ import annotations

import collections

from scheduler_svc.contract import MAX_COMPLETIONS, OutputSink
from scheduler_svc.engine.request import Request


class RequestTable:
    def __init__(self) -> None:
        self.requests: dict[tuple[str, int], Request] = {}  # by (request id, completion index)
        self._by_handle: dict[tuple[OutputSink | None, int], Request] = {}
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
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
        """The head of the waiting queue, admitted, joins the running list."""
        assert self.waiting[0] is req
        self.waiting.popleft()
        self.running.append(req)
        self.version += 1

    def requeue(self, req: Request) -> None:
        """A running request goes back to the head of the waiting queue (to be recomputed)."""
        self.running.remove(req)
        self.waiting.appendleft(req)
        self.version += 1

    def forget(self, req: Request) -> None:
        self.requests.pop(req.key, None)
        self._by_handle.pop((req.owner, req.handle), None)
        if req in self.running:
            self.running.remove(req)
            self.version += 1
        elif req in self.waiting:
            self.waiting.remove(req)

    def clear_queues(self) -> None:
        self.version += 1
        self.running.clear()
        self.waiting.clear()
