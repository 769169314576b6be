"""The worker engine: executes launched batches strictly in launch order.

A launch goes through two single-thread executors:
  forward thread: check the launch (worker_svc/launch_check.py), apply slot
                  deltas, build the batch (decode inputs gathered from the
                  FutureMap on the device), forward, process the logits and
                  sample (worker_svc/logits_processors.py), store the sampled
                  ids in the FutureMap, start the copy to the host;
  copy thread:    wait for that copy, hand the ids (and log-probabilities) back.
Both are FIFO, so batches run and complete in launch order, and batch k+1 can
be enqueued on the device while batch k's copy is awaited.

While a live request is penalized, each step updates the token history on the
forward stream, in launch order: registrations (a penalized one resets its
slot), then the launch's prompt-sourced tokens, then the rows' history is read
and their logits processed, then the sampled ids are counted, in the same step,
so batch k+1 sees batch k's tokens though the scheduler has not seen them yet.
Which rows are processed, masked (min_tokens) or get log-probabilities is
decided on the host; while no live slot has processing, a step runs none of it.

NOTE: the forward thread never waits for the device. Host values reach it only
through `DeviceStreams.to_device` (the model's through `transfers_through`), and
nothing on that thread reads a device value back (`.item()`, `.tolist()`,
`.cpu()`, `int(t)`), except the FutureMap sentinel check that
`--check-invariants` turns on, which synchronises by design.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from stepahead.protocol import Launch, NewRequest, StepResult, WorkerInfo
from stepahead.trace import NO_TRACE, Tracer
from worker_svc.backends import ModelBackend, RowSampling
from worker_svc.batch import ForwardBatch
from worker_svc.future_map import FutureMap
from worker_svc.launch_check import LaunchError, LaunchLimits, check_launch, step_budget
from worker_svc.logits_processors import (
    ProcessingTable,
    RowProcessing,
    Sampled,
    StepPlan,
    pack_for_host,
    registration_columns,
    unpack_from_host,
)
from worker_svc.metrics import WorkerMetrics
from worker_svc.ranks import (
    Command,
    GroupBroken,
    TensorParallelRanks,
    decode_launch,
    decode_session,
    fail_stop,
)
from worker_svc.streams import (
    DeviceStreams,
    PendingCopy,
    StepTiming,
    to_device_columns,
    transfers_through,
)

__all__ = ["EngineConfig", "EngineStats", "LaunchError", "WorkerEngine"]

T = TypeVar("T")


@dataclass(frozen=True)
class EngineConfig:
    kv_slots: int
    request_slots: int
    check_invariants: bool = False


@dataclass(frozen=True)
class EngineStats:
    """The current session's counters (all but `epoch` start at 0 with each session)."""

    epoch: int
    steps_executed: int
    last_step_id: int
    out_of_order_launches: int
    sentinel_reads: int
    live_request_slots: int


