"""What the scheduler reports: Prometheus metrics and the step timeline."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge

from stepahead.loop_metrics import LoopHistogram, LoopHistogramChild
from stepahead.metrics import (
    BATCH_SIZE_BUCKETS,
    BATCH_TOKEN_BUCKETS,
    FORWARD_MODES,
    LATENCY_BUCKETS,
    LINK_RTT_BUCKETS,
    PHASE_BUCKETS,
    PHASES,
    new_registry,
)
from stepahead.trace import NO_TRACE, Tracer


class SchedulerTelemetry:
    """The engine core's metrics under the constant label `mode`, plus optional trace spans.
    What clients see (latencies, tokens streamed, endings) is measured in the frontends:
    `FrontendTelemetry`, merged into the core's endpoint by `FrontendMetrics`."""

    def __init__(self, mode: str, tracer: Tracer = NO_TRACE) -> None:
        self.tracer = tracer
        self.registry: CollectorRegistry = new_registry({"mode": mode})
        r, m = self.registry, [mode]

        def histogram(name: str, doc: str, buckets: tuple[float, ...], extra: str) -> LoopHistogram:
            family = LoopHistogram(name, doc, ("mode", extra), buckets)
            r.register(family)
            return family

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ["mode"], registry=r).labels(*m)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ["mode"], registry=r).labels(*m)

        def latency(name: str, doc: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> LoopHistogramChild:
            family = LoopHistogram(name, doc, ("mode",), buckets)
            r.register(family)
            return family.labels(*m)

        self.running = gauge("stepahead_requests_running", "Requests holding a request slot.")
        self.waiting = gauge("stepahead_requests_waiting", "Requests queued for admission.")
        self.result_queue_depth = gauge("stepahead_result_queue_depth", "Batches launched, not processed.")
        self.depth_configured = gauge(
            "stepahead_overlap_depth_configured", "--overlap-depth: batches launched ahead (0: auto)."
        )
        self.depth = gauge(
            "stepahead_overlap_depth", "Batches the overlap loop launches ahead of the one it processes."
        )
        self._depth_set: int | None = None  # the value `depth` was last set to
        self.kv_usage = gauge("stepahead_kv_cache_usage_ratio", "KV slots in use / KV slots.")
        self.worker_connected = gauge("stepahead_worker_connected", "1 while a worker session is up.")
        self.prompt_tokens = counter("stepahead_prompt_tokens", "Prompt tokens of admitted requests.")
        self.preemptions = counter("stepahead_preemptions", "Requests preempted for KV and recomputed.")
        self.step_failures = counter(
            "stepahead_step_failures", "Steps the worker failed (each ends its session; docs/RELIABILITY.md)."
        )
        self.poison_requests = counter(
            "stepahead_poison_requests",
            "Requests ended with INTERNAL for failing a step alone twice (docs/RELIABILITY.md).",
        )
        self.cache_hit_tokens = counter(
            "stepahead_prefix_cache_hit_tokens",
            "Prompt tokens of admitted requests found in the prefix cache.",
        )
        self.cache_slots = gauge("stepahead_prefix_cache_slots", "KV slots the prefix cache holds.")
        self.cache_evicted_slots = counter(
            "stepahead_prefix_cache_evicted_slots", "KV slots evicted from the prefix cache for new work."
        )
        self.verify_rows = counter(
            "stepahead_spec_verify_rows",
            "Speculative decoding: verify rows processed (each computed its pending token and K drafts).",
        )
        self.verify_tokens = counter(
            "stepahead_spec_verify_tokens", "Speculative decoding: tokens the processed verify rows emitted."
        )
        self.dropped_inflight_tokens = counter(
            "stepahead_dropped_inflight_tokens",
            "Tokens sampled for requests that ended while their batch was in flight (never streamed).",
        )
        self.queue_time = latency("stepahead_request_queue_time_seconds", "Arrival to first scheduled.")
        self.worker_latency = latency(
            "stepahead_worker_step_latency_seconds", "Launch sent to result received (device time included)."
        )
        self.link_rtt = latency(
            "stepahead_worker_link_rtt_seconds",
            "Round trip of the worker link per step: the wait for a result less the worker's hold.",
            LINK_RTT_BUCKETS,
        )
        self.step_timeouts = counter(
            "stepahead_worker_step_timeouts",
            "Worker sessions ended by the watchdog: a step or handshake without an answer in time.",
        )
        self.frontends = gauge("stepahead_frontends", "Frontend processes attached to the engine core.")
        self.frontend_restarts = counter(
            "stepahead_frontend_restarts", "Frontend processes that died and were started again."
        )
        batch_size = histogram("stepahead_batch_size", "Rows per batch.", BATCH_SIZE_BUCKETS, "forward_mode")
        batch_tokens = histogram(
            "stepahead_batch_tokens", "Tokens per batch.", BATCH_TOKEN_BUCKETS, "forward_mode"
        )
        self.batch_size = {f: batch_size.labels(mode, f) for f in FORWARD_MODES}
        self.batch_tokens = {f: batch_tokens.labels(mode, f) for f in FORWARD_MODES}
        phase = histogram("stepahead_step_phase_seconds", "Time of each loop phase.", PHASE_BUCKETS, "phase")
        self._phase = {p: phase.labels(mode, p) for p in PHASES}

    def phase(self, name: str, step_id: int) -> PhaseTimer:
        """Times one loop phase of step `step_id`: `with telemetry.phase("pick", step_id): ...`."""
        return PhaseTimer(self._phase[name], self.tracer, name, step_id)

    def observe_batch(self, forward_mode: str, rows: int, tokens: int) -> None:
        self.batch_size[forward_mode].observe(rows)
        self.batch_tokens[forward_mode].observe(tokens)

    def observe_depth(self, depth: int, link_rtt_s: float | None) -> None:
        if depth != self._depth_set:  # a gauge's set takes a lock: only when it changes
            self.depth.set(depth)
            self._depth_set = depth
        if link_rtt_s is not None:
            self.link_rtt.observe(link_rtt_s)

    def observe_result_queue(self, depth: int) -> None:
        """The result queue's length on the trace (its gauge reads the queue at a scrape)."""
        if self.tracer.enabled:
            self.tracer.counter("result_queue", time.time(), {"depth": depth})


class PhaseTimer:
    """One phase's timing, a context manager (a class, not a generator: four a step)."""

    __slots__ = ("_histogram", "_name", "_start", "_step_id", "_tracer")

    def __init__(self, histogram: LoopHistogramChild, tracer: Tracer, name: str, step_id: int) -> None:
        self._histogram = histogram
        self._tracer = tracer
        self._name = name
        self._step_id = step_id
        self._start = 0.0

    def __enter__(self) -> None:
        self._start = time.time()

    def __exit__(self, *exc: object) -> None:
        end = time.time()
        self._histogram.observe(end - self._start)
        if self._tracer.enabled:
            self._tracer.span("scheduler", f"{self._name} {self._step_id}", self._start, end)
