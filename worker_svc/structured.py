"""Structured outputs on the worker: the matchers beside the sampler, and when each step waits.

The mask that constrains a row's token k+1 depends on its token k. The worker has token k on
its host the moment the step that sampled it is copied back, so the matcher advances then and
the row's next mask is computed on the grammar thread while the device runs forward k+1; no
scheduler round trip, so this holds at any overlap depth and over any link.

Per launch, the forward thread hands the grammar thread, in launch order (one FIFO thread, so
no ordering is left to chance):
  deltas   the launch's released and registered constrained slots (a registration replays a
           recompute's output tokens into its fresh matcher);
  masks    the bitmask of the launch's constrained sampling rows; it waits behind the advance
           of every earlier launch, i.e. it has each row's previous token;
  advance  the rows' tokens once the copy thread has them (`GrammarStep.tokens`): each matcher
           takes its token, and the rows whose grammar it finished are reported.
The forward thread samples every other row of the step at once and waits only for the masks of
a step that has a constrained sampling row. A row whose grammar has finished takes no more
tokens: the scheduler ends it on the step result that says so, and the token its slot draws
meanwhile (from EOS alone) is dropped like any token of a finished request.

Only tensor-parallel rank 0 runs matchers (compiles grammars, fills masks) and draws the
constrained rows; it broadcasts their ids, so every rank's FutureMap holds the same tokens
(`SlotGrammars` tells each rank which rows those are).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from stepahead.grammars import GrammarError, compile_stats
from stepahead.protocol import GrammarConstraint, Launch, TokenizerSpec
from worker_svc.forward_thread import named
from worker_svc.grammar import MatcherTable, grammar_tokenizer, new_bitmask
from worker_svc.telemetry import WorkerMetrics

__all__ = ["ConstrainedRows", "GrammarStep", "GrammarThread", "SlotGrammars"]

log = logging.getLogger("stepahead.worker.grammar")


@dataclass(frozen=True)
class ConstrainedRows:
    """A step's sampling rows whose slot has a grammar: their indexes among the sampling rows
    (ascending) and their slots. Under speculative decoding the sampling rows are entries (a
    verify row has K + 1, worker_svc/speculative.py), and `places` gives each one's place in
    the [Bv, K + 1] grid of the step's verify rows (-1: not a verify row's), `width` K + 1."""

    rows: list[int]
    slots: list[int]
    places: list[int] = field(default_factory=list)  # empty: no verify row among them
    width: int = 0

    def placed(self, flat_of_entry: dict[int, int], width: int) -> ConstrainedRows:
        """These rows with their places (`flat_of_entry`: a verify row entry's place)."""
        places = [flat_of_entry.get(row, -1) for row in self.rows]
        return ConstrainedRows(self.rows, self.slots, places, width)

    @property
    def verifying(self) -> bool:
        return any(place >= 0 for place in self.places)


class SlotGrammars:
    """Which request slots are constrained: the forward thread's view, kept on every rank."""

    def __init__(self) -> None:
        self._slots: set[int] = set()

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, slot: int) -> bool:
        return slot in self._slots

    def apply(self, launch: Launch) -> tuple[list[int], list[tuple[int, GrammarConstraint]]]:
        """The launch's slot deltas: constrained slots released, and registered (a slot
        registered again, plain or constrained, loses its earlier grammar)."""
        released = [s for s in launch.released_slots if s in self._slots]
        renewed = [r.req_slot for r in launch.new_requests if r.req_slot in self._slots]
        self._slots.difference_update(launch.released_slots)
        self._slots.difference_update(renewed)
        registered = [(r.req_slot, r.grammar) for r in launch.new_requests if r.grammar is not None]
        self._slots.update(slot for slot, _ in registered)
        return released + renewed, registered

    def rows(self, sample_req_slots: Sequence[int]) -> ConstrainedRows | None:
        if not self._slots:
            return None
        rows = [i for i, slot in enumerate(sample_req_slots) if slot in self._slots]
        if not rows:
            return None
        return ConstrainedRows(rows, [sample_req_slots[i] for i in rows])

    def clear(self) -> None:
        self._slots.clear()


@dataclass(eq=False)
class GrammarStep:
    """One launch's constrained rows on their way through the grammar thread: the copy thread
    sets `tokens` (every sampling row's id, on the host), the grammar thread answers `finished`
    (the sampling rows whose grammar the step's token finished)."""

    rows: ConstrainedRows
    tokens: concurrent.futures.Future[list[int]] = field(default_factory=concurrent.futures.Future)
    finished: concurrent.futures.Future[tuple[int, ...]] = field(default_factory=concurrent.futures.Future)

    def fail(self, exc: BaseException) -> None:
        """The step will not complete: the grammar thread must not wait for its tokens."""
        if not self.tokens.done():
            self.tokens.set_exception(exc)


