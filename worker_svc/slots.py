"""The request slots on the device: sampling constants and processing (`SlotTable`), the
FutureMap, the request-to-token map, and the slot deltas and cached prefixes that change them."""

from __future__ import annotations

import torch

from stepahead.protocol import Launch, NewRequest
from worker_svc.backends import RowSampling
from worker_svc.device_streams import DeviceStreams, to_device_columns
from worker_svc.future_map import FutureMap
from worker_svc.launch_check import LaunchError
from worker_svc.logits_processors import ProcessingTable, RowProcessing, registration_columns

__all__ = ["RequestSlots", "SlotTable"]


class SlotTable:
    """Per request slot: sampling constants and logits processing (on the device), and liveness."""

    def __init__(self, num_slots: int, vocab: int, context: int, device: torch.device) -> None:
        self.temperature = torch.zeros(num_slots, dtype=torch.float32, device=device)
        self.top_p = torch.ones(num_slots, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.min_p = torch.zeros(num_slots, dtype=torch.float32, device=device)
        self.seed = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.processing = ProcessingTable(num_slots, vocab, context, device)
        self.host: dict[int, NewRequest] = {}  # the same constants, for host-side decisions

    def register(self, requests: list[NewRequest], streams: DeviceStreams) -> None:
        """Two transfers whatever the count: the integer constants, then the float ones."""
        processing_ints, processing_floats = registration_columns(requests)
        # Seeds are uint64 on the wire; the sampler mixes their 63 low bits.
        ints = [[r.req_slot for r in requests], [r.top_k for r in requests]]
        ints += [[r.seed & (2**63 - 1) for r in requests], *processing_ints]
        slots, top_k, seed, *more_ints = to_device_columns(ints, streams.device, streams)
        floats = [[r.temperature for r in requests], [r.top_p for r in requests], [r.min_p for r in requests]]
        floats += processing_floats
        temperature, top_p, min_p, *more_floats = to_device_columns(
            floats, streams.device, streams, torch.float32
        )
        self.temperature.index_copy_(0, slots, temperature)
        self.top_p.index_copy_(0, slots, top_p)
        self.min_p.index_copy_(0, slots, min_p)
        self.top_k.index_copy_(0, slots, top_k)
        self.seed.index_copy_(0, slots, seed)
        self.processing.register(requests, slots, more_ints, more_floats)
        self.host.update((r.req_slot, r) for r in requests)

    def release(self, slots: list[int]) -> None:
        for slot in slots:
            self.host.pop(slot, None)
        self.processing.release(slots)

    def clear(self) -> None:
        self.host.clear()
        self.processing.clear()

    def rows(
        self,
        host_slots: list[int],
        slots: torch.Tensor,
        positions: torch.Tensor,
        processing: RowProcessing | None = None,
        top_logprobs: int | None = None,
    ) -> RowSampling:
        params = [self.host[s] for s in host_slots]
        greedy = tuple(p.temperature <= 0 for p in params)
        filtered = tuple(p.cuts_vocab for p in params)
        return RowSampling(
            self.temperature.index_select(0, slots),
            self.top_p.index_select(0, slots),
            self.top_k.index_select(0, slots),
            self.min_p.index_select(0, slots),
            self.seed.index_select(0, slots),
            positions,
            all_greedy=all(greedy),
            any_filter=any(filtered),
            processing=processing,
            top_logprobs=top_logprobs,
            row_greedy=greedy,
            row_filtered=filtered,
        )


class RequestSlots:
    """Everything the worker keeps per request slot: each slot's latest sampled id (the
    FutureMap), its constants (`SlotTable`), and which KV slot holds each of its positions.
    Changed on the forward thread only, in launch order (worker_svc/engine.py)."""

    def __init__(
        self, num_slots: int, vocab: int, context: int, device: torch.device, check_invariants: bool
    ) -> None:
        self.future = FutureMap(num_slots, device, check_invariants)
        self.table = SlotTable(num_slots, vocab, context, device)
        # One column past the context: the spare that a verify row's unproposed positions write
        # (worker_svc/speculative.py), which no row attends.
        self.req_to_token = torch.zeros((num_slots, context + 1), dtype=torch.int64, device=device)

    @property
    def live(self) -> int:
        """How many request slots are registered."""
        return len(self.table.host)

    def reset(self, streams: DeviceStreams) -> None:
        """Every slot forgotten: the FutureMap back to its sentinel, on the forward stream
        (ordered with the steps), and its sentinel count back to 0."""
        with streams.forward():
            self.future.reset_all()
        self.table.clear()
        self.future.sentinel_reads = 0

    def check_live_rows(self, launch: Launch) -> None:
        """Every row's request slot is registered once the launch's slot deltas apply."""
        released = set(launch.released_slots)
        registered = {r.req_slot for r in launch.new_requests}
        for i, slot in enumerate(launch.row_req_slots):
            if slot not in registered and (slot in released or slot not in self.table.host):
                raise LaunchError(f"row_req_slots[{i}]: request slot {slot} is not registered")

    def apply_deltas(self, launch: Launch, streams: DeviceStreams) -> None:
        if launch.released_slots:
            self.future.reset(streams.to_device(launch.released_slots))
            self.table.release(launch.released_slots)
        if launch.new_requests:
            self.table.register(launch.new_requests, streams)
            self._map_cached_prefixes(launch.new_requests, streams)

    def _map_cached_prefixes(self, requests: list[NewRequest], streams: DeviceStreams) -> None:
        """A request's cached prefix: its first positions read the KV slots earlier requests
        computed (one transfer, only when some request has one)."""
        entries = [(r.req_slot, pos, kv) for r in requests for pos, kv in enumerate(r.prefix_kv_slots)]
        if not entries:
            return
        columns = [[e[0] for e in entries], [e[1] for e in entries], [e[2] for e in entries]]
        slots, positions, kv_slots = to_device_columns(columns, streams.device, streams)
        self.req_to_token.index_put_((slots, positions), kv_slots)
