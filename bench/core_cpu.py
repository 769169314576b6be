"""python -m bench.core_cpu: the engine core's CPU time per step against the batch size, in one
process and one thread, with no network.

Each step does the core's own work for one overlap-loop iteration: pick batch k (the scheduling
policy, under the loop's telemetry phases), serialize its launch as the worker link sends it,
parse the result of batch k-1 as the link receives it, and apply it (the policy's update, the
outbox flush, each frontend's message serialized as the frontend link sends it). A host-side
worker executes every launch at once, outside the timed parts: a FutureMap per request slot,
one token per sampled row. Steady rows: requests never finish, so every measured step decodes the
whole batch. A batch of at most `PolicyConfig.small_batch` rows, which the policy picks and
applies a row at a time, is also run a column at a time (`small_batch=0`), beside it. Turnover
rows add the requests that start and end: each generates exactly `output_len` tokens, and those
that ended are replaced, the step after, by new ones that arrive as the frontend link carries
them (a `RequestBatch` of `NewCoreRequest`s, parsed and added under the `arrive` phase), with
prompts of random tokens, so each is looked up in and kept by the prefix cache as a served
request is; the arrivals are staggered, so about batch / output_len requests start and end each
step. Some batch sizes are run again with `idle_ms` between steps, as the served core waits
through a device step while its result is computed: the same work then finds the caches cold,
and takes several times as long as back to back. `--idle spin` spends that time spinning instead
of asleep: if the steps are as slow, it is not this thread's sleep that costs, but what else the
host ran on the core meanwhile.
Writes bench/results/<UTC date-time>-core-cpu.{json,md} and prints the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, get_args

from bench.envelope import Envelope, begin, load_clause
from bench.machine import Machine, add_wake_latency_argument, cpu_wake_latency, idle_policy, loop_calibration
from bench.save import RESULTS, command_line, publish
from scheduler_svc.contract import CoreRequestSpec, SamplingParams, StepOutputs
from scheduler_svc.engine.batch import ScheduledBatch
from scheduler_svc.engine.outputs import Outbox
from scheduler_svc.engine.policy import PolicyConfig, SchedulingPolicy
from scheduler_svc.engine.request import Request
from scheduler_svc.engine.telemetry import SchedulerTelemetry
from scheduler_svc.process.link.codec import outputs_to_proto, spec_from_proto, spec_to_proto
from scheduler_svc.process.link.core_side import core_request
from stepahead.protocol import (
    Launch,
    StepResult,
    TokenizerSpec,
    WorkerInfo,
    launch_from_proto,
    launch_to_proto,
    result_from_proto,
    result_to_proto,
)
from stepahead.v1 import core_pb2, worker_pb2

BATCH_SIZES = (4, 16, 64, 128, 256, 512)  # 4 and 16: the small-batch path (`PolicyConfig.small_batch`)
IDLE_BATCH_SIZES = (4, 64, 256)  # run again, each step after `idle_ms` idle
IDLE_MS = (20.0,)  # a device step of the benchmarks' sim at batch 256
IdleWay = Literal["sleep", "spin"]  # how a step's idle time passes: asleep, or in a loop of clock reads
IDLE_WAYS: tuple[IdleWay, ...] = get_args(IdleWay)
TURNOVER_OUTPUTS = (128, 16)  # output_len of the turnover rows' requests
TURNOVER_BATCH_SIZES = (256,)
PHASES = ("arrive", "schedule", "launch", "result", "process")
TARGET_BATCH = 256
TARGET_US_PER_TOKEN = 15.0
KV_SLOTS = 1 << 20
EOS = 257
PRINTABLE_LOW, PRINTABLES = 32, 95  # tokens stay printable bytes, never EOS
NEVER = 1 << 30  # max_new_tokens of a request that decodes for the whole run


@dataclass(frozen=True)
class CoreCpuConfig:
    batch_sizes: tuple[int, ...] = BATCH_SIZES
    steps: int = 200  # measured steps per batch size
    warmup_steps: int = 50  # after every request decodes, before the measured steps
    prompt_len: int = 16
    max_batch_tokens: int = PolicyConfig.max_batch_tokens
    small_batch: int = PolicyConfig.small_batch  # batches up to this size are also run with it 0
    idle_batch_sizes: tuple[int, ...] = IDLE_BATCH_SIZES
    idle_ms: tuple[float, ...] = IDLE_MS
    idle: IdleWay = IDLE_WAYS[0]
    turnover_outputs: tuple[int, ...] = TURNOVER_OUTPUTS
    turnover_batch_sizes: tuple[int, ...] = TURNOVER_BATCH_SIZES
    wake_latency_us: int | None = None  # the CPUs' idle states held to this (None: the host's)


@dataclass(frozen=True)
class StepTimes:
    phase_ns: tuple[int, ...]  # in PHASES order
    tokens: int  # sampled ids applied by this step's process phase
    arrived: int  # requests added under the arrive phase
    launch_bytes: int
    outputs_bytes: int

    @property
    def total_ns(self) -> int:
        return sum(self.phase_ns)


@dataclass(frozen=True)
class CoreCpuRow:
    batch_size: int
    path: str  # "rows": a small batch a row at a time (`PolicyConfig.small_batch`); "columns"
    steps: int
    tokens_per_step: float
    us_per_step: float  # median over the measured steps
    us_per_step_mean: float  # mean: includes the steps a garbage collection lands in
    us_per_token: float  # median µs per step / tokens per step
    phase_us: dict[str, float]  # median of each phase
    launch_bytes: float  # serialized launch per step (median)
    outputs_bytes: float  # serialized frontend messages per step (median)
    idle_ms: float = 0.0  # idle before each step (0: back to back)
    output_len: int = 0  # turnover: each request's exact output (0: requests never end)
    arrivals_per_step: float = 0.0  # turnover: requests that started (and ended) per step, mean


@dataclass(frozen=True)
class CoreCpuRun:
    config: CoreCpuConfig
    started_at: datetime
    machine: Machine
    rows: tuple[CoreCpuRow, ...]
    loop_s: tuple[float, float] | None = None  # the loop calibration before and after the rows


# ---- the two sides of the core ---------------------------------------------------------------


@dataclass(eq=False)
class WireSink:
    """A frontend as the core's link sees it: each message is serialized and dropped."""

    messages: int = 0
    unread_bytes: int = 0

    def send(self, outputs: StepOutputs) -> None:
        wire = core_pb2.CoreMessage(outputs=outputs_to_proto(outputs)).SerializeToString()
        self.messages += 1
        self.unread_bytes += len(wire)

    def take_bytes(self) -> int:
        """Bytes serialized since the last call."""
        taken, self.unread_bytes = self.unread_bytes, 0
        return taken


