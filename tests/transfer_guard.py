"""A guard on the worker's forward thread: host values enter the device, and device values
leave it, only through the engine's `DeviceStreams`; and a scripted run of launches to guard.

`guard_engine` puts the guard around `WorkerEngine._enqueue`, the forward thread's work for
a launch. While it runs, every torch call is checked (a `TorchFunctionMode`, which sees torch
functions, tensor methods and `int(t)`-style conversions); calls made inside the streams'
own `to_device` and `copy_to_host` are allowed. It does not depend on the device: on the CPU
it catches the call that would be a hidden transfer or sync on CUDA.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

import worker_svc.sampler
from stepahead.protocol import Constraint, GrammarConstraint, Launch, NewRequest
from worker_svc.engine import WorkerEngine

# Host data entering a tensor, or a device value read back to the host.
FORBIDDEN = {
    "tensor",
    "as_tensor",
    "asarray",
    "new_tensor",
    "item",
    "tolist",
    "cpu",
    "cuda",
    "numpy",
    "pin_memory",
    "__int__",
    "__float__",
    "__bool__",
    "__index__",
    "__complex__",
    "__array__",
}
# Not torch functions: patched, checked only on a guarded thread.
PATCHED: tuple[tuple[Any, str], ...] = (
    (torch, "from_numpy"),
    (torch, "frombuffer"),
    (torch.cuda, "synchronize"),
    (torch.cuda.Stream, "synchronize"),
    (torch.cuda.Event, "synchronize"),
)


def _moves_between_devices(name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    if name == "to":
        targets = [*args[1:], kwargs.get("device"), kwargs.get("other")]
        return any(isinstance(t, torch.device | str | int | torch.Tensor) for t in targets if t is not None)
    if name == "copy_":
        dst, src = args[0], args[1]
        return isinstance(src, torch.Tensor) and src.device != dst.device
    return False


def _caller() -> str:
    """The innermost frame outside torch and this module."""
    for frame in reversed(traceback.extract_stack()):
        if "/torch/" not in frame.filename and not frame.filename.endswith("transfer_guard.py"):
            return f"{'/'.join(frame.filename.rsplit('/', 2)[-2:])}:{frame.lineno} {frame.name}"
    return "?"


class TransferGuard(TorchFunctionMode):
    """Records each forbidden call made on a guarded thread outside an allowed block."""

    def __init__(self) -> None:
        super().__init__()
        self.violations: list[str] = []
        self._local = threading.local()

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in FORBIDDEN or _moves_between_devices(name, args, kwargs):
            self.note(name)
        return func(*args, **kwargs)

    def note(self, name: str) -> None:
        if self.guarding:
            self.violations.append(f"{name} at {_caller()}")

    @property
    def guarding(self) -> bool:
        return getattr(self._local, "depth", 0) > 0 and not getattr(self._local, "allowed", 0)

    @contextlib.contextmanager
    def guarded(self) -> Iterator[None]:
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            with self:
                yield
        finally:
            self._local.depth -= 1

    @contextlib.contextmanager
    def allowed(self) -> Iterator[None]:
        self._local.allowed = getattr(self._local, "allowed", 0) + 1
        try:
            yield
        finally:
            self._local.allowed -= 1

    def allowing(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            with self.allowed():
                return fn(*args, **kwargs)

        return call

    def noting(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.note(name)
            return fn(*args, **kwargs)

        return call


def guard_engine(engine: WorkerEngine, monkeypatch: pytest.MonkeyPatch) -> TransferGuard:
    """Guard the forward thread's work for every launch from now on."""
    guard = TransferGuard()
    enqueue = engine._enqueue

    def guarded_enqueue(launch: Launch, ticket: int) -> Any:
        with guard.guarded():
            return enqueue(launch, ticket)

    monkeypatch.setattr(engine, "_enqueue", guarded_enqueue)
    streams = engine.streams
    for method in ("to_device", "tensor_to_device", "copy_to_host"):
        monkeypatch.setattr(streams, method, guard.allowing(getattr(streams, method)))
    # NOTE: the sampler reads a width back on the CPU only, where that costs no sync.
    monkeypatch.setattr(
        worker_svc.sampler, "_candidate_width", guard.allowing(worker_svc.sampler._candidate_width)
    )
    for owner, name in PATCHED:
        monkeypatch.setattr(owner, name, guard.noting(name, getattr(owner, name)))
    return guard


# ---- a scripted run: every kind of row and slot delta, launched back to back ----------------


def greedy(slot: int) -> NewRequest:
    return NewRequest(slot, 0.0, 1.0, 0, 0)


def seeded(slot: int) -> NewRequest:
    return NewRequest(slot, 0.8, 1.0, 0, 12345 + slot)


