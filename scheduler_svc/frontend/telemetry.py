"""What a frontend reports: what its clients see (time to first token, between tokens, to the
finish), the tokens it streamed, how requests ended, the structured-output constraints it
admitted and compiled, and its process's CPU time."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from scheduler_svc.contract import SamplingParams
from scheduler_svc.frontend.validation import Compiled
from stepahead.grammars import answer_kind
from stepahead.loop_metrics import LoopHistogram, LoopHistogramChild
from stepahead.metrics import FINISH_REASONS, LATENCY_BUCKETS, STEP_BUCKETS
from stepahead.protocol import CONSTRAINT_KINDS


class Counting(Protocol):
    """A counter's child, as the streams count their messages."""

    def inc(self, amount: float = 1) -> None: ...


class FrontendTelemetry:
    """What clients see, measured where they are served. `own_process`: the frontend runs in
    a process of its own, whose CPU time it reports."""

    def __init__(self, mode: str, own_process: bool = False) -> None:
        self.registry = CollectorRegistry()
        r, m = self.registry, [mode]

        def latency(name: str, doc: str) -> LoopHistogramChild:
            histogram = LoopHistogram(name, doc, ("mode",), LATENCY_BUCKETS)
            r.register(histogram)
            return histogram.labels(mode)

        self.ttft = latency("stepahead_time_to_first_token_seconds", "Arrival to first token.")
        self.itl = latency("stepahead_inter_token_latency_seconds", "Between consecutive tokens.")
        self.e2e = latency("stepahead_e2e_request_latency_seconds", "Arrival to finish.")
        self.generation_tokens = Counter(
            "stepahead_generation_tokens", "Tokens streamed to clients.", ["mode"], registry=r
        ).labels(*m)
        self.messages = Counter(
            "stepahead_stream_messages",
            "Messages streamed to clients (gRPC responses and server-sent events with tokens).",
            ["mode"],
            registry=r,
        ).labels(*m)
        self.held_steps = Counter(
            "stepahead_stream_held_steps",
            "Steps whose due streams were held for a later message (the frontend fell behind).",
            ["mode"],
            registry=r,
        ).labels(*m)
        finished = Counter("stepahead_requests_finished", "Ended requests.", ["mode", "reason"], registry=r)
        self.finished = {reason: finished.labels(mode, reason) for reason in FINISH_REASONS}
        constrained = Counter(
            "stepahead_constrained_requests",
            "Admitted requests with a structured-output constraint.",
            ["mode", "kind"],
            registry=r,
        )
        self.constrained = {kind: constrained.labels(mode, kind) for kind in CONSTRAINT_KINDS}
        self.compile_seconds = Histogram(
            "stepahead_frontend_grammar_compile_seconds",
            "Compiling one constraint (a cache miss) to check it before admission.",
            ["mode"],
            buckets=STEP_BUCKETS,  # as the worker's compiles
            registry=r,
        ).labels(*m)
        self.compile_cache_hits = Counter(
            "stepahead_frontend_grammar_compile_cache_hits",
            "Constraints found compiled already when checked before admission.",
            ["mode"],
            registry=r,
        ).labels(*m)
        r.register(_FrontendCpu(mode, own_process))

    def compiled(self, compiled: Compiled | None) -> None:
        """A valid request's constraint check: a compile, or a cache hit."""
        if compiled is None:
            return
        if compiled.cached:
            self.compile_cache_hits.inc()
        else:
            self.compile_seconds.observe(compiled.seconds)

    def admitted(self, params: SamplingParams) -> None:
        if params.constraint is not None:
            self.constrained[answer_kind(params.constraint)].inc()


class _FrontendCpu(Collector):
    def __init__(self, mode: str, own_process: bool) -> None:
        self._mode = mode
        self._own_process = own_process

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "stepahead_frontend_cpu_seconds",
            "CPU time of the frontend processes (0 with --frontends 0: see process_cpu_seconds_total).",
            labels=["mode"],
        )
        family.add_metric([self._mode], time.process_time() if self._own_process else 0.0)
        yield family
