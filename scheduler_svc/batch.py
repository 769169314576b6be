"""A picked batch: the Launch for the worker plus what processing needs back."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_svc.request import Request
from stepahead.protocol import Launch, NewRequest


@dataclass(frozen=True)
class SampledRow:
    """A row whose sampled token comes back; `attempt` tells a preempted
    request's stale row from its current one."""

    request: Request
    attempt: int


@dataclass
class ScheduledBatch:
    launch: Launch
    sampled: list[SampledRow] = field(default_factory=list)
    epoch: int = 0  # the worker session it is launched in
    launched_at: float = 0.0  # time.monotonic() when it was sent

    @property
    def step_id(self) -> int:
        return self.launch.step_id

    @property
    def forward_mode(self) -> str:
        return self.launch.forward_mode

    @property
    def num_tokens(self) -> int:
        return self.launch.num_tokens

    def add_decode(self, req: Request, kv_slot: int) -> None:
        """One token: the request's last sampled one, read from the FutureMap."""
        assert req.req_slot is not None
        self._add_row(req, req.num_computed, 1, from_future=True, sample=True)
        self.launch.kv_slots.append(kv_slot)

    def add_prefill(self, req: Request, ids: list[int], kv_slots: list[int], sample: bool) -> None:
        """A chunk of known tokens; the chunk that ends them samples the next token."""
        assert req.req_slot is not None
        self._add_row(req, req.num_computed, len(ids), from_future=False, sample=sample)
        self.launch.prompt_ids.extend(ids)
        self.launch.kv_slots.extend(kv_slots)

    def register(self, req: Request) -> None:
        assert req.req_slot is not None
        p = req.params
        self.launch.new_requests.append(NewRequest(req.req_slot, p.temperature, p.top_p, p.top_k, p.seed))

    def _add_row(self, req: Request, start: int, n: int, from_future: bool, sample: bool) -> None:
        launch = self.launch
        launch.row_req_slots.append(req.req_slot)  # type: ignore[arg-type]
        launch.row_start_pos.append(start)
        launch.row_num_tokens.append(n)
        launch.row_from_future.append(from_future)
        launch.row_sample.append(sample)
        if sample:
            self.sampled.append(SampledRow(req, req.attempt))