class SlotTable:
    """Per request slot: sampling constants and logits processing (on the device), and liveness."""

    def __init__(self, num_slots: int, vocab: int, context: int, device: torch.device) -> None:
        self.temperature = torch.zeros(num_slots, dtype=torch.float32, device=device)
        self.top_p = torch.ones(num_slots, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(num_slots, dtype=torch.int64, device=device)
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
        floats = [[r.temperature for r in requests], [r.top_p for r in requests], *processing_floats]
        temperature, top_p, *more_floats = to_device_columns(floats, streams.device, streams, torch.float32)
        self.temperature.index_copy_(0, slots, temperature)
        self.top_p.index_copy_(0, slots, top_p)
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
        return RowSampling(
            self.temperature.index_select(0, slots),
            self.top_p.index_select(0, slots),
            self.top_k.index_select(0, slots),
            self.seed.index_select(0, slots),
            positions,
            all_greedy=all(p.temperature <= 0 for p in params),
            any_filter=any(p.top_p < 1.0 or p.top_k > 0 for p in params),
            processing=processing,
            top_logprobs=top_logprobs,
        )


@dataclass
class _HostRows:
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
    # Logits processing, when a live slot has any (`_plan_processing`).
    plan: StepPlan | None = None  # None: no sampling row has processing
    tracked: bool = False  # a live slot is penalized: the history takes this step's tokens
    history_token_index: list[int] = field(default_factory=list)  # prompt-sourced tokens
    history_output_index: list[int] = field(default_factory=list)  # of them, outputs not counted


def _host_rows(launch: Launch) -> _HostRows:
    rows = _HostRows([], [], [], [], [], [], [], [], [], [])
    t = 0
    for slot, start, n, from_future, sample in zip(
        launch.row_req_slots,
        launch.row_start_pos,
        launch.row_num_tokens,
        launch.row_from_future,
        launch.row_sample,
        strict=True,
    ):
        rows.row_token_starts.append(t)
        rows.row_ctx_lens.append(start + n)
        rows.positions.extend(range(start, start + n))
        rows.token_req_slots.extend([slot] * n)
        if from_future:
            rows.future_token_index.append(t)
            rows.future_req_slots.append(slot)
        else:
            rows.prompt_token_index.extend(range(t, t + n))
        if sample:
            rows.sample_token_index.append(t + n - 1)
            rows.sample_req_slots.append(slot)
            rows.sample_positions.append(start + n)
        t += n
    return rows


def _plan_processing(launch: Launch, rows: _HostRows, table: ProcessingTable) -> None:
    """The step's logits processing, decided on the host: which sampling rows are processed,
    and, while a live slot is penalized, which prefill tokens the history takes."""
    rows.plan = table.plan(rows.sample_req_slots, rows.sample_positions)
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
class _DeviceRows:
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


def _device_rows(launch: Launch, rows: _HostRows, streams: DeviceStreams) -> _DeviceRows:
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
    ]
    return _DeviceRows(*to_device_columns(columns, streams.device, streams))


@dataclass(frozen=True)
class _Enqueued:
    copy: PendingCopy
    live_after: int  # request slots live once this launch has run
    epoch: int  # the session it ran in


_FORWARD_THREAD = threading.local()


def _enter_inference_mode() -> None:
    """For the forward thread's whole life: no autograd bookkeeping, and no
    per-step enter/exit between two forwards (it shows in the device gap)."""
    # NOTE: inference mode lasts as long as its guard object: it is kept for the thread's life.
    guard = torch.inference_mode()
    guard.__enter__()
    _FORWARD_THREAD.inference_mode = guard


class SessionEnded(RuntimeError):
    """A launch dropped unrun: its session ended while it waited its turn."""


