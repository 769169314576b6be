"""The in-process decode harness of the benches that measure the model itself (part A of
`bench.sampling_cost` and `bench.structured`): a `WorkerEngine` over a model in float32 on the CPU
(torch threads fixed by the plan), driven as the overlap loop drives it.

A run starts a fresh engine session and registers B greedy requests (one request slot each) with
a prefill of B random prompts (`prompt_len` tokens), whose result it awaits; then it launches D
decode steps whose inputs the engine reads from its FutureMap, each launched one step ahead (step
k+1 is submitted before step k's result is read). Its figures (`DecodeRun`): device ms per step,
the mean of the decode steps' `forward_end - forward_start` (on the CPU, the forward thread's
whole step); decode tok/s, B x D over the first decode step's forward start to the last result in
hand.

What a bench varies between runs (a variant: a feature set of the requests' logits processing,
whether the rows are held to a grammar) is its `Variation`: the variants, in the order they run;
a variant's requests; a `Watch` of each run, which reads the engine around the decode steps,
checks each result and makes the bench's record of the run; the bench's row of a variant's runs
and its progress line. Per model and batch size (`measure_model`), after one untimed warmup round
(WARMUP_STEPS decode steps per variant), the variants run in turns, `repeats` times, so that a
competing load hits them alike; of a row's runs the best counts (the least device ms, the most
tok/s).
"""

from __future__ import annotations

import random
import statistics
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import torch

from stepahead.protocol import GrammarConstraint, Launch, LogitsProcessing, NewRequest, StepResult
from worker_svc.backends import ModelBackend, load_backend
from worker_svc.device_streams import CpuStreams
from worker_svc.engine import EngineConfig, WorkerEngine

CPU = torch.device("cpu")
SEED = 0  # of the prompts' random ids
WARMUP_STEPS = 2  # decode steps of each variant's untimed run, per batch size
RESULT_TIMEOUT_S = 600.0  # a hang guard, not an expectation

Progress = Callable[[str], None]


def ignore(line: str) -> None:
    """A progress that says nothing."""


@dataclass(frozen=True)
class EnginePlan:
    models: tuple[str, ...]
    batch_sizes: tuple[int, ...]
    steps: int  # decode steps per run
    repeats: int  # timed runs of each variant; the best counts
    prompt_len: int = 32
    threads: int = 2  # torch CPU threads


@dataclass(frozen=True)
class DecodeRun:
    """One run's decode steps."""

    device_ms: float  # mean forward_end - forward_start per decode step
    wall_s: float  # first decode forward start to last decode result in hand
    tokens: int  # batch x steps

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s


V = TypeVar("V", bound=str)  # a variant's name
R = TypeVar("R", bound=DecodeRun)  # a bench's record of a run
R_co = TypeVar("R_co", bound=DecodeRun, covariant=True)
Row = TypeVar("Row")  # a bench's row of a variant's runs
Found = TypeVar("Found", bound="EngineRow[Any, Any]")


@dataclass(frozen=True)
class EngineRow(Generic[V, R]):
    """A variant's runs at a model and batch size."""

    model: str
    batch: int
    variant: V
    runs: tuple[R, ...]  # in the order they ran

    @property
    def device_ms(self) -> float:
        return min(r.device_ms for r in self.runs)

    @property
    def tokens_per_s(self) -> float:
        return max(r.tokens_per_s for r in self.runs)


def find(rows: Sequence[Found], model: str, batch: int, variant: str) -> Found | None:
    """The row of `variant` at that model and batch size, if measured."""
    return next((r for r in rows if (r.model, r.batch, r.variant) == (model, batch, variant)), None)


class Watch(Protocol[R_co]):
    """What a bench reads around one run's decode steps; made once the prefill's result is in."""

    def read(self, result: StepResult) -> StepResult:
        """Each result as it is read (the prefill's, then each decode step's): checked, or raises."""
        ...

    def end(self, run: DecodeRun) -> R_co:
        """After the last result: the bench's record of the run."""
        ...


class Unwatched:
    """A watch that reads nothing: a run's record is its figures."""

    def read(self, result: StepResult) -> StepResult:
        return result

    def end(self, run: DecodeRun) -> DecodeRun:
        return run


class Variation(ABC, Generic[V, R, Row]):
    """What a bench varies between runs (V), its record of a run (R) and its row of a variant's runs."""

    def __init__(self, variants: tuple[V, ...]) -> None:
        self.variants = variants  # in the order they run, each turn

    @abstractmethod
    def requests(self, variant: V, batch: int, prompt_len: int, backend: ModelBackend) -> list[NewRequest]:
        """The variant's greedy requests, in slots 0..batch-1 (`greedy`)."""

    @abstractmethod
    def watch(self, engine: WorkerEngine, variant: V, batch: int, steps: int) -> Watch[R]:
        """A run's watch, made after its prefill's result, before its first decode launch."""

    @abstractmethod
    def row(self, model: str, batch: int, variant: V, runs: tuple[R, ...]) -> Row:
        """The bench's row of a variant's runs at a model and batch size."""

    @abstractmethod
    def progress_line(self, rows: Sequence[Row], row: Row) -> str:
        """A row's line, among the rows of its model and batch size."""


