"""One benchmark run: warm up, issue requests on the arrival schedule, collect the records."""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol

import numpy as np

from loadgen.arrivals import check_arrival_params, send_offsets
from loadgen.backend import (
    BACKENDS,
    GRPC_BACKENDS,
    Backend,
    BackendName,
    Constrained,
    Sampling,
    SamplingFeatures,
)
from loadgen.client import GrpcBackend, GrpcManyBackend
from loadgen.openai_client import OpenAIBackend, OpenAITarget, base_urls
from loadgen.records import RequestRecord
from loadgen.stats import Slos, Summary, summarize
from loadgen.timing import RequestTiming
from loadgen.workload import WARMUP_STREAM, Dataset, RandomDataset, Workload, load_workload, sends_token_ids
from stepahead.targets import split_servers

ARRIVAL_STREAM = 2  # keeps the arrival rng apart from the workload's
DEFAULT_CONNECTIONS = 8  # over gRPC; the HTTP connection pool has no cap unless given one
DEFAULT_BASE_URL = "http://127.0.0.1:8000"


@dataclass(frozen=True)
class BenchmarkConfig:
    # grpc: HOST:PORT, replicas as HOST:PORT,HOST:PORT... or one dns:/ipv4:/ipv6: target URI
    server: str = "127.0.0.1:50051"
    dataset: Dataset = field(default_factory=RandomDataset)
    num_prompts: int | None = 1000  # None: as many as fit in duration_s
    duration_s: float | None = None  # stop issuing after this long; in-flight requests finish
    request_rate: float = math.inf  # requests per second
    burstiness: float = 1.0  # gamma shape of the inter-arrival gaps; 1 is Poisson
    max_concurrency: int | None = None
    # grpc: TCP connections to the server, request i uses i mod this (None: DEFAULT_CONNECTIONS);
    # openai*: the cap of the HTTP connection pool, so of requests in flight (None: no cap)
    connections: int | None = None
    seed: int = 0
    warmup: int = 0  # requests sent and awaited before the measured run, not counted
    ignore_eos: bool = False
    temperature: float = 0.0
    features: SamplingFeatures = field(default_factory=SamplingFeatures)
    constrained: Constrained = field(default_factory=Constrained)  # requests asking for structured output
    slos: Slos = field(default_factory=Slos)
    backend: BackendName = "grpc"
    base_url: str = DEFAULT_BASE_URL  # openai*, without /v1; replicas: comma-separated, taken in turn
    model: str | None = None  # openai*: None takes the first of GET /v1/models
    api_key: str | None = field(default=None, repr=False)  # openai*: sent as a bearer token

    def __post_init__(self) -> None:
        check_arrival_params(self.request_rate, self.burstiness)
        if self.num_prompts is None and self.duration_s is None:
            raise ValueError("give a number of prompts, a duration, or both")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError(f"number of prompts must be at least 1, got {self.num_prompts}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration must be > 0 s, got {self.duration_s}")
        self._check_bounded()
        self._check_counts()
        self._check_backend()

    def _check_bounded(self) -> None:
        if self.num_prompts is None and math.isinf(self.request_rate) and self.max_concurrency is None:
            raise ValueError("a duration at an infinite rate needs a max concurrency or a number of prompts")

    def _check_counts(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max concurrency must be at least 1, got {self.max_concurrency}")
        if self.connections is not None and self.connections < 1:
            raise ValueError(f"connections must be at least 1, got {self.connections}")
        if self.warmup < 0 or self.seed < 0:
            raise ValueError("warmup and seed must be >= 0")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")

    def _check_backend(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.backend in GRPC_BACKENDS:
            split_servers(self.server)
        for url in base_urls(self.base_url):
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"base URL must start with http:// or https://, got {url!r}")
        if self.backend == "openai-chat" and sends_token_ids(self.dataset):
            raise ValueError(
                "openai-chat sends chat messages, which are text, and token ids cannot be "
                "decoded here: use text prompts (--prompt-as-text)"
            )

    @property
    def target(self) -> str:
        """Where the requests go: the gRPC address or the HTTP base URL."""
        return self.server if self.backend in GRPC_BACKENDS else self.base_url

    @property
    def connection_limit(self) -> int | None:
        """The connections in use: gRPC channels, or the HTTP pool's cap (None: no cap)."""
        if self.backend in GRPC_BACKENDS and self.connections is None:
            return DEFAULT_CONNECTIONS
        return self.connections


@dataclass(frozen=True)
class BenchmarkResult:
    config: BenchmarkConfig
    started_at: datetime
    records: tuple[RequestRecord, ...]  # measured requests in issue order
    summary: Summary
    interrupted: bool  # stopped before every request was issued and answered
    warmup_failed: int
    model: str | None = None  # the model the requests named (openai backends)


class Observer(Protocol):
    """Hears about the measured run as it goes (a progress display)."""

    def on_start(self) -> None: ...

    def on_request_done(self, record: RequestRecord) -> None: ...


async def run_benchmark(
    config: BenchmarkConfig, stop: asyncio.Event | None = None, observer: Observer | None = None
) -> BenchmarkResult:
    """Runs the benchmark; setting `stop` stops issuing, cancels what is in flight and returns
    the result of what completed. Raises WorkloadError before connecting if the dataset is bad,
    and BackendError if the backend cannot start (no model to name)."""
    workload = load_workload(config.dataset, config.seed)
    warmup = load_workload(config.dataset, config.seed, WARMUP_STREAM)
    started_at = datetime.now()
    backend = open_backend(config)
    try:
        run = _Run(backend, config, observer)
        interrupted = await run.until_done_or(stop if stop is not None else asyncio.Event(), workload, warmup)
    finally:
        await backend.close()
    records = run.records()
    summary = summarize(records, run.elapsed, config.slos)
    return BenchmarkResult(
        config, started_at, records, summary, interrupted, run.warmup_failed, backend.model
    )


def open_backend(config: BenchmarkConfig) -> Backend:
    sampling = Sampling(config.temperature, config.ignore_eos, config.features, config.constrained)
    if config.backend == "grpc":
        return GrpcBackend(config.server, config.connection_limit or DEFAULT_CONNECTIONS, sampling)
    if config.backend == "grpc-many":
        return GrpcManyBackend(config.server, config.connection_limit or DEFAULT_CONNECTIONS, sampling)
    target = OpenAITarget(config.base_url, config.model, config.api_key, chat=config.backend == "openai-chat")
    return OpenAIBackend(target, config.connection_limit, sampling)


class _Run:
    """One run's state. Times are seconds since `origin`, which moves to the start of the
    measured part once the backend is connected and the warmup is over."""

    def __init__(self, backend: Backend, config: BenchmarkConfig, observer: Observer | None) -> None:
        self.backend, self.config, self.observer = backend, config, observer
        self.slots = None if config.max_concurrency is None else asyncio.Semaphore(config.max_concurrency)
        self.origin = time.perf_counter()
        self.elapsed = 0.0
        self.timings: list[RequestTiming] = []
        self.tasks: list[asyncio.Task[None]] = []
        self.warmup_failed = 0
        self.measuring = False

    def clock(self) -> float:
        return time.perf_counter() - self.origin

    async def until_done_or(self, stop: asyncio.Event, workload: Workload, warmup: Workload) -> bool:
        """Runs to the end or until `stop`; True when stopped first."""
        main = asyncio.create_task(self.execute(workload, warmup))
        stopper = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({main, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
            stopped = not main.done()
            await self.cancel_all(main)
        if not stopped:
            main.result()  # raises what went wrong, if anything did
        return stopped

    async def cancel_all(self, main: asyncio.Task[None]) -> None:
        """Cancels whatever still runs and waits for it; a request's unexpected error is raised."""
        pending = [t for t in (main, *self.tasks) if not t.done()]
        if not pending:
            return
        for task in pending:
            task.cancel()
        outcomes = await asyncio.gather(*pending, return_exceptions=True)
        if self.measuring:
            self.elapsed = self.clock()
        for outcome in outcomes:
            if isinstance(outcome, Exception):
                raise outcome

    async def execute(self, workload: Workload, warmup: Workload) -> None:
        await self.backend.connect()
        await self.warm_up(warmup)
        self.origin, self.measuring = time.perf_counter(), True
        if self.observer is not None:
            self.observer.on_start()
        await self.issue(workload)
        await asyncio.gather(*self.tasks)
        self.elapsed = self.clock()

    async def warm_up(self, warmup: Workload) -> None:
        timings = [RequestTiming(i, warmup.prompt(i)) for i in range(self.config.warmup)]
        await asyncio.gather(*(self.bounded(timing) for timing in timings))
        self.warmup_failed = sum(t.error is not None for t in timings)

    async def bounded(self, timing: RequestTiming) -> None:
        await self.acquire_slot()
        try:
            await self.send(timing)
        finally:
            self.release_slot()

    async def issue(self, workload: Workload) -> None:
        """Sends on schedule; a request held back by max concurrency goes as soon as a slot frees,
        and later ones keep their scheduled times (the schedule never drifts)."""
        rng = np.random.default_rng([self.config.seed, ARRIVAL_STREAM])
        offsets = send_offsets(self.config.request_rate, self.config.burstiness, rng)
        for index, offset in zip(self.indices(), offsets, strict=False):
            if self.past_deadline(offset):
                return
            await asyncio.sleep(max(0.0, offset - self.clock()))
            await self.acquire_slot()
            if self.past_deadline(self.clock()):
                self.release_slot()
                return
            self.launch(RequestTiming(index, workload.prompt(index)))

    def indices(self) -> Iterator[int]:
        n = self.config.num_prompts
        return itertools.count() if n is None else iter(range(n))

    def past_deadline(self, t: float) -> bool:
        return self.config.duration_s is not None and t >= self.config.duration_s

    def launch(self, timing: RequestTiming) -> None:
        self.timings.append(timing)
        self.tasks.append(asyncio.create_task(self.measured(timing)))

    async def measured(self, timing: RequestTiming) -> None:
        try:
            await self.send(timing)
        finally:
            self.release_slot()
            if self.observer is not None:
                self.observer.on_request_done(timing.record(self.clock()))

    async def send(self, timing: RequestTiming) -> None:
        await self.backend.send(timing, self.clock)

    async def acquire_slot(self) -> None:
        if self.slots is not None:
            await self.slots.acquire()

    def release_slot(self) -> None:
        if self.slots is not None:
            self.slots.release()

    def records(self) -> tuple[RequestRecord, ...]:
        return tuple(t.record(self.elapsed) for t in self.timings)
