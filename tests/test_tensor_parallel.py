"""Tensor parallelism (`python -m worker_svc --tp N`): the shards compute the full model, and
through the services TP 2 gives TP 1's tokens in both loops, survives the loss of a rank,
and stops cleanly.

Where TP N and TP 1 part, they may only part where TP 1's two best tokens are within
NEAR_TIE of each other (the all-reduce sums in another order); such positions are printed and
recorded as the test's `near_ties` property, not hidden."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch._C._distributed_c10d import TCPStore

from bench.promtext import scrape, total
from stepahead.processes import (
    START_TIMEOUT_S,
    STOP_TIMEOUT_S,
    Service,
    serving_pair,
    spawn_scheduler,
    spawn_worker,
    wait_serving,
)
from stepahead.v1 import generation_pb2 as pb
from tests.live import (
    CALL_TIMEOUT_S,
    generate,
    request,
    server_info,
    unused_port,
    wait_all_free,
    wait_info,
    wait_until,
)
from worker_svc import ranks as ranks_module
from worker_svc.forward_batch import ForwardBatch
from worker_svc.layers import KVCache, Linear, LlamaDecoderLayer
from worker_svc.loading import TINY_CONFIG, build_tiny
from worker_svc.model import LlamaForCausalLM, new_model
from worker_svc.tensor_parallel import AllReduce, check_divisible, shard_config, shard_model

CPU = torch.device("cpu")
NEAR_TIE = 1e-4
TINY64 = ["--model", "tiny", "--dtype", "float64", "--kv-memory-mib", "4"]


# ---------------------------------------------------------------------------------------------
# The shards, in one process: ranks as threads, the all-reduce over a barrier


class ThreadAllReduce:
    """An all-reduce among threads, summed in rank order (as a reference, not for speed)."""

    def __init__(self, size: int) -> None:
        self._barrier = threading.Barrier(size, timeout=CALL_TIMEOUT_S)  # a hang guard: a rank that died
        self._parts: list[torch.Tensor] = [torch.empty(0)] * size

    def for_rank(self, rank: int) -> AllReduce:
        def all_reduce(tensor: torch.Tensor) -> None:
            self._parts[rank] = tensor.clone()
            self._barrier.wait()
            total = sum(self._parts[1:], self._parts[0].clone())
            self._barrier.wait()
            tensor.copy_(total)

        return all_reduce


def two_row_batch(kv_slots: int) -> list[ForwardBatch]:
    """A prefill of two rows (5 and 9 tokens), then a decode step of both."""
    req_to_token = torch.zeros((2, 32), dtype=torch.int64)
    req_to_token[0, :6] = torch.arange(6)
    req_to_token[1, :10] = torch.arange(6, 16)
    prefill = ForwardBatch(
        input_ids=torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]),
        positions=torch.tensor([*range(5), *range(9)]),
        out_kv_slots=torch.tensor([*range(5), *range(6, 15)]),
        row_req_slots=torch.tensor([0, 1]),
        row_token_starts=[0, 5],
        row_num_tokens=[5, 9],
        row_ctx_lens=[5, 9],
        sample_token_index=torch.tensor([4, 13]),
        req_to_token=req_to_token,
    )
    decode = ForwardBatch(
        input_ids=torch.tensor([2, 7]),
        positions=torch.tensor([5, 9]),
        out_kv_slots=torch.tensor([5, 15]),
        row_req_slots=torch.tensor([0, 1]),
        row_token_starts=[0, 1],
        row_num_tokens=[1, 1],
        row_ctx_lens=[6, 10],
        sample_token_index=torch.tensor([0, 1]),
        req_to_token=req_to_token,
    )
    assert kv_slots >= 16
    return [prefill, decode]


def logits_of(model: LlamaForCausalLM, batches: list[ForwardBatch]) -> list[torch.Tensor]:
    kv = KVCache.allocate(model.config, 16, torch.float64, CPU)
    with torch.inference_mode():
        return [model(batch, kv) for batch in batches]


def sharded_logits(full: LlamaForCausalLM, size: int) -> list[list[torch.Tensor]]:
    reduce = ThreadAllReduce(size)
    shards = [shard_model(full, rank, size, reduce.for_rank(rank)) for rank in range(size)]
    results: list[list[torch.Tensor]] = [[] for _ in range(size)]
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = logits_of(shards[rank], two_row_batch(16))
        except BaseException as exc:  # raised in the test's thread below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(CALL_TIMEOUT_S)  # a hang guard: milliseconds of work
    assert not any(t.is_alive() for t in threads), "a rank's thread hangs"
    if errors:
        raise errors[0]
    return results


def test_two_shards_compute_the_full_models_logits_on_every_rank() -> None:
    full = build_tiny(torch.float64, CPU)
    expected = logits_of(full, two_row_batch(16))
    ranks = sharded_logits(full, 2)
    for rank_logits in ranks:
        for got, want in zip(rank_logits, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-9)
    for got0, got1 in zip(*ranks, strict=True):  # the ranks agree bit for bit: the same tokens
        assert torch.equal(got0, got1)


GEMMA_FEATURES = {
    "norm_offset": True,
    "norm_layout": "sandwich",
    "hidden_act": "gelu_tanh",
    "embedding_scale": 16.0,
    "attention_scale": 0.1,
    "attention_softcap": 5.0,
    "final_softcap": 10.0,
    "qk_norm": True,
    "sliding_window": 4,
    "sliding_layers": (True, False, True, False),
    "local_rope_theta": 100.0,
}
# Past position 4 the long factors: the decode row at position 9 takes them.
LONGROPE = (
    ("long_factor", (4.0,) * 8),
    ("original_max_position_embeddings", 4),
    ("rope_type", "longrope"),
    ("short_factor", (1.5,) * 8),
)
MOE_FEATURES = {
    "num_experts": 4,
    "experts_per_token": 2,
    "expert_intermediate_size": 64,
    "shared_expert_intermediate_size": 96,
    "sparse_layers": (True, False) * 2,
}
OLMO_FEATURES = {"norm_layout": "post", "qk_norm": True, "qk_norm_whole": True}
OTHER_FEATURES = {
    "rotary_dim": 16,
    "rope_scaling": LONGROPE,
    "rope_layers": (True, False, True, True),
    "residual_scale": 0.5,
    "logits_divisor": 2.0,
    "query_scale_beta": 0.3,  # past positions 4 and 8
    "query_scale_span": 4,
}


@pytest.mark.parametrize(
    "features",
    [
        {"qkv_bias": True, "o_bias": True},
        {"qkv_bias": True, "qk_norm": True, "sliding_window": 4},
        GEMMA_FEATURES,
        OTHER_FEATURES,
    ],
    ids=[
        "attention bias",
        "qwen3 norms, qwen2 bias, mistral window",
        "gemma 2 and 3",
        "phi-3 longrope, smollm3 unrotated layers, granite multipliers, ministral 3 query scale",
    ],
)
def test_the_familys_features_shard_too(features: dict[str, object]) -> None:
    """Biases of column-parallel layers split with their rows; the output projection's bias is
    added once, after the sum; q/k norms are per head, so every rank holds them whole; the rest
    (norms around the blocks, scales, caps, windows and rotations by layer) is each rank's whole."""
    config = dataclasses.replace(TINY_CONFIG, **features)  # type: ignore[arg-type]
    full = new_model(config, torch.float64, CPU)
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for param in full.parameters():
            param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float64) * 0.2)
    expected = logits_of(full, two_row_batch(16))
    for rank_logits in sharded_logits(full, 2):
        for got, want in zip(rank_logits, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-9)