@dataclass
class HostWorker:
    """Executes serialized launches in launch order and answers each at once. A decode row
    reads the token its request slot's FutureMap entry holds (KeyError: never written)."""

    future_map: dict[int, int] = field(default_factory=dict)
    next_step: int = 1

    def run(self, wire: bytes) -> bytes:
        launch = launch_from_proto(worker_pb2.SchedulerMessage.FromString(wire).launch)
        assert launch.step_id == self.next_step, f"step {launch.step_id}, expected {self.next_step}"
        self.next_step += 1
        for slot in launch.released_slots:
            self.future_map.pop(slot, None)
        result = StepResult(launch.step_id, self._sample(launch))
        return worker_pb2.WorkerMessage(result=result_to_proto(result)).SerializeToString()

    def _sample(self, launch: Launch) -> list[int]:
        prompt = iter(launch.prompt_ids)
        sampled = []
        for slot, start, n, from_future, sample in launch.rows():
            last = self.future_map[slot] if from_future else [next(prompt) for _ in range(n)][-1]
            if sample:
                self.future_map[slot] = token = next_token(last, start + n)
                sampled.append(token)
        return sampled


def next_token(last: int, position: int) -> int:
    return PRINTABLE_LOW + (last * 31 + position) % PRINTABLES


# ---- the core's path -------------------------------------------------------------------------


def worker_info(batch_size: int) -> WorkerInfo:
    return WorkerInfo("host", 258, NEVER, (EOS,), 256, KV_SLOTS, batch_size, "host", TokenizerSpec("byte"))


