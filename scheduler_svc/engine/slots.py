"""The slots one worker session lends the policy: KV slots (asked of their one owner,
`kv/manager.py: KvManager`) and request slots; when a request gives them back, and the request
slots freed but not yet told to the worker (the next launch carries them). Also the model's EOS
ids from the session's handshake. A new worker session starts all of it afresh.
"""

from __future__ import annotations

from scheduler_svc.engine.kv.allocator import SlotAllocator
from scheduler_svc.engine.kv.manager import KvManager
from scheduler_svc.engine.request import Request
from scheduler_svc.engine.rows import SlotRows
from scheduler_svc.engine.telemetry import SchedulerTelemetry
from stepahead.protocol import WorkerInfo


class SessionSlots:
    def __init__(self, prefix_cache: bool, telemetry: SchedulerTelemetry, draft_tokens: int = 0) -> None:
        """`draft_tokens`: K under speculative decoding (0: none)."""
        self._prefix_cache = prefix_cache
        self._telemetry = telemetry
        self.draft_tokens = draft_tokens
        self.kv = KvManager(0, prefix_cache, telemetry)  # the one owner of KV slots
        self.req_slots = SlotAllocator(0, "request slots")
        self.rows = SlotRows(0, draft_tokens)  # the running requests' per-step state, by request slot
        self.eos_token_ids: frozenset[int] = frozenset()
        self.max_context_len = 0
        self._pending_releases: list[int] = []

    def begin(self, info: WorkerInfo, request_slots: int) -> None:
        """Fresh slot accounting for a new worker session: the old one's KV is gone."""
        self.kv = KvManager(info.kv_slots, self._prefix_cache, self._telemetry)
        self.req_slots = SlotAllocator(request_slots, "request slots")
        self.rows = SlotRows(request_slots, self.draft_tokens)
        self.eos_token_ids = frozenset(info.eos_token_ids)
        self.max_context_len = info.max_context_len
        self._pending_releases = []

    @property
    def has_releases(self) -> bool:
        return bool(self._pending_releases)

    def take_releases(self) -> list[int]:
        """The request slots freed since the last launch, for the next one to tell the worker."""
        released, self._pending_releases = self._pending_releases, []
        return released

    def assign(self, req: Request) -> None:
        """A request slot for an admitted request (one is free: admission checked), and its row."""
        slot = self.req_slots.allocate_one()
        self.rows.place(req, slot, req.num_computed, req.num_inflight, req.prompt_kept)
        req.req_slot, req.rows = slot, self.rows

    def release(self, req: Request, computed: bool = True) -> None:
        """Free the request's slots now, even if a batch in flight still holds it; the prefix
        cache keeps what it computed (unless the worker session that holds its KV is gone).

        NOTE: safe because the worker runs batches in launch order: every batch
        that can reuse these slots runs after the in-flight ones that hold them.
        """
        if req.req_slot is not None:
            rows, req.rows = req.rows, None
            if rows is not None:
                req.num_computed, req.num_inflight, req.prompt_kept = rows.clear(req.req_slot)
            self.req_slots.free_one(req.req_slot)
            self._pending_releases.append(req.req_slot)
            req.req_slot = None
        self.kv.release(req, computed)