class MaskViolation(RuntimeError):
    """A constrained row drew a token its grammar does not allow (an engine bug)."""


class GrammarThread:
    """Rank 0's matchers and the one thread that changes them. `check_invariants` turns a drawn
    token outside its row's mask into a failed step; otherwise the row is ended (reported
    finished) and the violation counted and logged."""

    def __init__(
        self,
        tokenizer: TokenizerSpec,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        metrics: WorkerMetrics,
        pin_masks: bool,
        check_invariants: bool,
    ) -> None:
        self._vocab_size = vocab_size
        self._metrics = metrics
        self._pin = pin_masks
        self._check = check_invariants
        self._thread = named("grammar")
        self._table: MatcherTable | None = None
        self._pending: set[GrammarStep] = set()  # advances waiting for their step's tokens
        self._pending_lock = threading.Lock()
        self._closed = False
        self._broken: set[int] = set()  # constrained slots whose grammar could not start
        self._compiled = compile_stats()
        # NOTE: building llguidance's tokenizer takes seconds for a large vocabulary; it starts
        # with the worker, off the forward thread, so the first constrained request finds it.
        self._built = self._thread.submit(self._build_table, tokenizer, eos_token_ids)

    def _build_table(self, tokenizer: TokenizerSpec, eos_token_ids: tuple[int, ...]) -> None:
        start = time.perf_counter()
        try:
            llg = grammar_tokenizer(tokenizer, self._vocab_size, eos_token_ids)
        except (ValueError, RuntimeError) as exc:  # llguidance's refusal of this tokenizer
            # NOTE: a table without matchers: a constrained request that reaches the worker anyway
            # (a scheduler that did not refuse it) ends with its first token, the step goes on.
            refusal = f"the grammar engine cannot read this model's tokenizer ({exc})"
            self._table = MatcherTable(None, self._vocab_size, refusal)
            log.error("structured outputs and tool calls are off: %s", refusal)
            return
        self._table = MatcherTable(llg, self._vocab_size)
        log.info("grammar tokenizer ready in %.2f s", time.perf_counter() - start)

    def unavailable(self) -> str:
        """Why no grammar can be served ("": they can), once the tokenizer is built; the scheduler
        learns it with each session's Welcome and refuses constrained requests at admission."""
        self._built.result()
        return self.table.refusal

    @property
    def table(self) -> MatcherTable:
        assert self._table is not None, "the tokenizer is built by the first job"
        return self._table

    # ---- from the forward thread, in launch order -------------------------------------------

    def deltas(self, released: list[int], registered: list[tuple[int, GrammarConstraint]]) -> None:
        if released or registered:
            self._thread.submit(self._apply_deltas, released, registered)

    def masks(
        self, rows: ConstrainedRows, drafts: Callable[[], torch.Tensor] | None = None
    ) -> concurrent.futures.Future[torch.Tensor]:
        """The rows' bitmask [C, words] int32 on the host; `drafts` gives the step's verify rows'
        drafts [Bv, K] on the host, when some of the rows are theirs."""
        if drafts is None or not rows.verifying:
            return self._thread.submit(self._fill_masks, rows.slots)
        return self._thread.submit(self._fill_verify_masks, rows, drafts)

    def forced(self, slots: list[int], limit: int) -> concurrent.futures.Future[list[list[int]]]:
        """The tokens each slot's grammar forces next, up to `limit`, once every earlier
        launch's tokens are taken (a slot with no live matcher: none)."""
        return self._thread.submit(self._forced, slots, limit)

    def advance(self, step: GrammarStep) -> None:
        with self._pending_lock:
            self._pending.add(step)
        self._thread.submit(self._advance, step)

    def clear(self) -> None:
        self._thread.submit(self._clear)

    def shutdown(self) -> None:
        """After the forward and copy threads: a step whose copy never ran releases its advance,
        and every job handed so far runs (none waits any more), so the matchers left are those
        of slots still registered.

        NOTE: queued jobs are not cancelled: a cancelled release left its slot's matcher
        behind (a drained engine counted a live matcher after its shutdown)."""
        with self._pending_lock:
            pending = list(self._pending)
        for step in pending:
            step.fail(RuntimeError("the worker engine shut down"))
        self._thread.shutdown(wait=True)
        self._closed = True

    def live(self) -> int:
        """How many matchers live, after every job handed so far."""
        if self._closed:  # its thread has finished every job
            return len(self.table)
        return self._thread.submit(lambda: len(self.table)).result()

    # ---- on the grammar thread ----------------------------------------------------------------

    def _apply_deltas(self, released: list[int], registered: list[tuple[int, GrammarConstraint]]) -> None:
        table = self.table
        for slot in released:
            table.release(slot)
            self._broken.discard(slot)
        for slot, grammar in registered:
            table.release(slot)
            self._broken.discard(slot)
            try:
                table.start(slot, grammar.constraint, list(grammar.replay_ids))
            except GrammarError:
                # NOTE: the frontend compiled it before admission and the replayed tokens were
                # drawn under it, so this is a fault: the request ends with its first token.
                log.exception("slot %d: its grammar could not start; the request is ended", slot)
                table.release(slot)
                self._broken.add(slot)
        self._metrics.grammar_matchers.set(len(table))
        self._note_compiles()

    def _fill_masks(self, slots: list[int]) -> torch.Tensor:
        start = time.perf_counter()
        table = self.table
        bitmask = new_bitmask(len(slots), self._vocab_size, self._pin)
        live = [i for i, slot in enumerate(slots) if slot in table]
        if len(live) == len(slots):
            table.fill_masks(slots, bitmask)
        elif live:  # a slot whose grammar could not start draws unconstrained (all bits set)
            some = new_bitmask(len(live), self._vocab_size)
            table.fill_masks([slots[i] for i in live], some)
            bitmask[live] = some
        self._metrics.grammar_mask_seconds.observe(time.perf_counter() - start)
        self._metrics.grammar_masked_rows.inc(len(slots))
        return bitmask

    def _fill_verify_masks(self, rows: ConstrainedRows, drafts: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Masks for a step with verify rows. Entry j of a verify row samples the token after
        its pending token and drafts d1 .. dj, so its mask is its matcher's after taking those
        drafts for now (rolled back once the row's masks are filled). Past a draft its grammar
        refuses, the entries keep every token allowed: the entry before it cannot draw that
        draft, so none of them is emitted (worker_svc/speculative.py: `accept`)."""
        start = time.perf_counter()
        table = self.table
        grid = drafts().tolist()
        bitmask = new_bitmask(len(rows.slots), self._vocab_size, self._pin)
        taken = 0  # drafts the current verify row's matcher holds for now
        live = False  # whether its drafts still pass its grammar
        slot = -1
        for i, (entry_slot, place) in enumerate(zip(rows.slots, rows.places, strict=True)):
            j = place % rows.width if place >= 0 else 0
            if j == 0:  # a row's first entry: its matcher as the step found it
                if taken:
                    table.rollback(slot, taken)
                slot, taken = entry_slot, 0
                live = slot in table  # a slot whose grammar could not start draws unconstrained
                if live:
                    table.fill_mask(slot, bitmask, i)
                continue
            draft = grid[place // rows.width][j - 1]  # NO_DRAFT (negative) past the row's count
            live = live and draft >= 0 and table.try_draft(slot, draft)
            if live:
                taken += 1
                table.fill_mask(slot, bitmask, i)
        if taken:
            table.rollback(slot, taken)
        self._metrics.grammar_mask_seconds.observe(time.perf_counter() - start)
        self._metrics.grammar_masked_rows.inc(len(rows.slots))
        return bitmask

    def _forced(self, slots: list[int], limit: int) -> list[list[int]]:
        table = self.table
        return [table.forced(slot, limit) if slot in table else [] for slot in slots]

    def _advance(self, step: GrammarStep) -> None:
        try:
            tokens = step.tokens.result()
            step.finished.set_result(self._take_tokens(step.rows, tokens))
        except BaseException as exc:
            step.finished.set_exception(exc)
        finally:
            with self._pending_lock:
                self._pending.discard(step)

    def _take_tokens(self, rows: ConstrainedRows, tokens: list[int]) -> tuple[int, ...]:
        table = self.table
        finished: list[int] = []
        for row, slot in zip(rows.rows, rows.slots, strict=True):
            if slot in self._broken:
                self._broken.discard(slot)
                finished.append(row)
                continue
            if tokens[row] < 0:
                continue  # a verify row's entry that emitted nothing
            if slot not in table or table.finished(slot):
                continue  # released, or finished with an earlier token: this token is dropped
            try:
                done = table.advance(slot, tokens[row])
            except GrammarError as exc:
                if self._check:
                    raise MaskViolation(f"sampling row {row}: {exc}") from exc
                self._metrics.grammar_violations.inc()
                log.error("sampling row %d: %s; the request is ended", row, exc)
                table.release(slot)
                done = True
            if done:
                finished.append(row)
        return tuple(finished)

    def _clear(self) -> None:
        self.table.clear()
        self._broken.clear()
        self._metrics.grammar_matchers.set(0)

    def _note_compiles(self) -> None:
        now = compile_stats()
        seen, self._compiled = self._compiled, now
        compiled = now.compiled - seen.compiled
        for _ in range(compiled):
            self._metrics.grammar_compile_seconds.observe((now.seconds - seen.seconds) / compiled)
        self._metrics.grammar_compile_cache_hits.inc(now.cache_hits - seen.cache_hits)
