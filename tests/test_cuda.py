"""The CUDA tier (`pytest -m cuda`): the worker's streams, staging buffers, FutureMap and engine
on a GPU. Skipped wherever torch.cuda.is_available() is false."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import statistics
import time
from collections.abc import Iterator

import pytest
import torch

from stepahead.processes import serving_pair
from stepahead.protocol import Launch
from tests.harness import mixed_workload
from tests.test_equivalence import serve_both
from tests.test_tensor_parallel import near_ties, run_all, workload
from tests.test_worker_processing import Driver, Live, Spec, decodes, mixed_specs, prefill
from tests.transfer_guard import (
    Script,
    greedy,
    guard_engine,
    run_back_to_back,
    sampled_rows,
    scripted_launches,
)
from worker_svc.backends import load_backend
from worker_svc.device_streams import CudaStreams
from worker_svc.engine import EngineConfig, WorkerEngine
from worker_svc.future_map import FutureMap, FutureMapSentinelError
from worker_svc.loading import build_tiny

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="torch.cuda.is_available() is false: the CUDA tier needs a GPU"
    ),
]

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
MAX_GAP_S = 100e-6


def engine_on(
    device: torch.device,
    dtype: torch.dtype = torch.bfloat16,
    kv_slots: int = 256,
    request_slots: int = 8,
    check_invariants: bool = False,
) -> WorkerEngine:
    backend = load_backend("tiny", device, dtype, 1.0, 0.0)
    config = EngineConfig(kv_slots, request_slots, check_invariants)
    engine = WorkerEngine(backend, config, backend.make_streams(device))
    engine.begin_session().result()
    return engine


@contextlib.contextmanager
def syncs_are_errors() -> Iterator[None]:
    """Any synchronising CUDA call (a blocking copy, .item(), synchronize()) raises."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def test_the_enqueue_path_neither_syncs_nor_transfers_outside_the_streams(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = engine_on(CUDA)
    try:
        launches = scripted_launches().launches
        run_back_to_back(engine, launches)  # first use: library handles, kernel loading
        engine.begin_session().result()
        guard = guard_engine(engine, monkeypatch)
        with syncs_are_errors():
            tokens = run_back_to_back(engine, launches)
        assert not guard.violations, "\n".join(guard.violations)
        assert [len(t) for t in tokens] == [sampled_rows(launch) for launch in launches]
    finally:
        engine.shutdown()


def processing_run(engine: WorkerEngine, specs: list[Spec]) -> list[Live]:
    """Requests using every sampling feature (tests/test_worker_processing.py), one step ahead."""
    drive = Driver(engine)
    lives = [drive.start(spec, slot) for slot, spec in enumerate(specs)]
    drive.launch([prefill(x, len(x.known)) for x in lives], new=lives)
    for _ in range(3):
        drive.launch(decodes(lives))
    drive.finish()
    return lives