@pytest.mark.parametrize(
    ("features", "says"),
    [(MOE_FEATURES, "is a mixture of experts"), (OLMO_FEATURES, "q/k norms span every head")],
    ids=["experts", "olmo"],
)
def test_what_a_rank_cannot_split_is_served_on_one(features: dict[str, object], says: str) -> None:
    config = dataclasses.replace(TINY_CONFIG, **features)  # type: ignore[arg-type]
    check_divisible(config, 1)
    with pytest.raises(ValueError, match=f"--tp 2: tiny('s)? {says}"):
        check_divisible(config, 2)


def test_each_rank_holds_its_share_of_the_heads_and_ffn() -> None:
    local = shard_config(TINY_CONFIG, 2)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (4, 1, 344)
    shard = shard_model(build_tiny(torch.float32, CPU), 1, 2, lambda t: None)
    layer = shard.model.layers[0]
    assert isinstance(layer, LlamaDecoderLayer)
    attn = layer.self_attn
    assert isinstance(attn.q_proj, Linear) and isinstance(attn.o_proj, Linear)
    assert isinstance(shard.lm_head, Linear)
    assert tuple(attn.q_proj.weight.shape) == (128, 256)
    assert tuple(attn.o_proj.weight.shape) == (256, 128)
    assert tuple(shard.lm_head.weight.shape) == (258, 256)  # replicated