class CorePath:
    """`batch_size` requests through the policy in overlap order: pick and launch k, then
    process k-1. With `output_len`, each request ends after that many tokens, and new ones
    arrive (`Arrivals`) to keep `batch_size` live."""

    def __init__(self, config: CoreCpuConfig, batch_size: int, small_batch: int, output_len: int = 0) -> None:
        self.batch_size = batch_size
        self.telemetry = SchedulerTelemetry("overlap")
        self.outbox = Outbox()
        policy_config = PolicyConfig(
            config.max_batch_tokens, max_running=batch_size, max_waiting=batch_size, small_batch=small_batch
        )
        self.policy = SchedulingPolicy(policy_config, self.outbox, self.telemetry)
        self.policy.begin_session(worker_info(batch_size))
        self.sink = WireSink()
        self.worker = HostWorker()
        self.in_flight: tuple[ScheduledBatch, bytes] | None = None
        self.arrivals = Arrivals(config.prompt_len, output_len) if output_len else None
        if self.arrivals is None:
            for i in range(batch_size):
                self.policy.add_request(request(i, config.prompt_len, self.sink))

    def step(self, arriving: int = 0) -> tuple[ScheduledBatch, StepTimes]:
        """One step; first, with turnover, up to `arriving` new requests (no more than the batch
        has room for)."""
        arrive_ns = arrived = 0
        if self.arrivals is not None:
            arrived = max(0, min(arriving, self.batch_size - len(self.policy.requests)))
            arrive_ns = self._arrive(self.arrivals.wire(arrived)) if arrived > 0 else 0
        t0 = time.perf_counter_ns()
        batch = self._pick()
        t1 = time.perf_counter_ns()
        wire = self._launch(batch)
        t2 = time.perf_counter_ns()
        previous, self.in_flight = self.in_flight, (batch, self.worker.run(wire))  # the worker's: untimed
        result_ns, process_ns, tokens = self._process_previous(previous)
        times = StepTimes(
            (arrive_ns, t1 - t0, t2 - t1, result_ns, process_ns),
            tokens,
            arrived,
            len(wire),
            self.sink.take_bytes(),
        )
        return batch, times

    def _arrive(self, wire: bytes) -> int:
        """Nanoseconds to read a frontend's batch of new requests and add them, as the core's
        link does (`core_side.CoreLink._apply`, `EngineCore.add`)."""
        t0 = time.perf_counter_ns()
        batch = core_pb2.RequestBatch.FromString(wire)
        for req in [core_request(spec_from_proto(m), self.sink) for m in batch.add]:
            self.policy.add_request(req)
        self.outbox.flush()
        return time.perf_counter_ns() - t0

    def _process_previous(self, previous: tuple[ScheduledBatch, bytes] | None) -> tuple[int, int, int]:
        """Nanoseconds to parse and to apply batch k-1's result, and its tokens (0s on the first step)."""
        if previous is None:
            return 0, 0, 0
        t0 = time.perf_counter_ns()
        result = parse_result(previous[1])
        t1 = time.perf_counter_ns()
        tokens = self._process(previous[0], result)
        return t1 - t0, time.perf_counter_ns() - t1, tokens

    def _pick(self) -> ScheduledBatch:
        with self.telemetry.phase("pick", self.policy.next_step_id):
            batch = self.policy.schedule()
        assert batch is not None, "every request runs for the whole benchmark"
        self.telemetry.observe_batch(batch.forward_mode, batch.launch.num_rows, batch.num_tokens)
        return batch

    def _launch(self, batch: ScheduledBatch) -> bytes:
        with self.telemetry.phase("launch", batch.step_id):
            wire = worker_pb2.SchedulerMessage(launch=launch_to_proto(batch.launch)).SerializeToString()
        self.telemetry.observe_result_queue(2)  # queued behind k-1, as the core's queue_result sees it
        return wire

    def _process(self, batch: ScheduledBatch, result: StepResult) -> int:
        self.telemetry.observe_result_queue(1)
        with self.telemetry.phase("process", batch.step_id):
            self.policy.update_from_result(batch, result.token_ids, result.logprobs)
            self.outbox.flush()
        return len(result.token_ids)


@dataclass
class Arrivals:
    """New requests as a frontend sends them: exactly `output_len` tokens each (ignore_eos),
    prompts of random printable tokens (seeded), so none reuses another's prefix."""

    prompt_len: int
    output_len: int
    sent: int = 0
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def wire(self, n: int) -> bytes:
        """The next `n` requests, serialized as the frontend link carries them."""
        batch = core_pb2.RequestBatch()
        for _ in range(n):
            self.sent += 1
            prompt = [PRINTABLE_LOW + self.rng.randrange(PRINTABLES) for _ in range(self.prompt_len)]
            params = SamplingParams(self.output_len, 0.0, 1.0, 0, self.sent, frozenset(), (), True)
            spec = CoreRequestSpec(self.sent, f"t{self.sent}", prompt, params, time.time(), 0)
            batch.add.append(spec_to_proto(spec))
        return batch.SerializeToString()


