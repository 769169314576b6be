"""A launch's rows: its index lists on the host, their columns on the device (one transfer),
and the forward batch and sampling built from them over the request slots."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from stepahead.protocol import Launch
from worker_svc.backends import RowSampling
from worker_svc.device_streams import DeviceStreams, to_device_columns
from worker_svc.forward_batch import ForwardBatch, VerifyRows
from worker_svc.logits_processors import ProcessingTable, StepPlan
from worker_svc.slots import RequestSlots
from worker_svc.speculative import Drafted

__all__ = ["BatchBuilder", "DeviceRows", "HostRows", "device_rows", "host_rows", "plan_processing"]


@dataclass
class HostRows:
    """Host-side index lists of one launch, computed once per step."""

    positions: list[int]
    token_req_slots: list[int]
    row_token_starts: list[int]
    row_ctx_lens: list[int]
    prompt_token_index: list[int]
    future_token_index: list[int]
    future_req_slots: list[int]
    sample_token_index: list[int]
    sample_req_slots: list[int]
    sample_positions: list[int]
    # Logits processing, when a live slot has any (`plan_processing`).
    plan: StepPlan | None = None  # None: no sampling row has processing
    tracked: bool = False  # a live slot is penalized: the history takes this step's tokens
    history_token_index: list[int] = field(default_factory=list)  # prompt-sourced tokens
    history_output_index: list[int] = field(default_factory=list)  # of them, outputs not counted
    # Under speculative decoding every row read from the FutureMap sits at positions the device
    # holds (worker_svc/speculative.py): a verify row of K + 1 tokens, or a decode row of 1 (a
    # request that does not draft this step). Each samples every one of its tokens, so a launch's
    # sampling entries are its sampling rows, a verify row's counting K + 1. Their positions
    # here are the scheduler's bounds; the device's replace them. "Verify rows" below are both.
    verify_rows: list[int] = field(default_factory=list)  # launch row index
    verify_req_slots: list[int] = field(default_factory=list)
    verify_tokens: list[int] = field(default_factory=list)  # each one's tokens: 1 or K + 1
    verify_drafting: list[int] = field(default_factory=list)  # 1: it carries drafts
    verify_token_index: list[int] = field(default_factory=list)  # their tokens, row-major
    verify_sample_index: list[int] = field(default_factory=list)  # their sampling entries
    verify_flat_index: list[int] = field(default_factory=list)  # each token's place in [Bv, K + 1]
    plain_sample_index: list[int] = field(default_factory=list)  # the other sampling entries
    entry_rows: list[int] = field(default_factory=list)  # each sampling entry's sampling row
    verify_width: int = 0  # a bound on the verify rows' lengths, for their drafts' lookup
    # Prompt log-probabilities (Launch.row_scores): each scored position's index into the
    # tokens, and the prompt token it is scored against (the one that follows it).
    score_token_index: list[int] = field(default_factory=list)
    score_targets: list[int] = field(default_factory=list)


def host_rows(launch: Launch, draft_tokens: int = 0, context: int = 0, resolved: bool = False) -> HostRows:
    """`draft_tokens`: K, under speculative decoding (0: none), when a row read from the
    FutureMap is a verify row; `context`: the context length; `resolved`: the launch's rows
    read from the FutureMap are at their true positions, a verify row only with drafts (more
    than one token), else a plain decode row (`WorkerEngine._resolve_rows`)."""
    rows = HostRows([], [], [], [], [], [], [], [], [], [])
    t = p = 0  # the row's first token, and its first prompt id
    for slot, start, n, from_future, sample, (scored, last) in zip(
        launch.row_req_slots,
        launch.row_start_pos,
        launch.row_num_tokens,
        launch.row_from_future,
        launch.row_sample,
        launch.row_scores(),
        strict=True,
    ):
        rows.row_token_starts.append(t)
        rows.token_req_slots.extend([slot] * n)
        if from_future and draft_tokens and (n > 1 or not resolved):
            _add_verify_row(rows, slot, start, n, t, context, draft_tokens)
            t += n
            continue
        rows.row_ctx_lens.append(start + n)
        rows.positions.extend(range(start, start + n))
        if from_future:
            rows.future_token_index.append(t)
            rows.future_req_slots.append(slot)
        else:
            rows.prompt_token_index.extend(range(t, t + n))
            if scored:
                rows.score_token_index.extend(range(t, t + scored))
                rows.score_targets.extend(launch.prompt_ids[p + 1 : p + n])
                if scored == n:
                    rows.score_targets.append(last)
            p += n
        if sample:
            if draft_tokens:
                rows.plain_sample_index.append(len(rows.sample_token_index))
                rows.entry_rows.append(rows.entry_rows[-1] + 1 if rows.entry_rows else 0)
            rows.sample_token_index.append(t + n - 1)
            rows.sample_req_slots.append(slot)
            rows.sample_positions.append(start + n)
        t += n
    if not rows.verify_rows:
        rows.plain_sample_index, rows.entry_rows = [], []
    return rows


def _add_verify_row(rows: HostRows, slot: int, start: int, n: int, t: int, context: int, k: int) -> None:
    """A row of n (1, or K + 1 with drafts) tokens whose first position is at most `start`."""
    at = len(rows.verify_rows) * (k + 1)
    rows.verify_flat_index.extend(range(at, at + n))
    rows.verify_rows.append(len(rows.row_token_starts) - 1)
    rows.verify_req_slots.append(slot)
    rows.verify_tokens.append(n)
    rows.verify_drafting.append(int(n > 1))
    rows.row_ctx_lens.append(min(start + n, context))
    rows.verify_width = max(rows.verify_width, min(start + 1, context))
    rows.positions.extend(min(start + j, context - 1) for j in range(n))
    rows.verify_token_index.extend(range(t, t + n))
    first = len(rows.sample_token_index)
    rows.verify_sample_index.extend(range(first, first + n))
    row = rows.entry_rows[-1] + 1 if rows.entry_rows else 0
    rows.entry_rows.extend([row] * n)
    rows.sample_token_index.extend(range(t, t + n))
    rows.sample_req_slots.extend([slot] * n)
    rows.sample_positions.extend(min(start + 1 + j, context) for j in range(n))


def plan_processing(launch: Launch, rows: HostRows, table: ProcessingTable) -> None:
    """The step's logits processing, decided on the host: which sampling rows are processed,
    and, while a live slot is penalized, which prefill tokens the history takes."""
    bounds: list[bool] = []
    if rows.verify_sample_index and table.host:  # a verify row's positions are bounds (`host_rows`)
        bounds = [False] * len(rows.sample_req_slots)
        for entry in rows.verify_sample_index:
            bounds[entry] = True
    rows.plan = table.plan(rows.sample_req_slots, rows.sample_positions, bounds)
    rows.tracked = bool(table.penalized)
    if not rows.tracked:
        return
    prefill_rows = (
        (slot, start, n, t)
        for (slot, start, n, from_future, _), t in zip(launch.rows(), rows.row_token_starts, strict=True)
        if not from_future
    )
    rows.history_token_index, rows.history_output_index = table.history_tokens(prefill_rows)
    table.count_sampled(rows.sample_req_slots, rows.sample_positions)


@dataclass(frozen=True)
class DeviceRows:
    """The launch's index columns on the device: views of one transfer."""

    positions: torch.Tensor
    kv_slots: torch.Tensor
    token_req_slots: torch.Tensor
    row_req_slots: torch.Tensor
    prompt_ids: torch.Tensor
    prompt_token_index: torch.Tensor
    future_token_index: torch.Tensor
    future_req_slots: torch.Tensor
    sample_token_index: torch.Tensor
    sample_req_slots: torch.Tensor
    sample_positions: torch.Tensor
    history_token_index: torch.Tensor
    history_output_index: torch.Tensor
    mask_rows: torch.Tensor
    mask_ids: torch.Tensor
    mask_limits: torch.Tensor
    verify_req_slots: torch.Tensor
    verify_drafting: torch.Tensor
    verify_token_index: torch.Tensor
    verify_sample_index: torch.Tensor
    verify_flat_index: torch.Tensor
    plain_sample_index: torch.Tensor
    score_token_index: torch.Tensor
    score_targets: torch.Tensor