@pytest.mark.parametrize(
    ("size", "what"), [(3, "8 attention heads do not divide by 3"), (4, "2 KV heads do not divide by 4")]
)
def test_head_counts_must_divide(size: int, what: str) -> None:
    with pytest.raises(ValueError, match=what):
        shard_config(TINY_CONFIG, size)


# ---------------------------------------------------------------------------------------------
# Through the services


@dataclass(frozen=True)
class Completion:
    tokens: list[int]
    finish: int
    margins: list[float]  # best minus second-best log-probability at each position (TP 1 only)


def workload() -> list[pb.GenerateRequest]:
    """Greedy and seeded requests, short and long prompts (a long one is prefilled in chunks)."""
    texts = [f"Request {i}: " + "the quick brown fox jumps " * (1 + i % 4) for i in range(10)]
    texts.append("x" * 700)
    reqs = [request(t, 40, f"g{i}", logprobs=True, top_logprobs=2) for i, t in enumerate(texts)]
    reqs += [request(t, 40, f"s{i}", temperature=0.9, seed=i, top_p=0.95) for i, t in enumerate(texts[:5])]
    return reqs


def completion(responses: list[pb.GenerateResponse]) -> Completion:
    tokens = [t for r in responses for t in r.token_ids]
    entries = [e for r in responses for e in r.logprobs]
    margins = [e.top_logprobs[0].logprob - e.top_logprobs[1].logprob for e in entries]
    return Completion(tokens, responses[-1].finish_reason, margins)


async def run_all(address: str, reqs: list[pb.GenerateRequest]) -> dict[str, Completion]:
    results = await asyncio.gather(*(generate(address, r) for r in reqs))
    return {r.request_id: completion(rs) for r, rs in zip(reqs, results, strict=True)}


def near_ties(reference: dict[str, Completion], got: dict[str, Completion]) -> list[tuple[str, int, float]]:
    """Where `got` parts from `reference`: (request, position, TP 1's top-2 margin there).

    Greedy requests may part only at a near tie; seeded ones must not part at all (the
    sampler sees logits that differ in their last bits at most)."""
    parted = []
    for rid, want in reference.items():
        have = got[rid]
        first = next(
            (i for i, (a, b) in enumerate(zip(want.tokens, have.tokens, strict=False)) if a != b), None
        )
        if first is None:
            assert have.tokens == want.tokens and have.finish == want.finish, rid
            continue
        margin = want.margins[first] if want.margins else float("inf")
        assert margin < NEAR_TIE, f"{rid} parts at {first} where TP 1's top-2 margin is {margin}"
        parted.append((rid, first, margin))
    return parted


def report(
    record_property: Callable[[str, object], None], label: str, ties: list[tuple[str, int, float]]
) -> None:
    print(f"{label}: {len(ties)} near ties {ties}")
    record_property(f"near_ties {label}", repr(ties))


@pytest.fixture(scope="module")
def tp1() -> Iterator[Service]:
    with serving_pair(TINY64) as (_, scheduler):
        yield scheduler


@pytest.fixture(scope="module")
def tp1_results(tp1: Service) -> dict[str, Completion]:
    return asyncio.run(run_all(tp1.address, workload()))


def test_tp2_gives_tp1s_tokens_in_both_loops_and_sigterm_stops_every_rank(
    tp1: Service, tp1_results: dict[str, Completion], record_property: Callable[[str, object], None]
) -> None:
    worker = spawn_worker([*TINY64, "--tp", "2", "--check-invariants"])  # the ranks agree, each step
    try:
        wait_serving(worker.address)
        ranks = rank_pids(worker.proc)
        assert len(ranks) == 2
        for mode in ("serial", "overlap"):
            scheduler = spawn_scheduler(worker.address, ["--mode", mode])
            try:
                wait_serving(scheduler.address)
                got = asyncio.run(run_all(scheduler.address, workload()))
                report(record_property, f"tp2 {mode}", near_ties(tp1_results, got))
                info = asyncio.run(wait_all_free(scheduler.address))
            finally:
                scheduler.stop()
        reference_info = asyncio.run(server_info(tp1.address))
        assert info.tensor_parallel_size == 2 and reference_info.tensor_parallel_size == 1
        assert info.kv_slots == 2 * reference_info.kv_slots  # each rank holds half the KV heads
        with urllib.request.urlopen(worker.metrics_url, timeout=10) as response:
            assert "stepahead_tensor_parallel_size{" in (text := response.read().decode())
        assert re.search(r"^stepahead_tensor_parallel_size\{.*\} 2\.0$", text, re.M), text
        assert worker.stop() == 0  # SIGTERM
        assert not [pid for pid in ranks if _alive(pid)]
    finally:
        worker.stop()