def request(index: int, prompt_len: int, owner: WireSink) -> Request:
    prompt = [PRINTABLE_LOW + (index + i) % PRINTABLES for i in range(prompt_len)]
    params = SamplingParams(NEVER, 0.0, 1.0, 0, index, frozenset(), (), True)
    return Request(f"r{index}", prompt, params, 0, owner, index)


def parse_result(wire: bytes) -> StepResult:
    return result_from_proto(worker_pb2.WorkerMessage.FromString(wire).result)


# ---- measuring -------------------------------------------------------------------------------


def measure_batch(
    config: CoreCpuConfig, batch_size: int, small_batch: int, idle_ms: float = 0.0
) -> CoreCpuRow:
    """`idle_ms`: idle before each measured step (outside its timing), the config's way."""
    path = CorePath(config, batch_size, small_batch)
    _warm_up(path, config.warmup_steps)
    name = "rows" if batch_size <= small_batch else "columns"
    steps = []
    for _ in range(config.steps):
        if idle_ms:
            idle(config.idle, idle_ms)
        steps.append(path.step()[1])
    return dataclasses.replace(summarize(batch_size, name, steps), idle_ms=idle_ms)


def measure_turnover(config: CoreCpuConfig, batch_size: int, output_len: int) -> CoreCpuRow:
    """Requests of `output_len` tokens, those that ended replaced the step after; about
    batch_size / output_len start a step from the first one on (staggered), and the steps are
    measured once the batch has turned over twice."""
    path = CorePath(config, batch_size, config.small_batch, output_len)
    per_step = -(-batch_size // output_len)
    for _ in range(2 * output_len + config.warmup_steps):
        path.step(per_step)
    steps = [path.step(batch_size)[1] for _ in range(config.steps)]
    row = summarize(batch_size, "columns", steps)
    arrivals = statistics.mean(s.arrived for s in steps)
    return dataclasses.replace(row, output_len=output_len, arrivals_per_step=arrivals)


def idle(way: IdleWay, ms: float) -> None:
    """Let `ms` pass asleep, or spinning on the clock (which touches almost nothing)."""
    if way == "sleep":
        time.sleep(ms / 1e3)
        return
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def _warm_up(path: CorePath, steps: int) -> None:
    """Until two steps in a row decode the whole batch (the second one then processes a
    whole-batch result too), then `steps` more."""
    full, limit = 0, 64 * path.batch_size + 16
    for _ in range(limit):
        batch, _ = path.step()
        full = full + 1 if _decodes_all(batch, path.batch_size) else 0
        if full == 2:
            break
    else:
        raise RuntimeError(f"batch {path.batch_size} never decoded every request in {limit} steps")
    for _ in range(steps):
        path.step()


def _decodes_all(batch: ScheduledBatch, batch_size: int) -> bool:
    return batch.forward_mode == "decode" and batch.launch.num_rows == batch_size


def summarize(batch_size: int, path: str, steps: Sequence[StepTimes]) -> CoreCpuRow:
    totals_us = [s.total_ns / 1e3 for s in steps]
    tokens = statistics.mean(s.tokens for s in steps)
    median_us = statistics.median(totals_us)
    return CoreCpuRow(
        batch_size=batch_size,
        path=path,
        steps=len(steps),
        tokens_per_step=tokens,
        us_per_step=median_us,
        us_per_step_mean=statistics.mean(totals_us),
        us_per_token=median_us / tokens if tokens else 0.0,
        phase_us={
            name: statistics.median(s.phase_ns[i] / 1e3 for s in steps) for i, name in enumerate(PHASES)
        },
        launch_bytes=statistics.median(s.launch_bytes for s in steps),
        outputs_bytes=statistics.median(s.outputs_bytes for s in steps),
    )


def run(config: CoreCpuConfig) -> CoreCpuRun:
    started_at, machine = begin()
    rows: list[CoreCpuRow] = []
    for batch_size in config.batch_sizes:
        rows.append(measure_batch(config, batch_size, config.small_batch))
        if batch_size <= config.small_batch:  # the same batch a column at a time, beside it
            rows.append(measure_batch(config, batch_size, 0))
    for idle_ms in config.idle_ms:  # the policy's path, each step after idle time
        for batch_size in config.idle_batch_sizes:
            rows.append(measure_batch(config, batch_size, config.small_batch, idle_ms))
    for batch_size in config.turnover_batch_sizes:
        for output_len in config.turnover_outputs:
            rows.append(measure_turnover(config, batch_size, output_len))
    return CoreCpuRun(config, started_at, machine, tuple(rows))


# ---- reporting -------------------------------------------------------------------------------


def target_row(run: CoreCpuRun) -> CoreCpuRow | None:
    return steady_row(run, TARGET_BATCH)


def steady_row(run: CoreCpuRun, batch_size: int) -> CoreCpuRow | None:
    """The batch's row a column at a time, back to back, without turnover."""
    return next(
        (
            r
            for r in run.rows
            if r.batch_size == batch_size and r.path == "columns" and not r.idle_ms and not r.output_len
        ),
        None,
    )


def per_request_us(run: CoreCpuRun, row: CoreCpuRow) -> float | None:
    """A turnover row's µs a step over its batch's steady row's, per request that started (and
    one ended) a step: what a request's arrival, admission, first token and end cost the core."""
    steady = steady_row(run, row.batch_size)
    if steady is None or not row.arrivals_per_step:
        return None
    return (row.us_per_step - steady.us_per_step) / row.arrivals_per_step


def envelope(run: CoreCpuRun, command: str) -> Envelope:
    """The frame, with no named plan (the JSON has the `config`) and the load average before only."""
    return Envelope(
        "Engine core CPU per step",
        command,
        asdict(run.config),
        None,
        run.started_at,
        run.machine,
        ("python",),
        clauses=(load_clause(run.machine.get("load_average_1m")),),
        plan_key="config",
    )


def to_json(run: CoreCpuRun, command: str) -> dict[str, Any]:
    target = target_row(run)
    return envelope(run, command).json(
        {
            "phases": list(PHASES),
            "loop_calibration_s": None if run.loop_s is None else list(run.loop_s),
            "cpu_wake_latency_us": run.config.wake_latency_us,
            "rows": [asdict(row) for row in run.rows],
            "turnover_us_per_request": [
                {"batch_size": r.batch_size, "output_len": r.output_len, "us": per_request_us(run, r)}
                for r in run.rows
                if r.output_len
            ],
            "target": {
                "batch_size": TARGET_BATCH,
                "us_per_token_at_most": TARGET_US_PER_TOKEN,
                "measured_us_per_token": None if target is None else target.us_per_token,
                "met": None if target is None else target.us_per_token <= TARGET_US_PER_TOKEN,
            },
        }
    )


def to_markdown(run: CoreCpuRun, command: str) -> str:
    c = run.config
    lines = [
        *table(run.rows),
        "",
        f"- steady rows (output —): every request decodes ({c.prompt_len}-token prompts, admitted and "
        f"prefilled during the warmup, then {c.warmup_steps} more steps); medians over {c.steps} "
        f"steps; token budget {c.max_batch_tokens} per step; one frontend link",
        f"- idle ms: {_IDLE_TEXT[c.idle]} before each step, as the served core waits through a device "
        "step (the caches go cold); 0: back to back",
        f"- idle CPUs: {idle_policy(c.wake_latency_us, run.machine.get('cpuidle'))}",
        "- output: turnover rows, each request's exact output; those that end are replaced the step "
        f"after by new ones ({c.prompt_len}-token random prompts) read from the frontend link's wire "
        "form under `arrive`; req/step: requests that started a step (as many ended); —: requests "
        "never end",
        *turnover_lines(run),
        *calibration_lines(run),
        *target_lines(run),
    ]
    return envelope(run, command).markdown(lines)


_IDLE_TEXT = {"sleep": "asleep", "spin": "spinning on the clock"}


def calibration_lines(run: CoreCpuRun) -> Iterator[str]:
    if run.loop_s is not None:
        before, after = run.loop_s
        yield (
            "- machine speed: a pure Python loop (`for i in range(10**7): s += i*i`) takes "
            f"{before:.2f} s before the rows, {after:.2f} s after"
        )


def turnover_lines(run: CoreCpuRun) -> Iterator[str]:
    for row in run.rows:
        us = per_request_us(run, row) if row.output_len else None
        if us is not None:
            yield (
                f"- a request's turnover at batch {row.batch_size}, {row.output_len}-token outputs: "
                f"{us:.1f} µs of the core's CPU (the row's µs/step over the steady row's, per request "
                "that started)"
            )


def table(rows: Sequence[CoreCpuRow]) -> list[str]:
    header = (
        "| batch | path | idle ms | output | req/step | µs/step | mean µs/step | µs/token | arrive µs "
        "| schedule µs | launch µs | result µs | process µs | launch bytes | outputs bytes |"
    )
    return [header, "|---:|---|" + "---:|" * 13, *(_row(r) for r in rows)]


def _row(r: CoreCpuRow) -> str:
    phases = " | ".join(f"{r.phase_us[p]:,.0f}" for p in PHASES)
    output = f"{r.output_len} | {r.arrivals_per_step:.1f}" if r.output_len else "— | —"
    return (
        f"| {r.batch_size} | {r.path} | {r.idle_ms:g} | {output} | {r.us_per_step:,.0f} "
        f"| {r.us_per_step_mean:,.0f} | {r.us_per_token:.2f} | {phases} | {r.launch_bytes:,.0f} "
        f"| {r.outputs_bytes:,.0f} |"
    )


def target_lines(run: CoreCpuRun) -> Iterator[str]:
    target = target_row(run)
    if target is None:
        return
    verdict = "met" if target.us_per_token <= TARGET_US_PER_TOKEN else "not met"
    yield (
        f"- target: core CPU <= {TARGET_US_PER_TOKEN:g} µs per token at batch {TARGET_BATCH}: "
        f"{target.us_per_token:.2f} µs, {verdict}"
    )


# ---- command line ----------------------------------------------------------------------------


def ints(text: str) -> tuple[int, ...]:
    """A comma-separated list of whole numbers (empty: none)."""
    return tuple(int(n) for n in text.split(",")) if text else ()


def _listed(numbers: tuple[int, ...]) -> str:
    return ",".join(map(str, numbers))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.core_cpu", description=__doc__)
    p.add_argument("--steps", type=int, default=CoreCpuConfig.steps, help="measured steps per batch size")
    p.add_argument("--warmup-steps", type=int, default=CoreCpuConfig.warmup_steps)
    p.add_argument(
        "--batch-sizes",
        type=ints,
        default=BATCH_SIZES,
        help=f"comma-separated (default: {_listed(BATCH_SIZES)})",
    )
    p.add_argument(
        "--idle-ms",
        type=lambda text: tuple(float(ms) for ms in text.split(",")),
        default=IDLE_MS,
        help="comma-separated idle times before each step of the idle rows (default: %(default)s)",
    )
    p.add_argument(
        "--idle-batch-sizes",
        type=ints,
        default=IDLE_BATCH_SIZES,
        help=f"the batch sizes run with idle time (default: {_listed(IDLE_BATCH_SIZES)}; empty: none)",
    )
    p.add_argument("--idle", choices=IDLE_WAYS, default=IDLE_WAYS[0], help="how the idle time passes")
    p.add_argument(
        "--turnover-outputs",
        type=ints,
        default=TURNOVER_OUTPUTS,
        help=f"output lengths of the turnover rows (default: {_listed(TURNOVER_OUTPUTS)}; empty: none)",
    )
    p.add_argument(
        "--turnover-batch-sizes",
        type=ints,
        default=TURNOVER_BATCH_SIZES,
        help=f"the batch sizes run with turnover (default: {_listed(TURNOVER_BATCH_SIZES)})",
    )
    p.add_argument("--out", type=Path, default=RESULTS, help="results directory (default: bench/results)")
    add_wake_latency_argument(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    command = command_line("bench.core_cpu", argv)
    config = CoreCpuConfig(
        args.batch_sizes,
        args.steps,
        args.warmup_steps,
        idle_batch_sizes=args.idle_batch_sizes,
        idle_ms=args.idle_ms,
        idle=args.idle,
        turnover_outputs=args.turnover_outputs,
        turnover_batch_sizes=args.turnover_batch_sizes,
        wake_latency_us=args.cpu_wake_latency_us,
    )
    with cpu_wake_latency(args.cpu_wake_latency_us):
        before = loop_calibration()
        result = run(config)
        result = dataclasses.replace(result, loop_s=(before, loop_calibration()))
    publish("core-cpu", result.started_at, to_json(result, command), to_markdown(result, command), args.out)


if __name__ == "__main__":
    main()
