"""What a benchmark run measures: devices, configurations, workloads, and the two plans
(`full` for `make bench`, `quick` for `make bench-quick`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from loadgen import RandomDataset
from loadgen.workload import length_bounds

Mode = Literal["serial", "overlap"]
# grpc: the worker over gRPC; socket: over its framed link socket (`stepahead serve`); in-process
Transport = Literal["grpc", "socket", "in-process"]
MODES: tuple[Mode, ...] = ("serial", "overlap")
SIM_KV_SLOTS = 1 << 20  # the sim keeps no KV: a pool this large only keeps preemption out of the runs
DEFAULT_FRONTENDS = 1  # the scheduler's own default for --frontends


@dataclass(frozen=True)
class Device:
    name: str
    worker_args: tuple[str, ...]
    sim_step_ms: float | None = None  # the sim's fixed step time; None for a real model

    def ideal_tokens_per_s(self, concurrency: int) -> float | None:
        """The sim's bound: every step takes the step time and yields one token per running request."""
        return None if self.sim_step_ms is None else concurrency * 1e3 / self.sim_step_ms


def sim(step_ms: float = 10.0, kv_slots: int = SIM_KV_SLOTS) -> Device:
    args = ("--model", "sim", "--sim-step-ms", f"{step_ms:g}", "--sim-token-us", "0")
    return Device("sim", (*args, "--kv-slots", str(kv_slots)), step_ms)


TINY = Device("tiny", ("--model", "tiny"))


@dataclass(frozen=True)
class Configuration:
    device: Device
    mode: Mode
    transport: Transport
    late_pick: bool = False  # overlap only: pick k+1 shortly before forward k ends (--late-pick)
    frontends: int = DEFAULT_FRONTENDS  # frontend processes (--frontends); 0: in the core's process
    extra_args: tuple[str, ...] = ()  # more of the scheduler's flags, after these

    @property
    def name(self) -> str:
        late = ", late pick" if self.mode == "overlap" and self.late_pick else ""
        frontends = "" if self.frontends == DEFAULT_FRONTENDS else f", frontends {self.frontends}"
        extra = f", {' '.join(self.extra_args)}" if self.extra_args else ""
        return f"{self.device.name} {self.mode} {self.transport}{late}{frontends}{extra}"

    @property
    def scheduler_args(self) -> tuple[str, ...]:
        args: tuple[str, ...] = ("--mode", self.mode, "--late-pick" if self.late_pick else "--no-late-pick")
        # NOTE: the scheduler's default is left implicit, so configurations that predate the
        # field keep their exact flags (and names).
        if self.frontends != DEFAULT_FRONTENDS:
            args = (*args, "--frontends", str(self.frontends))
        return (*args, *self.extra_args)

    @property
    def shares_process(self) -> bool:
        """The scheduler's process also runs the worker engine (its CPU time includes the worker's)."""
        return self.transport == "in-process"


@dataclass(frozen=True)
class Workload:
    """A closed loop: `concurrency` requests in flight until `num_prompts` are done, each generating
    exactly its output length (ignore_eos). Lengths are uniform in length * [1 - ratio, 1 + ratio]."""

    num_prompts: int
    concurrency: int
    input_len: int
    output_len: int
    range_ratio: float
    warmup_prompts: int  # sent first, short, at the same concurrency, outside the measurement
    warmup_output_len: int = 8
    seed: int = 0
    request_rate: float = math.inf  # finite: an open loop of Poisson arrivals, concurrency only a cap

    @property
    def closed_loop(self) -> bool:
        return math.isinf(self.request_rate)

    @property
    def dataset(self) -> RandomDataset:
        return RandomDataset(self.input_len, self.output_len, self.range_ratio)

    @property
    def warmup_dataset(self) -> RandomDataset:
        return RandomDataset(self.input_len, self.warmup_output_len, self.range_ratio)

    @property
    def input_bounds(self) -> tuple[int, int]:
        return length_bounds(self.input_len, self.range_ratio)

    @property
    def output_bounds(self) -> tuple[int, int]:
        return length_bounds(self.output_len, self.range_ratio)