def test_tp2_speculating_gives_tp1s_tokens(
    tp1_results: dict[str, Completion], record_property: Callable[[str, object], None]
) -> None:
    """Speculative decoding over two ranks: every rank drafts from its own copy of the tokens
    and verifies the same positions (--check-invariants: the ranks sample the same ids). The
    greedy requests ask no log-probabilities here, so that they draft too. Constrained
    requests draft as well: rank 0's matchers mask every entry of their verify rows and it
    shares the ids they draw."""
    reqs = workload()
    for r in reqs:
        r.sampling.logprobs, r.sampling.top_logprobs = False, 0
    repeats = {f"regex{n}": n for n in (6, 7)}
    constrained = [request("abc", 60, rid, regex=f"(abc ){{{n}}}") for rid, n in repeats.items()]
    worker = spawn_worker([*TINY64, "--tp", "2", "--check-invariants"])
    try:
        wait_serving(worker.address)
        spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
        scheduler = spawn_scheduler(worker.address, ["--overlap-depth", "2", "--speculative-config", spec])
        try:
            wait_serving(scheduler.address)
            shaped = asyncio.run(run_all(scheduler.address, constrained))
            accepted = total(scrape(worker.metrics_url), "stepahead_spec_decode_num_accepted_tokens_total")
            assert accepted > 0, "the constrained requests must accept drafts"
            got = asyncio.run(run_all(scheduler.address, reqs))
            asyncio.run(wait_all_free(scheduler.address))
        finally:
            scheduler.stop()
        for rid, n in repeats.items():
            assert bytes(shaped[rid].tokens) == b"abc " * n, rid
            assert shaped[rid].finish == pb.FINISH_REASON_STOP, rid
        report(record_property, "tp2 speculative", near_ties(tp1_results, got))
        more = total(scrape(worker.metrics_url), "stepahead_spec_decode_num_accepted_tokens_total")
        assert more > accepted, "the run must accept drafts"
    finally:
        worker.stop()


def rank_pids(launcher: subprocess.Popen[str]) -> list[int]:
    """The launcher's children: its ranks, in start order (rank 0 first)."""
    with open(f"/proc/{launcher.pid}/task/{launcher.pid}/children") as f:
        return sorted(int(pid) for pid in f.read().split())


def test_killing_a_rank_mid_load_loses_no_request(
    tp1: Service, record_property: Callable[[str, object], None]
) -> None:
    """The group is restarted and every request recomputed; with preemptions on both sides (16
    requests of ~140 tokens: more than TP 1's 1024 KV slots and TP 2's 2048), greedy tokens may
    part only at near ties (see the top)."""
    reqs = [
        request(f"long {i} " * 3, 120, f"k{i}", ignore_eos=True, logprobs=True, top_logprobs=2)
        for i in range(16)
    ]
    reference = asyncio.run(run_all(tp1.address, reqs))
    port = unused_port()
    worker = spawn_worker([*TINY64, "--tp", "2", "--max-restarts", "1"], port)
    try:
        wait_serving(worker.address)
        # --worker-retry-timeout: a hang guard; the group is back in seconds.
        scheduler = spawn_scheduler(worker.address, ["--worker-retry-timeout", "600"])
        try:
            wait_serving(scheduler.address)
            got = asyncio.run(run_while_killing(scheduler.address, reqs, rank_pids(worker.proc)))
            report(record_property, "tp2 rank killed", near_ties(reference, got))
            asyncio.run(wait_all_free(scheduler.address))
        finally:
            scheduler.stop()
        restarted = re.compile(r"rank \d exited with (-9|70): starting the group again")
        wait_until(lambda: any(restarted.search(line) for line in list(worker.output)), "the group restarted")
    finally:
        worker.stop()


def test_a_killed_launcher_takes_its_ranks_with_it_and_frees_the_port() -> None:
    port = unused_port()
    worker = spawn_worker(["--model", "tiny", "--tp", "2"], port)
    try:
        wait_serving(worker.address)
        ranks = rank_pids(worker.proc)
        assert len(ranks) == 2
        worker.proc.kill()  # kill -9: the launcher cannot pass anything on
        worker.proc.wait()
        wait_until(lambda: not [pid for pid in ranks if _alive(pid)], "every rank gone")
    finally:
        worker.stop()
    successor = spawn_worker(["--model", "sim"], port)  # the port is free again
    try:
        wait_serving(successor.address)
    finally:
        successor.stop()


