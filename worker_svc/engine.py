"""The worker engine: executes launched batches strictly in launch order.

A launch goes through two single-thread executors:
  forward thread: (the one thread that runs torch's parallel work, worker_svc/forward_thread.py)
                  check the launch (worker_svc/launch_check.py), apply slot
                  deltas (worker_svc/slots.py), build the batch (worker_svc/rows.py:
                  decode inputs gathered from the FutureMap on the device),
                  forward, process the logits and sample
                  (worker_svc/logits_processors.py), store the sampled ids in the
                  FutureMap, start the copy to the host;
  copy thread:    wait for that copy, hand the ids (and log-probabilities) back,
                  account the step (worker_svc/accounting.py).
Both are FIFO, so batches run and complete in launch order, and batch k+1 can
be enqueued on the device while batch k's copy is awaited.

While a live request is penalized, each step updates the token history on the
forward stream, in launch order: registrations (a penalized one resets its
slot), then the launch's prompt-sourced tokens and its verify rows' drafts (at
their positions), then the rows' history is read and their logits processed (a
verify row's entry j counting drafts 1..j as outputs), then the sampled ids are
counted (a verify row's emitted ones only), in the same step,
so batch k+1 sees batch k's tokens though the scheduler has not seen them yet
(worker_svc/tracking.py).
Which rows are processed, masked (min_tokens) or get log-probabilities is
decided on the host; while no live slot has processing, a step runs none of it.

A step with a constrained sampling row (structured output) draws its other rows and stores
them in the FutureMap at once, then waits for its constrained rows' grammar masks, which the
grammar thread computes from each row's previous token while the forward runs, and draws those
rows under their masks (worker_svc/structured.py).

NOTE: the forward thread never waits for the device. Host values reach it only
through `DeviceStreams.to_device` (the model's through `transfers_through`), and
nothing on that thread reads a device value back (`.item()`, `.tolist()`,
`.cpu()`, `int(t)`), except the FutureMap sentinel check that
`--check-invariants` turns on, which synchronises by design. The one host wait
on it is for grammar masks, and only in a step with a constrained row: they
need the previous step's tokens, copied back by the copy thread.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from stepahead.protocol import Launch, StepLogprobs, StepResult, WorkerInfo
from stepahead.speculative import SpeculativeConfig
from stepahead.trace import NO_TRACE, Tracer
from worker_svc.accounting import StepAccounting
from worker_svc.backends import Draw, ModelBackend
from worker_svc.device_streams import DeviceStreams, PendingCopy, transfers_through
from worker_svc.forward_thread import COPY, enter_inference_mode, forward_thread, named
from worker_svc.launch_check import LaunchError, LaunchLimits, check_launch
from worker_svc.logits_processors import HostSampled, Sampled, pack_for_host, unpack_from_host
from worker_svc.ngram import NO_DRAFT
from worker_svc.ranks import (
    Command,
    GroupBroken,
    TensorParallelRanks,
    decode_launch,
    decode_session,
    fail_stop,
)
from worker_svc.rows import BatchBuilder, DeviceRows, HostRows, device_rows, host_rows, plan_processing
from worker_svc.session import EngineSession
from worker_svc.slots import RequestSlots
from worker_svc.speculative import EMITTED, FOUND, PROPOSED, Drafted, Lookup, Speculation, accept
from worker_svc.structured import ConstrainedRows, GrammarStep, GrammarThread, SlotGrammars
from worker_svc.telemetry import WorkerMetrics
from worker_svc.tracking import track_drafts, track_prompt_sourced, track_sampled

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


@dataclass(frozen=True)
class _Enqueued:
    copy: PendingCopy
    live_after: int  # request slots live once this launch has run
    epoch: int  # the session it ran in
    grammar: GrammarStep | None  # its constrained rows, whose tokens the matchers take
    entry_rows: list[int] | None = None  # with a verify row: each sampling entry's sampling row
    computed: Launch | None = None  # the launch as its forward ran it (rows resolved), if not as sent
    found: tuple[bool, ...] | None = None  # resolved rows: each sampling row's lookup found drafts
    entries: int = 0  # sampling entries in the copy (ahead of the scored prompt positions)


@dataclass(frozen=True)
class _Resolved:
    """A launch with its rows resolved on the host (`WorkerEngine._resolve_rows`), or as sent."""

    launch: Launch
    lookup: Lookup | None = None  # its verify rows' lookup
    found: tuple[bool, ...] | None = None  # resolved: each sampling row's lookup found drafts


@dataclass(frozen=True)
class _Ran:
    """A launch's sampled ids, and its constrained rows' way through the grammar thread."""

    sampled: Sampled | None
    grammar: GrammarStep | None = None
    entry_rows: list[int] | None = None  # with a verify row: each sampling entry's sampling row
    computed: Launch | None = None  # the launch as its forward ran it (rows resolved), if not as sent
    found: tuple[bool, ...] | None = None  # resolved rows: each sampling row's lookup found drafts


def _emitted_only(sampled: HostSampled) -> list[int]:
    """The sampled ids, a verify row's entries that emitted nothing as -1 (for the matchers)."""
    if sampled.states is None:
        return sampled.tokens
    return [t if s & EMITTED else -1 for t, s in zip(sampled.tokens, sampled.states, strict=True)]


