"""The summary of a run, computed from its per-request records (pure functions).

Definitions, in seconds per request, as `vllm bench serve` defines them:

- TTFT: arrival of the first message carrying a token - send.
- E2E latency: arrival of the last message - send.
- TPOT: (E2E - TTFT) / (output tokens - 1), only for requests with more than one output token.
- ITL: the gaps between consecutive messages that carry tokens. The server coalesces tokens
  into one message when the client lags, so a message carrying k tokens contributes k entries
  of gap/k: every token after the first message gets one entry, and a coalesced burst does
  not look like one long stall followed by free tokens. The extra tokens of the first message
  arrive with it and get no entry (their wait is TTFT).

Latencies and throughputs cover completed requests only; a request that ended in an error is
failed and counted under its status: the gRPC status name, or "HTTP 429" and the like.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields

import numpy as np

from loadgen.records import RequestRecord


@dataclass(frozen=True)
class Distribution:
    """Milliseconds; all zero when there is no sample, as in `vllm bench serve` results."""

    count: int = 0
    mean: float = 0.0
    median: float = 0.0
    std: float = 0.0
    p90: float = 0.0
    p99: float = 0.0


def distribution_ms(samples_s: Sequence[float]) -> Distribution:
    """Percentiles interpolate linearly between samples (numpy's default); std is the population one."""
    if not samples_s:
        return Distribution()
    ms = np.asarray(samples_s, dtype=np.float64) * 1000.0
    median, p90, p99 = (float(v) for v in np.percentile(ms, [50, 90, 99]))
    return Distribution(len(ms), float(ms.mean()), median, float(ms.std()), p90, p99)


def time_to_first_token(record: RequestRecord) -> float | None:
    return record.message_times[0] - record.send_time if record.message_times else None


def end_to_end_latency(record: RequestRecord) -> float:
    return record.end_time - record.send_time


def time_per_output_token(record: RequestRecord) -> float | None:
    ttft = time_to_first_token(record)
    if ttft is None or record.output_len < 2:
        return None
    return (end_to_end_latency(record) - ttft) / (record.output_len - 1)


def inter_token_latencies(record: RequestRecord) -> list[float]:
    latencies: list[float] = []
    times, tokens = record.message_times, record.message_tokens
    for previous, now, count in zip(times, times[1:], tokens[1:], strict=False):
        latencies.extend([(now - previous) / count] * count)
    return latencies


def peak_concurrency(records: Iterable[RequestRecord]) -> int:
    """Most requests in flight at once; one ending exactly when another starts does not overlap it."""
    events = sorted(
        event for r in records for event in ((r.send_time, 1), (r.end_time, -1))
    )  # at equal times -1 sorts before +1
    peak = in_flight = 0
    for _, change in events:
        in_flight += change
        peak = max(peak, in_flight)
    return peak


@dataclass(frozen=True)
class Slos:
    """Service-level objectives in milliseconds; None leaves a metric unchecked."""

    ttft: float | None = None
    tpot: float | None = None
    e2el: float | None = None

    @property
    def given(self) -> bool:
        return any(getattr(self, f.name) is not None for f in fields(self))


def parse_slos(items: Iterable[str]) -> Slos:
    """`["ttft:200", "e2el:5000"]` -> Slos(ttft=200, e2el=5000)."""
    values: dict[str, float] = {}
    names = {f.name for f in fields(Slos)}
    for item in items:
        name, _, text = item.partition(":")
        if name not in names or name in values:
            raise ValueError(f"goodput: {item!r}: expected one each of {sorted(names)} as NAME:MS")
        values[name] = _slo_value(item, text)
    return Slos(**values)


def _slo_value(item: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"goodput: {item!r}: {text!r} is not a number of milliseconds") from None
    if not value > 0:
        raise ValueError(f"goodput: {item!r}: the SLO must be > 0 ms")
    return value


def meets_slos(record: RequestRecord, slos: Slos) -> bool:
    """A completed request meeting every given SLO (inclusive).

    A single-token request counts as TPOT 0, as in `vllm bench serve`; a request that streamed
    no token at all has no TTFT and misses a TTFT SLO.
    """
    if not record.ok:
        return False
    ttft = time_to_first_token(record)
    measured = {
        "ttft": None if ttft is None else ttft * 1000,
        "tpot": (time_per_output_token(record) or 0.0) * 1000,
        "e2el": end_to_end_latency(record) * 1000,
    }
    return all(_within(measured[name], limit) for name, limit in vars(slos).items())


def _within(value_ms: float | None, limit_ms: float | None) -> bool:
    return limit_ms is None or (value_ms is not None and value_ms <= limit_ms)


@dataclass(frozen=True)
class Summary:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    request_goodput: float | None  # None when no SLO was given
    output_throughput: float
    total_token_throughput: float
    peak_concurrency: int
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2el: Distribution
    errors: Mapping[str, int]  # failed requests by status (gRPC name, HTTP code, ...)
    finish_reasons: Mapping[str, int]  # completed requests by finish reason


def summarize(records: Sequence[RequestRecord], duration_s: float, slos: Slos = Slos()) -> Summary:
    done = [r for r in records if r.ok]
    input_tokens = sum(r.input_len for r in done)
    output_tokens = sum(r.output_len for r in done)
    good = sum(meets_slos(r, slos) for r in done) if slos.given else None
    ttft, tpot, itl, e2el = latency_distributions(done)
    return Summary(
        completed=len(done),
        failed=len(records) - len(done),
        duration_s=duration_s,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=per_second(len(done), duration_s),
        request_goodput=None if good is None else per_second(good, duration_s),
        output_throughput=per_second(output_tokens, duration_s),
        total_token_throughput=per_second(input_tokens + output_tokens, duration_s),
        peak_concurrency=peak_concurrency(records),
        ttft=ttft,
        tpot=tpot,
        itl=itl,
        e2el=e2el,
        errors=dict(Counter(r.error for r in records if r.error is not None)),
        finish_reasons=dict(Counter(r.finish_reason or "UNSPECIFIED" for r in done)),
    )


def latency_distributions(
    done: Sequence[RequestRecord],
) -> tuple[Distribution, Distribution, Distribution, Distribution]:
    """TTFT, TPOT, ITL and E2E latency of completed requests."""
    ttfts = [t for r in done if (t := time_to_first_token(r)) is not None]
    tpots = [t for r in done if (t := time_per_output_token(r)) is not None]
    itls = [gap for r in done for gap in inter_token_latencies(r)]
    e2els = [end_to_end_latency(r) for r in done]
    return distribution_ms(ttfts), distribution_ms(tpots), distribution_ms(itls), distribution_ms(e2els)


def per_second(count: float, duration_s: float) -> float:
    return count / duration_s if duration_s > 0 else 0.0