@dataclass(frozen=True)
class Case:
    configuration: Configuration
    workload: Workload


@dataclass(frozen=True)
class Sweep:
    """Serial and overlap over gRPC at each concurrency; one process pair per mode serves every
    point, lowest concurrency first, with a warmup before each."""

    device: Device
    concurrencies: tuple[int, ...]
    prompts_per_concurrency: int  # num_prompts = this x concurrency, so every point runs as many waves
    input_len: int
    output_len: int
    range_ratio: float

    def workload(self, concurrency: int) -> Workload:
        return waves(
            self.prompts_per_concurrency, concurrency, self.input_len, self.output_len, self.range_ratio
        )


def waves(
    per_concurrency: int, concurrency: int, input_len: int, output_len: int, range_ratio: float
) -> Workload:
    """A closed loop of `per_concurrency` x `concurrency` requests (as many waves at any
    concurrency), after a warmup of one wave."""
    return Workload(
        num_prompts=per_concurrency * concurrency,
        concurrency=concurrency,
        input_len=input_len,
        output_len=output_len,
        range_ratio=range_ratio,
        warmup_prompts=concurrency,
    )


@dataclass(frozen=True)
class Plan:
    name: str
    cases: tuple[Case, ...]
    sweep: Sweep | None
    arrivals: tuple[Case, ...] = ()  # time to first token under Poisson arrivals
    busy_target: float = 0.95  # the sweep reports the largest concurrency where overlap keeps this


def side_by_side(device: Device, workload: Workload) -> tuple[Case, ...]:
    """Serial and overlap over gRPC, overlap with the worker in the scheduler's process, and
    overlap picking k+1 shortly before forward k ends (late pick)."""
    return tuple(
        Case(configuration, workload)
        for configuration in (
            Configuration(device, "serial", "grpc"),
            Configuration(device, "overlap", "grpc"),
            Configuration(device, "overlap", "in-process"),
            Configuration(device, "overlap", "grpc", late_pick=True),
        )
    )


def poisson_arrivals(device: Device, workload: Workload) -> tuple[Case, ...]:
    """Time to first token when requests arrive at random: serial, overlap, overlap late pick."""
    configurations = (
        Configuration(device, "serial", "grpc"),
        Configuration(device, "overlap", "grpc"),
        Configuration(device, "overlap", "grpc", late_pick=True),
    )
    return tuple(Case(configuration, workload) for configuration in configurations)


SIM_10MS = sim(10.0)
THIRD = 1 / 3  # lengths within a third of the mean: input 48 is 32..64, output 192 is 128..256

FULL = Plan(
    name="full",
    cases=(
        *side_by_side(SIM_10MS, Workload(512, 64, 48, 192, THIRD, warmup_prompts=64)),
        *side_by_side(TINY, Workload(128, 16, 48, 96, THIRD, warmup_prompts=16)),
    ),
    sweep=Sweep(SIM_10MS, (8, 16, 32, 64, 128, 256), 4, 48, 192, THIRD),
    arrivals=poisson_arrivals(SIM_10MS, Workload(400, 256, 48, 128, THIRD, 32, request_rate=25.0)),
)

QUICK = Plan(
    name="quick",
    cases=(
        *side_by_side(SIM_10MS, Workload(96, 32, 48, 96, THIRD, warmup_prompts=32)),
        *side_by_side(TINY, Workload(32, 8, 48, 30, THIRD, warmup_prompts=8)),
    ),
    sweep=Sweep(SIM_10MS, (8, 32, 128), 2, 48, 96, THIRD),
    arrivals=poisson_arrivals(SIM_10MS, Workload(150, 256, 48, 96, THIRD, 16, request_rate=25.0)),
)