class WorkerEngine:
    def __init__(
        self,
        backend: ModelBackend,
        config: EngineConfig,
        streams: DeviceStreams,
        tracer: Tracer = NO_TRACE,
        ranks: TensorParallelRanks | None = None,
    ) -> None:
        self.backend = backend
        self.config = config
        self.streams = streams
        self.tracer = tracer
        self.ranks = ranks  # None: one rank; else every command is handed to the others first
        self.metrics = WorkerMetrics(backend.name, str(streams.device))
        self.metrics.tensor_parallel_size.set(ranks.size if ranks is not None else 1)
        self._last_forward_end: float | None = None
        self._live_after_last_step = False
        device = streams.device
        backend.allocate_kv(config.kv_slots)
        self._future = FutureMap(config.request_slots, device, config.check_invariants)
        self._slots = SlotTable(config.request_slots, backend.vocab_size, backend.max_context_len, device)
        self._req_to_token = torch.zeros(
            (config.request_slots, backend.max_context_len), dtype=torch.int64, device=device
        )
        self._no_tokens = torch.empty(0, dtype=torch.int64, device=device)
        self._forward_thread = concurrent.futures.ThreadPoolExecutor(
            1, "forward-stream", initializer=_enter_inference_mode
        )
        self._copy_thread = concurrent.futures.ThreadPoolExecutor(1, "copy-wait")
        # Clock-based, so that a restarted worker's sessions never reuse an epoch.
        self._epoch = time.time_ns() // 1_000_000
        self._last_step_id = 0
        self._steps_executed = 0
        self._out_of_order = 0
        self._limits = self._session_limits(None)
        # The live session's ticket: a launch submitted under another is dropped unrun when its
        # turn comes (written on the caller's thread, read on the forward thread).
        self._ticket = 0

    @property
    def info(self) -> WorkerInfo:
        b = self.backend
        return WorkerInfo(
            model=b.name,
            vocab_size=b.vocab_size,
            max_context_len=b.max_context_len,
            eos_token_ids=b.eos_token_ids,
            bos_token_id=b.bos_token_id,
            kv_slots=self.config.kv_slots,
            request_slots=self.config.request_slots,
            device=str(self.streams.device),
            tokenizer=b.tokenizer,
            epoch=self._epoch,
            worker_unix_time=time.time(),
            tensor_parallel_size=self.ranks.size if self.ranks is not None else 1,
        )

    def stats(self) -> EngineStats:
        return EngineStats(
            epoch=self._epoch,
            steps_executed=self._steps_executed,
            last_step_id=self._last_step_id,
            out_of_order_launches=self._out_of_order,
            sentinel_reads=self._future.sentinel_reads,
            live_request_slots=len(self._slots.host),
        )

    @property
    def launch_limits(self) -> LaunchLimits:
        """What the current session's launches are checked against."""
        return self._limits

    def begin_session(self, max_batch_tokens: int | None = None) -> concurrent.futures.Future[WorkerInfo]:
        """Forget every request slot and counter, after all batches launched so far.

        `max_batch_tokens` is the step budget the scheduler announced for this
        session; None holds launches to a bound derived from the KV pool
        (`launch_check.step_budget`). ValueError, at once, if it is below 1.
        """
        limits = self._session_limits(max_batch_tokens)
        self._ticket += 1  # launches of the session before, still queued, are dropped
        return self._forward_thread.submit(self._lead_session, max_batch_tokens, limits)

    @property
    def session_ticket(self) -> int:
        """The ticket of the session begun last, for `submit` and `end_session`."""
        return self._ticket

    def end_session(self, ticket: int) -> None:
        """The session of `ticket` is over: its launches still queued are dropped unrun (their
        futures fail with SessionEnded), so the next session's steps wait behind none of them."""
        if self._ticket == ticket:
            self._ticket += 1

    def submit(self, launch: Launch, ticket: int | None = None) -> concurrent.futures.Future[StepResult]:
        """Enqueue a launch of the session of `ticket` (None: the live one); the future
        resolves, in launch order, with its tokens."""
        ticket = self._ticket if ticket is None else ticket
        pending = self._forward_thread.submit(self._enqueue, launch, ticket)
        return self._copy_thread.submit(self._complete, launch, pending)

    def shutdown(self) -> None:
        if self.ranks is not None:  # after every launch queued so far: the other ranks stop too
            self._forward_thread.submit(self._lead, self.ranks.hand_stop).result()
        self._forward_thread.shutdown(wait=True, cancel_futures=True)
        self._copy_thread.shutdown(wait=True, cancel_futures=True)

    def follow(self) -> None:
        """A rank other than 0: runs rank 0's commands, in its order, until it stops.

        NOTE: rank 0 hands on only launches that passed its checks, and every rank's state is
        the same, so these pass too; a rank that finds otherwise has diverged and stops.
        """
        assert self.ranks is not None and not self.ranks.is_leader
        _enter_inference_mode()
        try:
            while self._follow_one(self.ranks):
                pass
        except GroupBroken as exc:
            fail_stop(exc)

    def _follow_one(self, ranks: TensorParallelRanks) -> bool:
        """Runs rank 0's next command; False once it is the stop."""
        kind, payload = ranks.receive()
        if kind is Command.SESSION:
            self._reset_for_session(self._session_limits(decode_session(payload)))
        elif kind is Command.LAUNCH:
            launch = decode_launch(payload)
            self._check(launch)
            with self.streams.forward(), transfers_through(self.streams):
                self._run(launch)
        return kind is not Command.STOP

    def _session_limits(self, max_batch_tokens: int | None) -> LaunchLimits:
        cfg, b = self.config, self.backend
        budget = step_budget(cfg.kv_slots, max_batch_tokens)
        return LaunchLimits(cfg.kv_slots, cfg.request_slots, b.max_context_len, b.vocab_size, budget)

    def _lead(self, command: Callable[[], T]) -> T:
        """Rank 0's forward thread runs a command that collectives may end: a group that lost
        a peer cannot run another step, so this rank stops (its supervisor starts a new group)."""
        try:
            return command()
        except GroupBroken as exc:
            fail_stop(exc)

    def _lead_session(self, max_batch_tokens: int | None, limits: LaunchLimits) -> WorkerInfo:
        ranks = self.ranks
        if ranks is not None:
            self._lead(lambda: ranks.hand_session(max_batch_tokens))
        return self._reset_for_session(limits)

    def _reset_for_session(self, limits: LaunchLimits) -> WorkerInfo:
        # NOTE: runs on the forward thread, so every launch queued before it
        # counts in the previous session and none after it does; and on the
        # forward stream, ordered with the steps.
        with self.streams.forward():
            self._future.reset_all()
        self._slots.clear()
        self._live_after_last_step = False
        self._epoch += 1
        self._limits = limits
        self._last_step_id = 0
        self._steps_executed = 0
        self._out_of_order = 0
        self._future.sentinel_reads = 0
        return self.info

    def _complete(self, launch: Launch, pending: concurrent.futures.Future[_Enqueued]) -> StepResult:
        enqueued = pending.result()
        host, timing = enqueued.copy.wait()
        tokens, logprobs = unpack_from_host(host)
        self._account(launch, timing, enqueued.live_after)
        start, end = timing.forward_start, timing.forward_end
        return StepResult(launch.step_id, tokens, start, end, enqueued.epoch, logprobs)

    def _account(self, launch: Launch, timing: StepTiming, live_after: int) -> None:
        """Busy time per forward; the gap before it counts as idle if requests
        were live on the worker across it (the scheduler had work in hand)."""
        if self._live_after_last_step and self._last_forward_end is not None:
            gap = max(timing.forward_start - self._last_forward_end, 0.0)
            self.metrics.observe_gap(gap)
        self._last_forward_end = timing.forward_end
        self._live_after_last_step = live_after > 0
        self.metrics.live_slots.set(live_after)
        if not launch.num_rows:  # only released slots: no forward ran
            return
        mode = launch.forward_mode
        self.metrics.observe_forward(mode, timing.forward_seconds, timing.copy_seconds, launch.num_tokens)
        args = {"rows": launch.num_rows, "tokens": launch.num_tokens, "mode": mode}
        self.tracer.span(
            "device", f"forward {launch.step_id}", timing.forward_start, timing.forward_end, args
        )
        self.tracer.span("copy", f"copy {launch.step_id}", timing.forward_end, timing.copy_end)

    def _enqueue(self, launch: Launch, ticket: int) -> _Enqueued:
        if ticket != self._ticket:
            raise SessionEnded(f"step {launch.step_id}: its session ended before it ran")
        self._check(launch)
        return self._lead(lambda: self._run_and_copy(launch))

    def _check(self, launch: Launch) -> None:
        # NOTE: a launch is checked whole before anything is allocated for it
        # or any device tensor is indexed with its values. The order check
        # comes first, so an out-of-order launch counts whatever else it breaks.
        self._check_order(launch.step_id)
        check_launch(launch, self._limits)
        self._check_live_rows(launch)

    def _run_and_copy(self, launch: Launch) -> _Enqueued:
        if self.ranks is not None:
            self.ranks.hand_launch(launch)
        with self.streams.forward(), transfers_through(self.streams):
            sampled = self._run(launch)
            packed = self._no_tokens if sampled is None else pack_for_host(sampled)
            return _Enqueued(self.streams.copy_to_host(packed), len(self._slots.host), self._epoch)

    def _run(self, launch: Launch) -> Sampled | None:
        """The launch's slot deltas, then its forward unless it only releases slots."""
        self._apply_slot_deltas(launch)
        self._steps_executed += 1
        return self._forward(launch) if launch.num_rows else None

    def _forward(self, launch: Launch) -> Sampled:
        """The launch's batch forward and sampled; its ids go to the FutureMap and the history."""
        rows = _host_rows(launch)
        _plan_processing(launch, rows, self._slots.processing)
        on_device = _device_rows(launch, rows, self.streams)
        batch = self._build_batch(launch, rows, on_device)
        if rows.tracked:
            self._track_prompt_sourced(batch, on_device)
        sampled = self.backend.compute(batch, self._sampling(rows, on_device))
        # NOTE: counted in the step that sampled them, before any later launch reads the history.
        if rows.tracked:
            self._track_sampled(on_device, sampled.token_ids)
        self._future.store(on_device.sample_req_slots, sampled.token_ids)
        if self.ranks is not None and self.config.check_invariants:
            self.ranks.check_same_ids(sampled.token_ids)
        return sampled

    def _track_prompt_sourced(self, batch: ForwardBatch, on_device: _DeviceRows) -> None:
        """The history takes the prefill tokens `_plan_processing` picked, read on the device."""
        history = self._slots.processing.history
        slots, ids, positions = on_device.token_req_slots, batch.input_ids, on_device.positions
        tokens, outputs = on_device.history_token_index, on_device.history_output_index
        history.add_tokens(*(t.index_select(0, tokens) for t in (slots, positions, ids)))
        history.add_outputs(slots.index_select(0, outputs), ids.index_select(0, outputs))

    def _track_sampled(self, on_device: _DeviceRows, token_ids: torch.Tensor) -> None:
        """Each sampled id at the position it was sampled for, and counted."""
        history = self._slots.processing.history
        history.add_tokens(on_device.sample_req_slots, on_device.sample_positions, token_ids)
        history.add_outputs(on_device.sample_req_slots, token_ids)

    def _sampling(self, rows: _HostRows, on_device: _DeviceRows) -> RowSampling:
        plan = rows.plan
        processing = None
        if plan is not None and plan.processes:
            mask = (on_device.mask_rows, on_device.mask_ids)
            slots, positions = on_device.sample_req_slots, on_device.sample_positions
            processing = self._slots.processing.rows(slots, positions, plan, mask)
        return self._slots.rows(
            rows.sample_req_slots,
            on_device.sample_req_slots,
            on_device.sample_positions,
            processing,
            plan.top_logprobs if plan is not None else None,
        )

    def _check_order(self, step_id: int) -> None:
        if step_id != self._last_step_id + 1:
            self._out_of_order += 1
            raise LaunchError(f"step {step_id} launched after step {self._last_step_id}")
        self._last_step_id = step_id

    def _apply_slot_deltas(self, launch: Launch) -> None:
        if launch.released_slots:
            self._future.reset(self.streams.to_device(launch.released_slots))
            self._slots.release(launch.released_slots)
        if launch.new_requests:
            self._slots.register(launch.new_requests, self.streams)
            self._map_cached_prefixes(launch.new_requests)

    def _map_cached_prefixes(self, requests: list[NewRequest]) -> None:
        """A request's cached prefix: its first positions read the KV slots earlier requests
        computed (one transfer, only when some request has one)."""
        entries = [(r.req_slot, pos, kv) for r in requests for pos, kv in enumerate(r.prefix_kv_slots)]
        if not entries:
            return
        columns = [[e[0] for e in entries], [e[1] for e in entries], [e[2] for e in entries]]
        slots, positions, kv_slots = to_device_columns(columns, self.streams.device, self.streams)
        self._req_to_token.index_put_((slots, positions), kv_slots)

    def _check_live_rows(self, launch: Launch) -> None:
        """Every row's request slot is registered once the launch's slot deltas apply."""
        released = set(launch.released_slots)
        registered = {r.req_slot for r in launch.new_requests}
        for i, slot in enumerate(launch.row_req_slots):
            live = slot in registered or (slot in self._slots.host and slot not in released)
            if not live:
                raise LaunchError(f"row_req_slots[{i}]: request slot {slot} is not registered")

    def _build_batch(self, launch: Launch, rows: _HostRows, on_device: _DeviceRows) -> ForwardBatch:
        self._req_to_token.index_put_((on_device.token_req_slots, on_device.positions), on_device.kv_slots)
        return ForwardBatch(
            input_ids=self._input_ids(rows, on_device),
            positions=on_device.positions,
            out_kv_slots=on_device.kv_slots,
            row_req_slots=on_device.row_req_slots,
            row_token_starts=rows.row_token_starts,
            row_num_tokens=launch.row_num_tokens,
            row_ctx_lens=rows.row_ctx_lens,
            sample_token_index=on_device.sample_token_index,
            req_to_token=self._req_to_token,
        )

    def _input_ids(self, rows: _HostRows, on_device: _DeviceRows) -> torch.Tensor:
        """Prompt ids come from the host, decode ids from the FutureMap on the device."""
        if not rows.future_token_index:
            return on_device.prompt_ids
        from_future = self._future.read(on_device.future_req_slots)
        if not rows.prompt_token_index:
            return from_future
        ids = torch.empty(len(rows.positions), dtype=torch.int64, device=self.streams.device)
        ids.index_copy_(0, on_device.future_token_index, from_future)
        ids.index_copy_(0, on_device.prompt_token_index, on_device.prompt_ids)
        return ids