def filtered(slot: int) -> NewRequest:
    return NewRequest(slot, 1.0, 0.9, 20, 2**63 + slot)  # a seed above int64


@dataclass
class _Row:
    slot: int
    start: int
    ids: list[int] | None  # None: a decode row, its token read from the FutureMap
    sample: bool

    @property
    def num_tokens(self) -> int:
        return 1 if self.ids is None else len(self.ids)


@dataclass
class Script:
    """Builds launches whose positions and KV slots follow each request slot's context."""

    launches: list[Launch] = field(default_factory=list)
    _positions: dict[int, int] = field(default_factory=dict)
    _next_kv: int = 0

    def prefill(self, slot: int, ids: list[int], sample: bool = True) -> _Row:
        start = self._positions.get(slot, 0)
        self._positions[slot] = start + len(ids)
        return _Row(slot, start, ids, sample)

    def decode(self, slot: int) -> _Row:
        start = self._positions[slot]
        self._positions[slot] = start + 1
        return _Row(slot, start, None, True)

    def step(
        self, rows: Sequence[_Row] = (), new: Sequence[NewRequest] = (), released: Sequence[int] = ()
    ) -> None:
        for slot in released:
            self._positions.pop(slot, None)
        tokens = sum(row.num_tokens for row in rows)
        kv = list(range(self._next_kv, self._next_kv + tokens))
        self._next_kv += tokens
        self.launches.append(
            Launch(
                len(self.launches) + 1,
                released_slots=list(released),
                new_requests=list(new),
                row_req_slots=[r.slot for r in rows],
                row_start_pos=[r.start for r in rows],
                row_num_tokens=[r.num_tokens for r in rows],
                row_from_future=[r.ids is None for r in rows],
                row_sample=[r.sample for r in rows],
                prompt_ids=[i for r in rows for i in r.ids or ()],
                kv_slots=kv,
            )
        )

    @property
    def kv_slots_used(self) -> int:
        return self._next_kv


def scripted_launches() -> Script:
    """Prefills, a chunked prefill (its second chunk attends over a prefix), decodes mixed with
    prefills, greedy, seeded and top-k/top-p requests, releases, a release-only launch, and a
    request slot reused by a new request."""
    s = Script()
    s.step(
        [s.prefill(0, [72, 101, 108, 108, 111]), s.prefill(1, [1, 2, 3]), s.prefill(2, [9, 8, 7, 6], False)],
        new=[greedy(0), seeded(1), filtered(2)],
    )
    s.step([s.decode(0), s.decode(1), s.prefill(2, [5, 4, 3])])
    s.step([s.decode(0), s.decode(1), s.decode(2), s.prefill(3, [33, 34])], new=[greedy(3)])
    s.step([s.decode(0), s.decode(2), s.decode(3)], released=[1])
    s.step(released=[0])
    s.step([s.decode(2), s.decode(3), s.prefill(1, [40, 41, 42, 43])], new=[seeded(1)])
    s.step([s.decode(2), s.decode(3), s.decode(1)])
    s.step([s.decode(1), s.decode(2)], released=[3])
    return s


def constrained(request: NewRequest, constraint: Constraint) -> NewRequest:
    return dataclasses.replace(request, grammar=GrammarConstraint(constraint))


def constrained_launches() -> Script:
    """Constrained rows (JSON Schema, regex, choice; greedy, seeded, filtered) among plain ones,
    one of them prefilled in two chunks, a release and a slot reused by a new constrained one."""
    schema = Constraint(
        "json", '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'
    )
    regex, choice = Constraint("regex", "[a-z]{3,8}"), Constraint("choice", '["yes", "no"]')
    s = Script()
    s.step(
        [s.prefill(0, [72, 101]), s.prefill(1, [1, 2, 3]), s.prefill(2, [9, 8, 7, 6], False)],
        new=[constrained(greedy(0), schema), seeded(1), constrained(filtered(2), regex)],
    )
    s.step([s.decode(0), s.decode(1), s.prefill(2, [5, 4, 3])])
    for _ in range(3):
        s.step([s.decode(0), s.decode(1), s.decode(2)])
    s.step([s.decode(0), s.decode(2)], released=[1])
    s.step([s.decode(0), s.decode(2), s.prefill(1, [40, 41])], new=[constrained(seeded(1), choice)])
    for _ in range(3):
        s.step([s.decode(0), s.decode(1), s.decode(2)])
    return s


def sampled_rows(launch: Launch) -> int:
    return sum(launch.row_sample)


def run_back_to_back(engine: WorkerEngine, launches: Sequence[Launch]) -> list[list[int]]:
    """Every launch submitted before any result is read, as the overlap loop does at its deepest."""
    futures = [engine.submit(launch) for launch in launches]
    return [future.result(timeout=120).token_ids for future in futures]