def test_logits_processing_neither_syncs_nor_transfers_outside_the_streams(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    specs = list(mixed_specs(build_tiny(torch.float64, CPU)).values())
    engine = engine_on(CUDA, torch.float64)
    try:
        processing_run(engine, specs)  # first use
        engine.begin_session().result()
        guard = guard_engine(engine, monkeypatch)
        with syncs_are_errors():
            on_cuda = processing_run(engine, specs)
        assert not guard.violations, "\n".join(guard.violations)
    finally:
        engine.shutdown()
    cpu = engine_on(CPU, torch.float64)
    try:
        on_cpu = processing_run(cpu, specs)
    finally:
        cpu.shutdown()
    assert [x.tokens for x in on_cuda] == [x.tokens for x in on_cpu]
    for x, y in zip(on_cuda, on_cpu, strict=True):
        for a, b in zip(x.logprobs, y.logprobs, strict=True):
            assert (a is None) == (b is None)
            if a is not None and b is not None:
                assert a[1] == b[1] and a[0] == pytest.approx(b[0], abs=1e-5)


def test_cuda_gives_the_cpu_tokens_in_float64() -> None:
    # Staging, stream order and the FutureMap relay on the device; float64 keeps the two
    # devices' logits within ~1e-15, and the sampler draws alike on both.
    launches = scripted_launches().launches
    on_cpu, on_cuda = (tokens_on(device, launches) for device in (CPU, CUDA))
    assert on_cuda == on_cpu


def tokens_on(device: torch.device, launches: list[Launch]) -> list[list[int]]:
    engine = engine_on(device, torch.float64, check_invariants=True)
    try:
        return run_back_to_back(engine, launches)
    finally:
        engine.shutdown()


def timing_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


def test_cuda_streams_time_each_forward_from_its_events() -> None:
    streams = CudaStreams(CUDA)
    a = torch.randn(2048, 2048, device=CUDA)
    before = time.time()
    pending = []
    for k in range(3):
        with streams.forward():
            inner = timing_event(), timing_event()
            inner[0].record()
            x = a
            for _ in range(10):
                x = (x @ a).clamp_(-1, 1)
            inner[1].record()
            pending.append((streams.copy_to_host(streams.to_device([k, k + 1])), inner))
    done = [(copy.wait(), inner) for copy, inner in pending]
    after = time.time()
    previous_end = before - 2e-3
    for k, ((tokens, timing), (start, end)) in enumerate(done):
        assert tokens.tolist() == [k, k + 1]
        assert previous_end <= timing.forward_start <= timing.forward_end <= timing.copy_end <= after + 2e-3
        assert timing.forward_seconds >= start.elapsed_time(end) / 1e3 - 1e-5
        assert timing.forward_seconds <= start.elapsed_time(end) / 1e3 + 1e-3
        previous_end = timing.forward_end - 1e-6


def test_staged_values_survive_a_device_that_is_behind() -> None:
    # Each step's copies queue behind ~10 ms of spinning, so the host writes the next steps'
    # values while earlier copies are still to run; and some steps outgrow their arena.
    streams = CudaStreams(CUDA)
    sizes = [5_000, 20_000, 5_000, 40_000, 5_000, 5_000]
    staged = []
    for k, n in enumerate(sizes):
        with streams.forward():
            torch.cuda._sleep(20_000_000)  # type: ignore[no-untyped-call]
            ints = streams.to_device(list(range(k, k + n)))
            floats = streams.to_device([k + 0.5] * 3, torch.float32)
            staged.append((ints, floats))
    torch.cuda.synchronize()
    for k, (n, (ints, floats)) in enumerate(zip(sizes, staged, strict=True)):
        assert ints.tolist() == list(range(k, k + n))
        assert floats.tolist() == [k + 0.5] * 3
    assert streams._staging.arenas > 1, "the device was never behind: the test proves nothing"


def test_the_future_map_sentinel_check_on_cuda() -> None:
    fmap = FutureMap(8, CUDA, check_sentinel=True)
    fmap.store(torch.tensor([2, 5], device=CUDA), torch.tensor([11, 12], device=CUDA))
    assert fmap.read(torch.tensor([5, 2], device=CUDA)).tolist() == [12, 11]
    with pytest.raises(FutureMapSentinelError):
        fmap.read(torch.tensor([2, 3], device=CUDA))
    assert fmap.sentinel_reads == 1
    fmap.reset(torch.tensor([2], device=CUDA))
    with pytest.raises(FutureMapSentinelError):
        fmap.read(torch.tensor([2], device=CUDA))


def test_a_decode_before_any_sample_fails_on_cuda() -> None:
    engine = engine_on(CUDA, check_invariants=True)
    try:
        engine.submit(Launch(1, new_requests=[greedy(1)])).result()
        decode = Launch(
            2,
            row_req_slots=[1],
            row_start_pos=[0],
            row_num_tokens=[1],
            row_from_future=[True],
            row_sample=[True],
            kv_slots=[0],
        )
        with pytest.raises(FutureMapSentinelError):
            engine.submit(decode).result()
        assert engine.stats().sentinel_reads == 1
    finally:
        engine.shutdown()


@pytest.mark.anyio
async def test_tiny_overlap_equals_serial_on_cuda() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False  # the default; TF32 would widen row differences
    items = mixed_workload(200, seed=2, sampled=False)
    await serve_both("tiny", items, kv_slots=1500, request_slots=48, dtype=torch.float32, device=CUDA)


def decode_steps(batch: int, steps: int) -> list[Launch]:
    s = Script()
    s.step(
        [s.prefill(slot, list(range(32, 48))) for slot in range(batch)], new=[greedy(r) for r in range(batch)]
    )
    for _ in range(steps):
        s.step([s.decode(slot) for slot in range(batch)])
    return s.launches


def test_back_to_back_decodes_at_batch_64_leave_the_device_idle_under_100us() -> None:
    batch, steps, warmup = 64, 60, 10
    launches = decode_steps(batch, steps)
    engine = engine_on(CUDA, kv_slots=batch * (16 + steps), request_slots=batch)
    try:
        run_back_to_back(engine, launches)  # first use
        engine.begin_session().result()
        results = [future.result(timeout=120) for future in [engine.submit(x) for x in launches]]
    finally:
        engine.shutdown()
    decodes = results[1 + warmup :]
    gaps = [b.forward_start - a.forward_end for a, b in itertools.pairwise(decodes)]
    figures = f"median {statistics.median(gaps) * 1e6:.1f} us, max {max(gaps) * 1e6:.1f} us"
    print(f"device gap between back-to-back decodes at batch {batch}: {figures}")
    assert statistics.median(gaps) < MAX_GAP_S, figures


def test_smollm2_bf16_overlap_equals_serial_through_the_services() -> None:
    """Greedy answers of the real model on the GPU, the same in both loops (bf16)."""
    import asyncio

    import grpc

    from stepahead.processes import serving_pair
    from stepahead.v1 import generation_pb2 as pb
    from stepahead.v1 import generation_pb2_grpc

    prompts = ["What is the capital of France?", "Write a haiku about the sea.", "Count from 1 to 10."]

    async def answers(address: str) -> list[list[int]]:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            calls = [
                stub.Generate(
                    pb.GenerateRequest(text=p, sampling=pb.SamplingParams(max_new_tokens=32)), timeout=120
                )
                for p in prompts
            ]
            return [[t async for r in call for t in r.token_ids] for call in calls]

    got = {}
    for mode in ("serial", "overlap"):
        with serving_pair(["--model", "smollm2", "--device", "cuda"], ["--mode", mode]) as (_, scheduler):
            got[mode] = asyncio.run(answers(scheduler.address))
    assert got["serial"] == got["overlap"]
    assert all(got["overlap"])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism on CUDA needs two GPUs")
def test_tp2_over_nccl_gives_tp1s_tokens_through_the_services() -> None:
    """Two ranks, one GPU each, the model's all-reduces over NCCL and the commands over gloo."""
    flags = ["--model", "tiny", "--device", "cuda", "--dtype", "float32", "--check-invariants"]
    results = []
    for tp in ("1", "2"):
        with serving_pair([*flags, "--tp", tp]) as (_, scheduler):
            results.append(asyncio.run(run_all(scheduler.address, workload())))
    print("near ties:", near_ties(*results))