def device_rows(launch: Launch, rows: HostRows, streams: DeviceStreams) -> DeviceRows:
    plan = rows.plan
    columns = [
        rows.positions,
        launch.kv_slots,
        rows.token_req_slots,
        launch.row_req_slots,
        launch.prompt_ids,
        rows.prompt_token_index,
        rows.future_token_index,
        rows.future_req_slots,
        rows.sample_token_index,
        rows.sample_req_slots,
        rows.sample_positions,
        rows.history_token_index,
        rows.history_output_index,
        plan.mask_rows if plan is not None else [],
        plan.mask_ids if plan is not None else [],
        plan.mask_limits if plan is not None else [],
        rows.verify_req_slots,
        rows.verify_drafting,
        rows.verify_token_index,
        rows.verify_sample_index,
        rows.verify_flat_index,
        rows.plain_sample_index,
        rows.score_token_index,
        rows.score_targets,
    ]
    return DeviceRows(*to_device_columns(columns, streams.device, streams))


class BatchBuilder:
    """The forward batch and the sampling rows of a launch, from its rows and the request slots
    (on the forward thread: nothing here reads a device value back, see worker_svc/engine.py)."""

    def __init__(self, slots: RequestSlots, device: torch.device) -> None:
        self._slots = slots
        self._device = device

    def batch(
        self, launch: Launch, rows: HostRows, on_device: DeviceRows, drafted: Drafted | None = None
    ) -> ForwardBatch:
        """`drafted`: the launch's verify rows, whose positions and inputs the device holds."""
        req_to_token = self._slots.req_to_token
        table_positions = on_device.positions
        verify = None
        if drafted is not None:
            index, flat = on_device.verify_token_index, on_device.verify_flat_index
            on_device.positions.index_copy_(0, index, drafted.flat(drafted.positions, flat))
            table_positions = on_device.positions.index_copy(
                0, index, drafted.flat(drafted.table_positions, flat)
            )
            verify = VerifyRows(rows.verify_rows, rows.verify_tokens, rows.verify_token_index, drafted.base)
        req_to_token.index_put_((on_device.token_req_slots, table_positions), on_device.kv_slots)
        return ForwardBatch(
            input_ids=self._input_ids(rows, on_device, drafted),
            positions=on_device.positions,
            out_kv_slots=on_device.kv_slots,
            row_req_slots=on_device.row_req_slots,
            row_token_starts=rows.row_token_starts,
            row_num_tokens=launch.row_num_tokens,
            row_ctx_lens=rows.row_ctx_lens,
            sample_token_index=on_device.sample_token_index,
            req_to_token=req_to_token,
            verify=verify,
            score_token_index=on_device.score_token_index if rows.score_token_index else None,
        )

    def _input_ids(self, rows: HostRows, on_device: DeviceRows, drafted: Drafted | None) -> torch.Tensor:
        """Prompt ids come from the host, decode ids from the FutureMap on the device, a verify
        row's from its drafts."""
        if drafted is None:
            if not rows.future_token_index:
                return on_device.prompt_ids
            if not rows.prompt_token_index:
                return self._slots.future.read(on_device.future_req_slots)
        ids = torch.empty(len(rows.positions), dtype=torch.int64, device=self._device)
        if rows.future_token_index:
            ids.index_copy_(
                0, on_device.future_token_index, self._slots.future.read(on_device.future_req_slots)
            )
        if rows.prompt_token_index:
            ids.index_copy_(0, on_device.prompt_token_index, on_device.prompt_ids)
        if drafted is not None:
            ids.index_copy_(
                0, on_device.verify_token_index, drafted.flat(drafted.inputs, on_device.verify_flat_index)
            )
        return ids

    def sampling(self, rows: HostRows, on_device: DeviceRows, drafted: Drafted | None = None) -> RowSampling:
        """`drafted`: the launch's verify rows, whose entries' penalties count their drafts."""
        table = self._slots.table
        plan = rows.plan
        processing = None
        if plan is not None and plan.processes:
            mask = (on_device.mask_rows, on_device.mask_ids, on_device.mask_limits)
            slots, positions = on_device.sample_req_slots, on_device.sample_positions
            before = None
            if drafted is not None and plan.penalized:
                before = drafted.before_entries(
                    len(rows.sample_req_slots), on_device.verify_sample_index, on_device.verify_flat_index
                )
            processing = table.processing.rows(slots, positions, plan, mask, before)
        return table.rows(
            rows.sample_req_slots,
            on_device.sample_req_slots,
            on_device.sample_positions,
            processing,
            plan.top_logprobs if plan is not None else None,
        )
