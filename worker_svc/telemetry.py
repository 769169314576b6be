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
        self.spec_drafts = counter(
            "stepahead_spec_decode_num_drafts",
            "Speculative decoding: verify rows that proposed at least one draft token.",
        )
        self.spec_draft_tokens = counter(
            "stepahead_spec_decode_num_draft_tokens", "Speculative decoding: draft tokens proposed."
        )
        self.spec_accepted_tokens = counter(
            "stepahead_spec_decode_num_accepted_tokens",
            "Speculative decoding: draft tokens accepted (each one a token gained over one-at-a-time "
            "decoding). Acceptance rate: accepted / draft tokens; mean acceptance length: 1 + "
            "accepted / drafts.",
        )
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
        self.grammar_mask_seconds = Histogram(
            "stepahead_grammar_mask_seconds",
            "Host time to fill one step's grammar masks (all its constrained rows), on the grammar "
            "thread beside the forward.",
            names,
            buckets=GAP_BUCKETS,
            registry=self.registry,
        ).labels(*values)
        self.grammar_masked_rows = counter(
            "stepahead_grammar_masked_rows", "Sampling rows drawn under a grammar mask."
        )
        self.grammar_wait = counter(
            "stepahead_grammar_wait_seconds",
            "Time the forward thread waited for a step's grammar masks (after it queued the step's "
            "forward and drew its other rows).",
        )
        self.grammar_compile_seconds = Histogram(
            "stepahead_grammar_compile_seconds",
            "Compiling one constraint (a cache miss) on the worker.",
            names,
            buckets=STEP_BUCKETS,
            registry=self.registry,
        ).labels(*values)
        self.grammar_compile_cache_hits = counter(
            "stepahead_grammar_compile_cache_hits", "Constraints the worker found compiled already."
        )
        self.grammar_matchers = Gauge(
            "stepahead_grammar_matchers",
            "Live grammar matchers (constrained request slots).",
            names,
            registry=self.registry,
        ).labels(*values)
        self.grammar_violations = counter(
            "stepahead_grammar_violations",
            "Constrained rows that drew a token outside their mask (must stay 0); each was ended.",
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
