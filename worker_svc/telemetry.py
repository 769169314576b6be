"""The worker's Prometheus metrics: how busy the device is, and its gaps."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from stepahead.metrics import FORWARD_MODES, GAP_BUCKETS, STEP_BUCKETS, new_registry


class WorkerMetrics:
    def __init__(self, model: str, device: str) -> None:
        labels = {"model": model, "device": device}
        self.registry: CollectorRegistry = new_registry(labels)
        names, values = list(labels), list(labels.values())

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=self.registry).labels(*values)

        self.busy = counter("stepahead_device_busy_seconds", "Device time spent on forwards.")
        self.idle = counter(
            "stepahead_device_idle_seconds",
            "Device idle between forwards while requests were live (CPU work exposed).",
        )
        self.gap = Histogram(
            "stepahead_device_gap_seconds",
            "End of one forward to the start of the next, while requests were live.",
            names,
            buckets=GAP_BUCKETS,
            registry=self.registry,
        ).labels(*values)
        self.copy = Histogram(
            "stepahead_copy_seconds",
            "Sampled ids device-to-host copy.",
            names,
            buckets=GAP_BUCKETS,
            registry=self.registry,
        ).labels(*values)
        self.live_slots = Gauge(
            "stepahead_live_request_slots",
            "Request slots registered, not released.",
            names,
            registry=self.registry,
        ).labels(*values)
        self.tensor_parallel_size = Gauge(
            "stepahead_tensor_parallel_size",
            "Ranks the model is sharded over (--tp); the forward figures are rank 0's.",
            names,
            registry=self.registry,
        ).labels(*values)
        forward = Histogram(
            "stepahead_forward_seconds",
            "One batch's device time.",
            [*names, "forward_mode"],
            buckets=STEP_BUCKETS,
            registry=self.registry,
        )
        batches = Counter(
            "stepahead_batches", "Batches executed.", [*names, "forward_mode"], registry=self.registry
        )
        tokens = Counter(
            "stepahead_batch_tokens", "Tokens executed.", [*names, "forward_mode"], registry=self.registry
        )
        self.forward = {m: forward.labels(*values, m) for m in FORWARD_MODES}
        self.batches = {m: batches.labels(*values, m) for m in FORWARD_MODES}
        self.tokens = {m: tokens.labels(*values, m) for m in FORWARD_MODES}

    def observe_forward(
        self, forward_mode: str, seconds: float, copy_seconds: float, num_tokens: int
    ) -> None:
        self.busy.inc(seconds)
        self.forward[forward_mode].observe(seconds)
        self.batches[forward_mode].inc()
        self.tokens[forward_mode].inc(num_tokens)
        self.copy.observe(copy_seconds)

    def observe_gap(self, seconds: float) -> None:
        self.idle.inc(seconds)
        self.gap.observe(seconds)