def greedy(
    slot: int, processing: LogitsProcessing | None = None, grammar: GrammarConstraint | None = None
) -> NewRequest:
    """A greedy request in `slot`, its logits processed and its draws held to a grammar as given."""
    return NewRequest(slot, 0.0, 1.0, 0, 0, processing, grammar=grammar)


class Decoder:
    """Drives an engine as the overlap loop does: the prefill's result is awaited, then each decode
    launch is submitted before the previous one's result is read."""

    def __init__(self, engine: WorkerEngine, prompt_len: int, rng: random.Random) -> None:
        self.engine = engine
        self.prompt_len = prompt_len
        self.rng = rng

    def run(self, variation: Variation[V, R, Any], variant: V, batch: int, steps: int) -> R:
        self.engine.begin_session().result()
        width = self.prompt_len + steps
        requests = variation.requests(variant, batch, self.prompt_len, self.engine.backend)
        prefill = self.engine.submit(self._prefill(requests, width)).result(timeout=RESULT_TIMEOUT_S)
        watch = variation.watch(self.engine, variant, batch, steps)
        watch.read(prefill)
        in_flight: deque[Future[StepResult]] = deque([self.engine.submit(self._decode(1, batch, width))])
        decoded: list[StepResult] = []
        for k in range(2, steps + 1):
            in_flight.append(self.engine.submit(self._decode(k, batch, width)))
            decoded.append(watch.read(in_flight.popleft().result(timeout=RESULT_TIMEOUT_S)))
        decoded.append(watch.read(in_flight.popleft().result(timeout=RESULT_TIMEOUT_S)))
        done = time.time()
        device_s = statistics.fmean(r.forward_seconds for r in decoded)
        return watch.end(DecodeRun(device_s * 1e3, done - decoded[0].forward_start, batch * steps))

    def _prefill(self, requests: list[NewRequest], width: int) -> Launch:
        n, batch = self.prompt_len, len(requests)
        ids = [self.rng.randrange(self.engine.backend.vocab_size) for _ in range(batch * n)]
        return Launch(
            1,
            new_requests=requests,
            row_req_slots=list(range(batch)),
            row_start_pos=[0] * batch,
            row_num_tokens=[n] * batch,
            row_from_future=[False] * batch,
            row_sample=[True] * batch,
            prompt_ids=ids,
            kv_slots=[slot * width + t for slot in range(batch) for t in range(n)],
        )

    def _decode(self, k: int, batch: int, width: int) -> Launch:
        """Decode step k: every row's token k - 1 (read from the FutureMap) at position prompt + k - 1."""
        position = self.prompt_len + k - 1
        return Launch(
            k + 1,
            row_req_slots=list(range(batch)),
            row_start_pos=[position] * batch,
            row_num_tokens=[1] * batch,
            row_from_future=[True] * batch,
            row_sample=[True] * batch,
            kv_slots=[slot * width + position for slot in range(batch)],
        )


def load_model(model: str) -> ModelBackend:
    return load_backend(model, CPU, torch.float32, 0.0, 0.0)


def engine_for(backend: ModelBackend, plan: EnginePlan) -> WorkerEngine:
    """KV for the plan's largest batch at its longest run, a request slot per row."""
    most = max(plan.batch_sizes)
    config = EngineConfig(most * (plan.prompt_len + max(plan.steps, WARMUP_STEPS)), most)
    return WorkerEngine(backend, config, CpuStreams())


def run_engine_part(plan: EnginePlan, variation: Variation[V, R, Row], progress: Progress) -> list[Row]:
    """Every model of the plan, in turn, under the plan's torch threads."""
    torch.set_num_threads(plan.threads)
    return [
        row
        for model in plan.models
        for row in measure_model(load_model(model), model, plan, variation, progress)
    ]


def measure_model(
    backend: ModelBackend,
    model: str,
    plan: EnginePlan,
    variation: Variation[V, R, Row],
    progress: Progress = ignore,
) -> list[Row]:
    """Every (batch size, variant) of the plan on one model: rows by batch, then variant."""
    engine = engine_for(backend, plan)
    decoder = Decoder(engine, plan.prompt_len, random.Random(SEED))
    measured: list[Row] = []
    try:
        for batch in plan.batch_sizes:
            rows = measure_batch(decoder, variation, model, batch, plan)
            for row in rows:
                progress(variation.progress_line(rows, row))
            measured += rows
    finally:
        engine.shutdown()
    return measured


def measure_batch(
    decoder: Decoder, variation: Variation[V, R, Row], model: str, batch: int, plan: EnginePlan
) -> list[Row]:
    """A warmup round, then `repeats` timed rounds of the variants in turns."""
    for variant in variation.variants:
        decoder.run(variation, variant, batch, WARMUP_STEPS)
    runs: dict[V, list[R]] = {variant: [] for variant in variation.variants}
    for _ in range(plan.repeats):
        for variant in variation.variants:
            runs[variant].append(decoder.run(variation, variant, batch, plan.steps))
    return [variation.row(model, batch, variant, tuple(r)) for variant, r in runs.items()]