def _draft_tokens(speculative: SpeculativeConfig | None) -> int:
    return 0 if speculative is None else speculative.num_speculative_tokens


class SessionEnded(RuntimeError):
    """A launch dropped unrun: its session ended while it waited its turn."""


class WorkerEngine:
    """The facade: sessions, launches and their results; rank 0 leads the other ranks, which
    follow. Its collaborators: `EngineSession`, `RequestSlots`, `BatchBuilder`, `StepAccounting`."""

    def __init__(
        self,
        backend: ModelBackend,
        config: EngineConfig,
        streams: DeviceStreams,
        tracer: Tracer = NO_TRACE,
        ranks: TensorParallelRanks | None = None,
        forward: concurrent.futures.ThreadPoolExecutor | None = None,
    ) -> None:
        """`forward`: the forward thread (worker_svc/forward_thread.py), a new one if None."""
        self.backend = backend
        self.config = config
        self.streams = streams
        self.tracer = tracer
        self.ranks = ranks  # None: one rank; else every command is handed to the others first
        self.metrics = WorkerMetrics(backend.name, str(streams.device))
        self.metrics.tensor_parallel_size.set(ranks.size if ranks is not None else 1)
        self._accounting = StepAccounting(self.metrics, tracer)
        device = streams.device
        backend.allocate_kv(config.kv_slots)
        self._slots = RequestSlots(
            config.request_slots, backend.vocab_size, backend.max_context_len, device, config.check_invariants
        )
        self._batches = BatchBuilder(self._slots, device)
        self._speculation = Speculation(
            config.request_slots, config.kv_slots, backend.max_context_len, device, config.check_invariants
        )
        self._no_tokens = torch.empty(0, dtype=torch.int64, device=device)
        # NOTE: built on its forward thread where the worker builds it (worker_svc/app.py)
        self._forward_thread = forward or forward_thread()
        self._forward_thread.submit(enter_inference_mode)
        self._copy_thread = named(COPY)
        self._session = EngineSession(
            config.kv_slots, config.request_slots, backend.max_context_len, backend.vocab_size
        )
        self._grammars = SlotGrammars()
        # NOTE: only rank 0 runs matchers; it shares its constrained rows' ids with the others.
        self._grammar_thread = None
        self._structured_unavailable = ""  # known at each session's start (`_reset_for_session`)
        if ranks is None or ranks.is_leader:
            self._grammar_thread = GrammarThread(
                backend.tokenizer,
                backend.vocab_size,
                backend.eos_token_ids,
                self.metrics,
                pin_masks=device.type == "cuda",
                check_invariants=config.check_invariants,
            )

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
            epoch=self._session.epoch,
            worker_unix_time=time.time(),
            tensor_parallel_size=self.ranks.size if self.ranks is not None else 1,
            structured_outputs_unavailable=self._structured_unavailable,
        )

    def stats(self) -> EngineStats:
        session = self._session
        return EngineStats(
            epoch=session.epoch,
            steps_executed=session.steps_executed,
            last_step_id=session.last_step_id,
            out_of_order_launches=session.out_of_order,
            sentinel_reads=self._slots.future.sentinel_reads,
            live_request_slots=self._slots.live,
        )

    def grammar_matchers(self) -> int:
        """Live grammar matchers, once the launches run so far have released theirs (0 on a
        rank other than 0, which runs none)."""
        if self._grammar_thread is None:
            return 0
        return self._grammar_thread.live()

    @property
    def launch_limits(self) -> LaunchLimits:
        """What the current session's launches are checked against."""
        return self._session.limits

    def begin_session(
        self, max_batch_tokens: int | None = None, speculative: SpeculativeConfig | None = None
    ) -> concurrent.futures.Future[WorkerInfo]:
        """Forget every request slot and counter, after all batches launched so far.

        `max_batch_tokens` is the step budget the scheduler announced for this
        session; None holds launches to a bound derived from the KV pool
        (`launch_check.step_budget`). ValueError, at once, if it is below 1.
        `speculative`: the session's speculative decoding (None: none).
        """
        limits = self._session.limits_for(max_batch_tokens, _draft_tokens(speculative))
        self._session.ticket += 1  # launches of the session before, still queued, are dropped
        return self._forward_thread.submit(self._lead_session, max_batch_tokens, speculative, limits)

    @property
    def session_ticket(self) -> int:
        """The ticket of the session begun last, for `submit` and `end_session`."""
        return self._session.ticket

    def end_session(self, ticket: int) -> None:
        """The session of `ticket` is over: its launches still queued are dropped unrun (their
        futures fail with SessionEnded), so the next session's steps wait behind none of them."""
        self._session.end(ticket)

    def submit(self, launch: Launch, ticket: int | None = None) -> concurrent.futures.Future[StepResult]:
        """Enqueue a launch of the session of `ticket` (None: the live one); the future
        resolves, in launch order, with its tokens."""
        ticket = self._session.ticket if ticket is None else ticket
        pending = self._forward_thread.submit(self._enqueue, launch, ticket)
        return self._copy_thread.submit(self._complete, launch, pending)

    def shutdown(self) -> None:
        if self.ranks is not None:  # after every launch queued so far: the other ranks stop too
            self._forward_thread.submit(self._lead, self.ranks.hand_stop).result()
        self._forward_thread.shutdown(wait=True, cancel_futures=True)
        self._copy_thread.shutdown(wait=True, cancel_futures=True)
        if self._grammar_thread is not None:
            self._grammar_thread.shutdown()

    def follow(self) -> None:
        """A rank other than 0: runs rank 0's commands, in its order, until it stops.

        NOTE: rank 0 hands on only launches that passed its checks, and every rank's state is
        the same, so these pass too; a rank that finds otherwise has diverged and stops.
        """
        assert self.ranks is not None and not self.ranks.is_leader
        self._forward_thread.submit(self._follow_all, self.ranks).result()

    def _follow_all(self, ranks: TensorParallelRanks) -> None:
        try:
            while self._follow_one(ranks):
                pass
        except GroupBroken as exc:
            fail_stop(exc)

    def _follow_one(self, ranks: TensorParallelRanks) -> bool:
        """Runs rank 0's next command; False once it is the stop."""
        kind, payload = ranks.receive()
        if kind is Command.SESSION:
            budget, speculative = decode_session(payload)
            limits = self._session.limits_for(budget, _draft_tokens(speculative))
            self._reset_for_session(limits, speculative)
        elif kind is Command.LAUNCH:
            launch = decode_launch(payload)
            self._check(launch)
            with self.streams.forward(), transfers_through(self.streams):
                self._run(launch)
        return kind is not Command.STOP

    def _lead(self, command: Callable[[], T]) -> T:
        """Rank 0's forward thread runs a command that collectives may end: a group that lost
        a peer cannot run another step, so this rank stops (its supervisor starts a new group)."""
        try:
            return command()
        except GroupBroken as exc:
            fail_stop(exc)

    def _lead_session(
        self, max_batch_tokens: int | None, speculative: SpeculativeConfig | None, limits: LaunchLimits
    ) -> WorkerInfo:
        ranks = self.ranks
        if ranks is not None:
            self._lead(lambda: ranks.hand_session(max_batch_tokens, speculative))
        return self._reset_for_session(limits, speculative)

    def _reset_for_session(self, limits: LaunchLimits, speculative: SpeculativeConfig | None) -> WorkerInfo:
        # NOTE: runs on the forward thread, so every launch queued before it
        # counts in the previous session and none after it does; and on the
        # forward stream (`RequestSlots.reset`), ordered with the steps.
        self._slots.reset(self.streams)
        self._speculation.config = speculative
        self._grammars.clear()
        if self._grammar_thread is not None:
            # NOTE: waits for the grammar tokenizer's build (under the session's keepalives), so
            # that the Welcome can say whether constrained requests can be served at all.
            self._structured_unavailable = self._grammar_thread.unavailable()
            self._grammar_thread.clear()
        self._accounting.new_session()
        self._session.reset(limits)
        return self.info

    def _complete(self, launch: Launch, pending: concurrent.futures.Future[_Enqueued]) -> StepResult:
        enqueued = pending.result()
        grammar = enqueued.grammar
        try:
            host, timing = enqueued.copy.wait()
        except BaseException as exc:
            if grammar is not None:
                grammar.fail(exc)
            raise
        scored = None
        if launch.row_score and (positions := launch.num_scored):
            scored = (enqueued.entries, positions, launch.score_top_n)
        sampled = unpack_from_host(host, enqueued.entry_rows is not None, scored)
        finished: tuple[int, ...] = ()
        if grammar is not None:  # the matchers take the tokens; some may finish with them
            grammar.tokens.set_result(_emitted_only(sampled))
            finished = grammar.finished.result()
        self._accounting.account(enqueued.computed or launch, timing, enqueued.live_after)
        start, end = timing.forward_start, timing.forward_end
        if enqueued.entry_rows is None:
            return StepResult(
                launch.step_id,
                sampled.tokens,
                start,
                end,
                enqueued.epoch,
                sampled.logprobs,
                grammar_finished=finished,
                drafts_found=enqueued.found or (),
                prompt_logprobs=sampled.scores,
            )
        verified = self._verified_result(
            launch.step_id, sampled, enqueued.entry_rows, finished, start, end, enqueued.epoch, enqueued.found
        )
        return dataclasses.replace(verified, prompt_logprobs=sampled.scores)

    def _verified_result(
        self,
        step_id: int,
        sampled: HostSampled,
        entry_rows: list[int],
        grammar_entries: tuple[int, ...],
        start: float,
        end: float,
        epoch: int,
        resolved_found: tuple[bool, ...] | None = None,
    ) -> StepResult:
        """A step with verify rows: each sampling row's emitted entries, in row order;
        `resolved_found`: what each sampling row's lookup found, where the rows were resolved
        on the host (else the entries' FOUND bits tell)."""
        states = sampled.states
        assert states is not None
        emitted: list[int] = []
        counts = [0] * (entry_rows[-1] + 1)
        proposed = [0] * len(counts)
        found = [False] * len(counts)
        # A row's tokens end with the one that finished its grammar: no token can follow it.
        last_entry = {entry_rows[i]: i for i in grammar_entries}
        for i, (row, state) in enumerate(zip(entry_rows, states, strict=True)):
            if state & EMITTED and i <= last_entry.get(row, i):
                emitted.append(i)
                counts[row] += 1
            if state & PROPOSED:
                proposed[row] += 1
            if state & FOUND:
                found[row] = True
        drafting = [row for row, n in enumerate(proposed) if n]
        self._accounting.speculated(len(drafting), sum(proposed), sum(counts[row] - 1 for row in drafting))
        lp = sampled.logprobs
        logprobs = None
        if lp is not None:
            n = lp.top_n
            logprobs = StepLogprobs(
                [lp.chosen[i] for i in emitted],
                n,
                [t for i in emitted for t in lp.top_ids[i * n : (i + 1) * n]],
                [t for i in emitted for t in lp.top_logprobs[i * n : (i + 1) * n]],
            )
        return StepResult(
            step_id,
            [sampled.tokens[i] for i in emitted],
            start,
            end,
            epoch,
            logprobs,
            grammar_finished=tuple(entry_rows[i] for i in grammar_entries),
            token_counts=tuple(counts),
            drafts_found=tuple(found) if resolved_found is None else resolved_found,
        )

    def _enqueue(self, launch: Launch, ticket: int) -> _Enqueued:
        if ticket != self._session.ticket:
            raise SessionEnded(f"step {launch.step_id}: its session ended before it ran")
        self._check(launch)
        return self._lead(lambda: self._run_and_copy(launch))

    def _check(self, launch: Launch) -> None:
        # NOTE: a launch is checked whole before anything is allocated for it
        # or any device tensor is indexed with its values. The order check
        # comes first, so an out-of-order launch counts whatever else it breaks.
        self._session.check_order(launch.step_id)
        check_launch(launch, self._session.limits)
        self._slots.check_live_rows(launch)

    def _run_and_copy(self, launch: Launch) -> _Enqueued:
        if self.ranks is not None:
            self.ranks.hand_launch(launch)
        with self.streams.forward(), transfers_through(self.streams):
            ran = self._run(launch)
            packed = self._no_tokens if ran.sampled is None else pack_for_host(ran.sampled)
            copy = self.streams.copy_to_host(packed)
        if ran.grammar is not None and self._grammar_thread is not None:
            # NOTE: handed on only once nothing of the step can fail here (the copy thread
            # always answers it), and before the next launch's deltas and masks: launch order.
            self._grammar_thread.advance(ran.grammar)
        entries = 0 if ran.sampled is None else ran.sampled.token_ids.shape[0]
        return _Enqueued(
            copy,
            self._slots.live,
            self._session.epoch,
            ran.grammar,
            ran.entry_rows,
            ran.computed,
            ran.found,
            entries,
        )

    def _run(self, launch: Launch) -> _Ran:
        """The launch's slot deltas, then its forward unless it only releases slots."""
        self._slots.apply_deltas(launch, self.streams)
        released, registered = self._grammars.apply(launch)
        if self._grammar_thread is not None:
            self._grammar_thread.deltas(released, registered)
        self._session.steps_executed += 1
        return self._forward(launch) if launch.num_rows else _Ran(None)

    def _forward(self, launch: Launch) -> _Ran:
        """The launch's batch forward and draws; its ids go to the FutureMap and the history."""
        speculation = self._speculation
        resolved = self._resolve_rows(launch)
        sent, launch, lookup = launch, resolved.launch, resolved.lookup
        rows = host_rows(
            launch, speculation.draft_tokens, self.backend.max_context_len, resolved.found is not None
        )
        plan_processing(launch, rows, self._slots.table.processing)
        on_device = device_rows(launch, rows, self.streams)
        drafted = self._draft(rows, on_device, lookup) if rows.verify_rows else None
        batch = self._batches.batch(launch, rows, on_device, drafted)
        if speculation.config is not None:
            speculation.record_inputs(batch.out_kv_slots, batch.input_ids)
        history = self._slots.table.processing.history
        if rows.tracked:
            track_prompt_sourced(history, batch, on_device)
            if drafted is not None:
                track_drafts(history, on_device.verify_req_slots, drafted)
        constrained = self._grammars.rows(rows.sample_req_slots)
        masks = None
        if constrained is not None and drafted is not None:
            places = dict(zip(rows.verify_sample_index, rows.verify_flat_index, strict=True))
            constrained = constrained.placed(places, speculation.draft_tokens + 1)
        if constrained is not None and self._grammar_thread is not None:
            # NOTE: asked before the forward: where the forward thread is the device (the CPU),
            # the grammar thread fills the masks while it computes.
            drafts = None
            if drafted is not None and constrained.verifying:
                drafts = self.streams.early_to_host(drafted.drafts)
            masks = self._grammar_thread.masks(constrained, drafts)
        draw = self.backend.compute(batch, self._batches.sampling(rows, on_device, drafted))
        ids = draw.sample()
        entry_state = None
        grammar = None
        if drafted is not None:
            # NOTE: a constrained verify row's entries are drawn under their masks before its
            # drafts are checked against them.
            if constrained is not None:
                grammar = self._draw_constrained(draw, constrained, masks, ids)
            entry_state = self._store_verified(rows, on_device, drafted, ids)
        else:
            # NOTE: every row not constrained is final: in the FutureMap at once.
            self._slots.future.store(on_device.sample_req_slots, ids)
            if speculation.config is not None:
                speculation.record_sampled(on_device.sample_req_slots, on_device.sample_positions)
            if constrained is not None:
                grammar = self._draw_constrained(draw, constrained, masks, ids, on_device.sample_req_slots)
        # NOTE: counted in the step that sampled them, before any later launch reads the history.
        if rows.tracked:
            emitted = None if entry_state is None else (entry_state & EMITTED).to(torch.int32)
            track_sampled(history, on_device, ids, emitted)
        if self.ranks is not None and self.config.check_invariants:
            self.ranks.check_same_ids(ids)
        entry_rows = rows.entry_rows if drafted is not None else None
        computed = None if launch is sent else launch
        scores = draw.scores(on_device.score_targets, launch.score_top_n) if rows.score_token_index else None
        sampled = Sampled(ids, draw.logprobs(ids), entry_state, scores)
        return _Ran(sampled, grammar, entry_rows, computed, resolved.found)

    def _draft(self, rows: HostRows, on_device: DeviceRows, lookup: Lookup | None) -> Drafted:
        """The launch's rows at device-held positions: their pending tokens, drafts (for the
        verify rows) and positions, on the device; `lookup`: theirs, when already made."""
        if lookup is None:
            lookup = self._look_up(on_device.verify_req_slots, rows.verify_width)
        drafting = on_device.verify_drafting if any(rows.verify_drafting) else None
        drafted = self._speculation.draft(lookup, drafting)
        sampled_at = (drafted.positions + 1).clamp(max=self.backend.max_context_len)
        flat = on_device.verify_flat_index
        on_device.sample_positions.index_copy_(
            0, on_device.verify_sample_index, drafted.flat(sampled_at, flat)
        )
        return drafted

    def _look_up(self, slots: torch.Tensor, width: int) -> Lookup:
        pending = self._slots.future.read(slots)
        return self._speculation.look_up(slots, pending, self._slots.req_to_token, width)

    def _resolve_rows(self, launch: Launch) -> _Resolved:
        """Where the host reads device values at no cost (`DeviceStreams.host_reads_free`: the
        CPU), the rows read from the FutureMap at the positions the device holds, each a verify
        row of its pending token and the drafts its lookup proposes, or a plain decode row
        where it proposes none or the row carries none; elsewhere `launch` as it is.

        NOTE: the scheduler reserves K + 1 positions for a verify row knowing neither whether
        the lookup will find drafts (it learns what the last one found a step or two late) nor
        how many, and sends every row of a drafting request at a bound on its position. Where
        a forward's cost grows with its tokens (a CPU) a position with no draft costs as much
        as one with, so none is computed: the row's unused KV slots stay unwritten and go back
        when the scheduler learns how many drafts were accepted; and a row with no draft runs
        as a plain decode row. Elsewhere (a GPU) the positions cost little, and the forward
        thread never waits on the device."""
        if not self._speculation.draft_tokens or not self.streams.host_reads_free:
            return _Resolved(launch)
        future = [i for i, from_future in enumerate(launch.row_from_future) if from_future]
        if not future:
            return _Resolved(launch)
        context = self.backend.max_context_len
        width = max(min(launch.row_start_pos[i] + 1, context) for i in future)
        slots = [launch.row_req_slots[i] for i in future]
        forced = self._ask_forced(slots)
        lookup = self._look_up(self.streams.to_device(slots), width)
        bases = lookup.base.tolist()  # NOTE: no wait: the forward thread is the device
        if forced is not None:
            self._force_drafts(lookup, bases, *forced, context)
        counts = lookup.proposal.counts.tolist()
        sizes, starts = list(launch.row_num_tokens), list(launch.row_start_pos)
        verifying: list[int] = []
        found = dict.fromkeys(range(launch.num_rows), False)
        for j, (i, count, base) in enumerate(zip(future, counts, bases, strict=True)):
            found[i] = count > 0
            starts[i] = base
            sizes[i] = 1 + count if sizes[i] > 1 else 1
            if sizes[i] > 1:
                verifying.append(j)
        kv_slots: list[int] = []
        at = 0
        for n, keep in zip(launch.row_num_tokens, sizes, strict=True):
            kv_slots += launch.kv_slots[at : at + keep]
            at += n
        resolved = dataclasses.replace(launch, row_start_pos=starts, row_num_tokens=sizes, kv_slots=kv_slots)
        sampling_found = tuple(found[i] for i, sample in enumerate(launch.row_sample) if sample)
        if not verifying:
            return _Resolved(resolved, None, sampling_found)
        return _Resolved(resolved, lookup.select(self.streams.to_device(verifying)), sampling_found)

    def _ask_forced(
        self, slots: list[int]
    ) -> tuple[list[int], concurrent.futures.Future[list[list[int]]]] | None:
        """Which of the rows of request `slots` are constrained, and the tokens their grammars
        force next, on the way (one rank only: the other ranks have no matchers to agree on)."""
        grammar = self._grammar_thread
        if grammar is None or self.ranks is not None or not len(self._grammars):
            return None
        rows = [j for j, slot in enumerate(slots) if slot in self._grammars]
        if not rows:
            return None
        return rows, grammar.forced([slots[j] for j in rows], self._speculation.draft_tokens)

    def _force_drafts(
        self,
        lookup: Lookup,
        bases: list[int],
        rows: list[int],
        forced: concurrent.futures.Future[list[list[int]]],
        context: int,
    ) -> None:
        """A constrained row whose grammar forces its next tokens drafts them, in place of what
        the lookup found: the entry before each can draw nothing else, so each is accepted.

        NOTE: the grammar thread answers once it has taken the last step's tokens: its copy is
        on the host as soon as its forward ends (the CPU), and the masks, which take the
        longer, are still filled while this step's forward runs."""
        tokens, counts = lookup.proposal.tokens, lookup.proposal.counts
        for j, drafts in zip(rows, forced.result(), strict=True):
            drafts = drafts[: max(context - 1 - bases[j], 0)]
            if drafts:
                tokens[j].fill_(NO_DRAFT)
                tokens[j, : len(drafts)] = torch.tensor(drafts, dtype=tokens.dtype)
                counts[j] = len(drafts)

    def _store_verified(
        self, rows: HostRows, on_device: DeviceRows, drafted: Drafted, ids: torch.Tensor
    ) -> torch.Tensor:
        """A step with verify rows: each row's last emitted token to the FutureMap, and its
        pending position; returns each sampling entry's state."""
        speculation = self._speculation
        plain = on_device.plain_sample_index
        if rows.plain_sample_index:
            plain_slots = on_device.sample_req_slots.index_select(0, plain)
            self._slots.future.store(plain_slots, ids.index_select(0, plain))
            speculation.record_sampled(plain_slots, on_device.sample_positions.index_select(0, plain))
        flat = on_device.verify_flat_index
        sampled = torch.zeros_like(drafted.positions)  # [Bv, K + 1]: a decode row's one entry first
        sampled.view(-1).index_copy_(0, flat, ids.index_select(0, on_device.verify_sample_index))
        accepted = accept(drafted, sampled)
        self._slots.future.store(on_device.verify_req_slots, accepted.last)
        speculation.record_accepted(on_device.verify_req_slots, drafted, accepted)
        state = torch.full_like(ids, EMITTED)
        state.index_copy_(0, on_device.verify_sample_index, drafted.flat(accepted.entry_state, flat))
        return state

    def _draw_constrained(
        self,
        draw: Draw,
        constrained: ConstrainedRows,
        masks: concurrent.futures.Future[torch.Tensor] | None,
        ids: torch.Tensor,
        slots: torch.Tensor | None = None,
    ) -> GrammarStep | None:
        """The constrained rows' ids, drawn under their `masks`, into `ids` and, with the
        sampling rows' `slots`, the FutureMap; on rank 0, the step that hands their tokens on
        to its matchers."""
        index = self.streams.to_device(constrained.rows)
        grammar = self._grammar_thread
        if grammar is None or masks is None:  # another rank: rank 0 drew them
            masked = torch.empty(len(constrained.rows), dtype=torch.int64, device=self.streams.device)
        else:
            waited = time.perf_counter()
            bitmask = masks.result()
            self.metrics.grammar_wait.inc(time.perf_counter() - waited)
            masked = draw.sample_masked(constrained.rows, index, self.streams.tensor_to_device(bitmask))
        if self.ranks is not None:
            self.ranks.share_ids(masked)
        ids.index_copy_(0, index, masked)
        if slots is not None:
            self._slots.future.store(slots.index_select(0, index), masked)
        if grammar is None:
            return None
        return GrammarStep(constrained)