def _alive(pid: int) -> bool:
    """A rank that has not exited (a zombie awaiting its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """The process stopped (SIGSTOP) until the block ends (tests.live.paused, for a bare pid)."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):  # the launcher may have killed it
            os.kill(pid, signal.SIGCONT)


async def run_while_killing(
    address: str, reqs: list[pb.GenerateRequest], ranks: list[int]
) -> dict[str, Completion]:
    """Runs `reqs`, and SIGKILLs rank 1 once every request has been admitted, while rank 0 is
    stopped: no request can end between the look and the kill."""
    calls = asyncio.ensure_future(run_all(address, reqs))
    await wait_info(address, lambda i: i.requests_running == len(reqs), "every request running")
    with stopped(ranks[0]):
        assert (await server_info(address)).requests_running == len(reqs)
        assert not calls.done()
        os.kill(ranks[1], signal.SIGKILL)
    return await calls


@pytest.mark.parametrize(
    ("model", "tp", "says"),
    [("tiny", "4", "2 KV heads do not divide by 4"), ("sim", "2", "the sim device has no weights")],
)
def test_a_group_that_cannot_start_says_why_and_is_not_restarted(model: str, tp: str, says: str) -> None:
    command = [sys.executable, "-m", "worker_svc", "--model", model, "--tp", tp, "--port", "0"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=START_TIMEOUT_S)
    assert done.returncode != 0
    assert says in done.stderr
    assert "starting the group again" not in done.stderr


def test_torchrun_starts_the_ranks_too(tp1_results: dict[str, Completion]) -> None:
    port = unused_port()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["-m", "worker_svc", *TINY64, "--port", str(port), "--metrics-port", "-1"]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_serving(f"127.0.0.1:{port}")
        scheduler = spawn_scheduler(f"127.0.0.1:{port}", [])
        try:
            wait_serving(scheduler.address)
            reqs = [r for r in workload() if r.request_id in ("g0", "g10", "s1")]
            got = asyncio.run(run_all(scheduler.address, reqs))
            assert near_ties({r.request_id: tp1_results[r.request_id] for r in reqs}, got) == []
        finally:
            scheduler.stop()
    finally:
        proc.send_signal(signal.SIGTERM)  # torchrun exits 1 after a signal, whatever its ranks do
        proc.wait(STOP_TIMEOUT_S)


def test_tp3_smollm2_gives_tp1s_greedy_tokens(record_property: Callable[[str, object], None]) -> None:
    """smollm2's 9 heads and 3 KV heads over 3 ranks, float32: near ties are likelier here."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot"]
    reqs = [request(p, 12, f"m{i}", logprobs=True, top_logprobs=2) for i, p in enumerate(prompts)]
    results = []
    for tp in ("1", "3"):
        with serving_pair(["--model", "smollm2", "--tp", tp]) as (_, scheduler):
            results.append(asyncio.run(run_all(scheduler.address, reqs)))
    report(record_property, "smollm2 tp3", near_ties(*results))


def _relay_commands(rank: int, port: int, payloads: list[bytes], received: Any) -> None:
    os.environ.update(
        {ranks_module.STORE_ENV: f"127.0.0.1:{port}", ranks_module.ATTEMPT_ENV: "0", "LOCAL_RANK": str(rank)}
    )
    ranks = ranks_module.join_group(ranks_module.RankPlace(rank, 2, rank), "cpu")
    for payload in payloads:
        if ranks.is_leader:
            ranks.hand_launch_bytes(payload)
        else:
            received.put(ranks.receive())
    ranks.close()


def test_commands_of_any_size_reach_the_other_rank_whole() -> None:
    """One frame for most commands, a second broadcast for what does not fit in it."""
    inline = ranks_module.FRAME_BYTES - ranks_module.HEADER_BYTES
    payloads = [b"", b"x" * 100, bytes(range(256)) * (inline // 256), b"y" * inline, b"z" * (inline + 1)]
    payloads.append(bytes(range(256)) * 300)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    context = multiprocessing.get_context("spawn")
    received = context.Queue()
    procs = [
        context.Process(target=_relay_commands, args=(r, store.port, payloads, received)) for r in range(2)
    ]
    for p in procs:
        p.start()
    got = [received.get(timeout=START_TIMEOUT_S) for _ in payloads]  # each rank imports torch first
    for p in procs:
        p.join(STOP_TIMEOUT_S)
        assert p.exitcode == 0
    assert got == [(ranks_module.Command.LAUNCH, p) for p in payloads]
