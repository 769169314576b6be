"""Stepahead's CPU kernels (worker_svc/cpu_kernels.c): built once and cached, they compute what their
blocks say (activations rounded to 8 bits a block, as the kernels document), they run on torch's
own OpenMP runtime, a GGUF's Q8_0 and 4-bit tensors come back as the file holds them, and where the
kernels cannot be had the quantized modes fall back to torch's."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import quantize

from worker_svc import cpu_kernels
from worker_svc.cpu_kernels import BLOCK, Q4, Q8, Kernels
from worker_svc.dtypes import choose_dtype
from worker_svc.gguf import dequantize_tensor, int4_blocks
from worker_svc.quantization import BlockLinear, Int4Blocks, kernels_for

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def kernels() -> Kernels:
    loaded = cpu_kernels.load()
    # CI's machines are x86-64 with AVX2 and a C compiler: a missing kernel there is a failure.
    assert loaded is not None, cpu_kernels.unavailable()
    return loaded


def _rounded_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels see it: each block of 32 as two codes over a scale d (its largest magnitude
    / 127), x = d * (q + r / 254), q and r rounded to the nearest."""
    rows, k = x.shape
    blocks = x.reshape(rows, k // BLOCK, BLOCK)
    maxabs = blocks.abs().amax(-1, keepdim=True)
    scaled = blocks * torch.where(maxabs > 0, 127 / maxabs, 0)  # float32, as the kernels scale
    coarse = torch.round(scaled)
    rest = torch.round((scaled - coarse) * 254)
    return ((coarse.double() + rest.double() / 254) * (maxabs.double() / 127)).reshape(rows, k)


def _q4_reference(x: torch.Tensor, blocks: Int4Blocks) -> torch.Tensor:
    """The Q4 product as documented: the codes times the rounded activations, the minima times
    each block's exact sum."""
    rows, k = x.shape
    codes = blocks.codes.double() * blocks.scale.double().repeat_interleave(BLOCK, 1)
    sums = x.double().reshape(rows, k // BLOCK, BLOCK).sum(-1)
    return _rounded_activations(x) @ codes.t() + sums @ blocks.minimum.double().t()


# (rows, inputs, outputs): one row; a partial row tile; more rows than a pass takes (64); a last
# group of outputs short of 8; one block of inputs; smollm2's shapes.
SHAPES = [(1, 576, 960), (3, 64, 40), (70, 96, 13), (5, 32, 8), (16, 1536, 576), (2, 576, 3072)]


@pytest.mark.parametrize(("rows", "inputs", "outputs"), SHAPES)
def test_the_kernels_compute_what_their_blocks_say(
    kernels: Kernels, rows: int, inputs: int, outputs: int
) -> None:
    generator = torch.Generator().manual_seed(rows * 1000 + outputs)
    x = torch.randn(rows, inputs, generator=generator) * 3
    x[0, :BLOCK] = 0  # a block of zeros (a zero scale)
    weight = torch.randn(outputs, inputs, generator=generator) * 0.1
    weight[0] += 2  # a row far from zero: Q4's minimum carries it
    bias = torch.randn(outputs, generator=generator)
    blocks = Int4Blocks.from_weight(weight)
    q4 = BlockLinear.q4(kernels, blocks, bias)
    q8 = BlockLinear.q8(kernels, weight, None)
    with torch.inference_mode():
        expected4 = _q4_reference(x, blocks) + bias.double()
        # float32 sums over up to 1536 inputs, against float64
        torch.testing.assert_close(q4(x).double(), expected4, rtol=1e-5, atol=1e-3)
        expected8 = _rounded_activations(x) @ q8.dequantized().double().t()
        torch.testing.assert_close(q8(x).double(), expected8, rtol=1e-5, atol=1e-3)
        # 15 bits of each block's largest value: within float error of the product in float64.
        plain = x.double() @ q8.dequantized().double().t()
        assert (q8(x).double() - plain).abs().max() <= 1e-4 * plain.abs().max()
        # Rows are independent: each alone gives what it gave in the batch.
        torch.testing.assert_close(q4(x[-1:]), q4(x)[-1:], rtol=0, atol=0)


def test_q8_blocks_are_a_q8_0_files_codes_and_q4_the_files_own(kernels: Kernels, tmp_path: Path) -> None:
    weight = np.random.default_rng(0).normal(0.0, 0.5, (48, 96)).astype(np.float32)
    writer = GGUFWriter(str(tmp_path / "w.gguf"), "llama")
    for name, kind in [("q8", GGMLQuantizationType.Q8_0), ("q4", GGMLQuantizationType.Q4_1)]:
        writer.add_tensor(name, quantize(weight, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    q8_tensor, q4_tensor = GGUFReader(tmp_path / "w.gguf").tensors
    from_file = dequantize_tensor(q8_tensor)
    layer = BlockLinear.q8(kernels, from_file, None)
    # The file's codes come back: rounding its own values again changes none of them.
    torch.testing.assert_close(layer.dequantized(), from_file, rtol=1e-6, atol=0)
    blocks = int4_blocks(q4_tensor)
    assert blocks is not None
    torch.testing.assert_close(
        BlockLinear.q4(kernels, blocks, None).dequantized(),
        dequantize_tensor(q4_tensor),
        rtol=1e-5,
        atol=1e-6,
    )


def test_the_library_is_built_once_a_source_and_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STEPAHEAD_CACHE_DIR", str(tmp_path))
    compiler = os.environ.get("CC") or "cc"
    first = cpu_kernels._build(compiler)
    assert first.parent == tmp_path and first.is_file()
    built_at = first.stat().st_mtime_ns
    assert cpu_kernels._build(compiler) == first and first.stat().st_mtime_ns == built_at
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no partial files left


@pytest.fixture
def fresh_load() -> Iterator[None]:
    cpu_kernels._load.cache_clear()
    yield
    cpu_kernels._load.cache_clear()


def test_without_the_kernels_the_quantized_modes_use_torchs(
    fresh_load: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(cpu_kernels.SWITCH, "off")
    assert cpu_kernels.load() is None and cpu_kernels.unavailable() == f"{cpu_kernels.SWITCH}=off"
    dtype, why = choose_dtype(None, CPU, "int4")
    assert dtype == torch.bfloat16 and "torch's kernels" in why and "STEPAHEAD_CPU_KERNELS=off" in why
    with pytest.raises(ValueError, match="--quantization int8 --dtype float32: no CPU kernels here"):
        choose_dtype("float32", CPU, "int8")
    with pytest.raises(ValueError, match="no CPU kernels here"):
        kernels_for(torch.float32, "int4")


def test_a_failed_build_is_said_and_not_used(
    fresh_load: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("STEPAHEAD_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a compiler that fails every build
    assert cpu_kernels.load() is None
    why = cpu_kernels.unavailable()
    assert why is not None and why.startswith("building cpu_kernels.c: false failed")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    cpu_kernels._load.cache_clear()
    assert cpu_kernels.load() is None and "no C compiler" in str(cpu_kernels.unavailable())


def test_the_default_quantized_mode_is_float32_on_the_kernels(kernels: Kernels) -> None:
    dtype, why = choose_dtype(None, CPU, "int4")
    assert dtype == torch.float32 and "Stepahead's kernels" in why
    assert choose_dtype("bfloat16", CPU, "int4")[0] == torch.bfloat16  # torch's, as asked
    ours = kernels_for(torch.float32, "int4")
    assert ours is not None and ours.path == kernels.path and kernels_for(torch.bfloat16, "int4") is None


def test_the_kernels_run_on_torchs_openmp_threads(kernels: Kernels) -> None:
    """In a fresh process: after torch's and the kernels' parallel regions, one OpenMP runtime is
    mapped (torch's) and no threads were added by the kernels."""
    script = """
import torch
from worker_svc import cpu_kernels
from worker_svc.quantization import BlockLinear, Int4Blocks
torch.set_num_threads(2)
x = torch.randn(16, 1536)
torch.mm(x, torch.randn(1536, 1536))
threads = len(__import__("os").listdir("/proc/self/task"))
layer = BlockLinear.q4(cpu_kernels.load(), Int4Blocks.from_weight(torch.randn(1536, 1536)), None)
for _ in range(3):
    layer(x)
maps = open("/proc/self/maps").read().split()
print(threads, len(__import__("os").listdir("/proc/self/task")), len({m for m in maps if "libgomp" in m}))
"""
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parent.parent,
    )
    assert done.returncode == 0, done.stderr
    before, after, runtimes = map(int, done.stdout.split())
    assert runtimes == 1 and after == before, done.stdout


def test_a_kind_the_kernels_do_not_take_is_refused(kernels: Kernels) -> None:
    codes = cpu_kernels.pack_q8(torch.zeros(8, 32, dtype=torch.int8))
    scale = cpu_kernels.pack_scales(torch.ones(8, 1))
    with pytest.raises(ValueError, match="kind 5"):
        kernels.linear(5, torch.zeros(1, 32), codes, scale, None, 8)
    assert {Q4, Q8} == {4, 8}


def test_the_rms_norm_kernel_is_torchs(kernels: Kernels) -> None:
    generator = torch.Generator().manual_seed(2)
    for shape in [(1, 576), (7, 3, 64), (16, 1536)]:
        x = torch.randn(shape, generator=generator) * 4
        weight = torch.randn(shape[-1], generator=generator)
        expected = torch.nn.functional.rms_norm(x, weight.shape, weight, 1e-5)
        torch.testing.assert_close(kernels.rms_norm(x, weight, 1e-5), expected, rtol=1e-5, atol=1e-5)
    # a view that is not contiguous (q of a fused projection)
    wide = torch.randn(3, 128, generator=generator)
    torch.testing.assert_close(
        kernels.rms_norm(wide[:, :64], weight[:64], 1e-6),
        torch.nn.functional.rms_norm(wide[:, :64], (64,), weight[:64], 1e-6),
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (4, 4), (8, 1)])
def test_the_decode_attention_kernel_is_torchs(kernels: Kernels, heads: int, kv_heads: int) -> None:
    """Rows of different context lengths (padding masked), one with a sliding window, over a
    shuffled pool: the kernel gives what torch's attention gives over the same plan."""
    from worker_svc.layers import grouped_attention

    generator = torch.Generator().manual_seed(heads * 10 + kv_heads)
    d, pool_slots, lengths = 64, 600, [1, 37, 120, 64]
    k_pool = torch.randn(pool_slots, kv_heads, d, generator=generator)
    v_pool = torch.randn(pool_slots, kv_heads, d, generator=generator)
    keys = max(lengths)
    table = torch.randperm(pool_slots, generator=generator)[: len(lengths) * keys].reshape(len(lengths), keys)
    positions = torch.arange(keys)[None, :]
    valid = positions < torch.tensor(lengths)[:, None]
    valid[3] &= positions[0] >= lengths[3] - 16  # a window of 16
    slots = torch.where(valid, table, torch.zeros_like(table))
    q = torch.randn(len(lengths), heads, d, generator=generator) * 2
    k = k_pool.index_select(0, slots.reshape(-1)).view(len(lengths), keys, kv_heads, d)
    v = v_pool.index_select(0, slots.reshape(-1)).view(len(lengths), keys, kv_heads, d)
    expected = grouped_attention(q[:, None], k, v, valid[:, None, None, :])[:, 0]
    got = kernels.decode_attention(q, k_pool, v_pool, slots, valid)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "features",
    [{}, {"qkv_bias": True, "o_bias": True}, {"qk_norm": True}, {"sliding_window": 6}],
    ids=["llama", "biases", "qk-norm", "sliding-window"],
)
def test_a_model_on_the_kernels_computes_what_torchs_operators_do(
    kernels: Kernels, features: dict[str, object]
) -> None:
    """The same quantized tiny model with its norms, rotations and KV writes, silu(gate) * up and
    decode attention on the kernels, then on torch's operators: the same logits (to float error)
    and greedy tokens, decode rows included, for each family member's features."""
    import dataclasses

    from tests.test_quantization import _greedy_run, _random_model
    from worker_svc.layers import Linear, LlamaAttention, LlamaDecoderLayer, LlamaMLP, RMSNorm
    from worker_svc.loading import TINY_CONFIG
    from worker_svc.model import prepare_for_serving

    model = _random_model(dataclasses.replace(TINY_CONFIG, **features), seed=5)  # type: ignore[arg-type]
    prepare_for_serving(model, "int4")
    assert isinstance(model.lm_head, BlockLinear)
    decoder = model.model.layers[0]
    assert isinstance(decoder, LlamaDecoderLayer) and isinstance(decoder.self_attn.qkv_proj, BlockLinear)
    assert isinstance(decoder.mlp.down_proj, Linear)  # 688 inputs, not in blocks of 32: float32 as it was
    on_kernels = [m for m in model.modules() if isinstance(m, (RMSNorm, LlamaAttention, LlamaMLP))]
    assert on_kernels and all(m.kernels is not None for m in on_kernels)
    assert model.model.decode_kernel is None  # the layers' modules, each on the kernels
    prompts = [[5, 17, 99, 3, 250, 42, 7], [1, 2, 3], [9] * 20]
    with torch.inference_mode():
        logits, tokens = _greedy_run(model, prompts, 16)
        for m in on_kernels:
            m.kernels = None
        torch_logits, torch_tokens = _greedy_run(model, prompts, 16)
    # A float-error change to a norm's output can move an activation's second code by one (1/254 of
    # its step): far below the logits' spread (about 4), and the tokens stay the same.
    torch.testing.assert_close(logits, torch_logits, rtol=0, atol=2e-3)
    assert tokens == torch_tokens


@pytest.mark.parametrize(
    "features",
    [{}, {"qkv_bias": True, "o_bias": True}, {"sliding_window": 6}, {"qk_norm": True}],
    ids=["llama", "biases", "sliding-window", "qk-norm"],
)
def test_a_decode_step_runs_the_layers_in_one_call_with_the_modules_bits(
    kernels: Kernels, monkeypatch: pytest.MonkeyPatch, features: dict[str, object]
) -> None:
    """Where all the layers' projections are on the kernels, a step of decode rows alone runs the
    layers as one call (`DecodeLayers`) and gets the same logits, bit for bit, and the same KV pools
    as the layers' modules one by one; a prefill step, and a model with q/k norms, run the modules."""
    import dataclasses

    from tests.test_quantization import _decode_batch, _random_model
    from worker_svc.forward_batch import ForwardBatch
    from worker_svc.layers import KVCache
    from worker_svc.loading import TINY_CONFIG
    from worker_svc.model import prepare_for_serving

    config = dataclasses.replace(TINY_CONFIG, intermediate_size=704, **features)  # type: ignore[arg-type]
    model = _random_model(config, seed=8)
    prepare_for_serving(model, "int4")
    one_call = model.model.decode_kernel
    assert (one_call is None) == ("qk_norm" in features)
    calls: list[int] = []  # the rows of each call
    original = cpu_kernels.DecodeLayers.__call__

    def counted(self: cpu_kernels.DecodeLayers, x: torch.Tensor, *rest: Any) -> torch.Tensor:
        calls.append(x.shape[0])
        return original(self, x, *rest)

    monkeypatch.setattr(cpu_kernels.DecodeLayers, "__call__", counted)
    prompts = [[5, 17, 99, 3, 250, 42, 7], [1, 2, 3, 4, 5, 6, 7], [9] * 7]
    width, steps = 32, 12

    def run(decode_kernel: cpu_kernels.DecodeLayers | None) -> tuple[torch.Tensor, KVCache]:
        model.model.decode_kernel = decode_kernel
        kv = KVCache.allocate(config, len(prompts) * width, torch.float32, CPU)
        table = torch.arange(len(prompts) * width).reshape(len(prompts), width)
        batch = ForwardBatch(  # the prompts in one step: a step that is not decode rows alone
            input_ids=torch.tensor([t for p in prompts for t in p]),
            positions=torch.arange(7).repeat(3),
            out_kv_slots=table[:, :7].reshape(-1),
            row_req_slots=torch.arange(3),
            row_token_starts=[0, 7, 14],
            row_num_tokens=[7, 7, 7],
            row_ctx_lens=[7, 7, 7],
            sample_token_index=torch.tensor([6, 13, 20]),
            req_to_token=table,
        )
        logits = [model(batch, kv)]
        for step in range(steps):
            tokens = logits[-1].argmax(-1).tolist()
            logits.append(model(_decode_batch(tokens, [8 + step] * 3, width), kv))
        return torch.stack(logits), kv

    with torch.inference_mode():
        got, got_kv = run(one_call)
        assert calls == ([] if one_call is None else [3] * steps)
        modules, modules_kv = run(None)
    assert torch.equal(got, modules)
    assert torch.equal(got_kv.k, modules_kv.k) and torch.equal(got_kv.v, modules_kv.v)
    assert got_kv.k.abs().sum() > 0


def test_the_silu_mul_kernel_is_torchs(kernels: Kernels) -> None:
    generator = torch.Generator().manual_seed(4)
    for rows, n in [(1, 1536), (16, 1536), (3, 13)]:  # 13: a tail past the vector width
        gate_up = torch.randn(rows, 2 * n, generator=generator) * 6
        gate_up[0, :3] = torch.tensor([-100.0, 100.0, 0.0])  # far out on both sides
        gate, up = gate_up.chunk(2, dim=-1)
        expected = torch.nn.functional.silu(gate) * up
        torch.testing.assert_close(kernels.silu_mul(gate_up), expected, rtol=1e-6, atol=1e-6)


def test_the_rope_store_kernel_rotates_and_writes_as_torch_does(kernels: Kernels) -> None:
    from worker_svc.loading import TINY_CONFIG
    from worker_svc.rotary import RotaryEmbedding, apply_rotary

    generator = torch.Generator().manual_seed(6)
    heads, kv_heads, d, tokens = 6, 2, TINY_CONFIG.head_dim, 5
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=generator)
    cos, sin = RotaryEmbedding(TINY_CONFIG).at(torch.tensor([0, 7, 8, 9, 100]), torch.float32)
    slots = torch.tensor([3, 40, 41, 42, 9])
    k_pool, v_pool = torch.zeros(64, kv_heads, d), torch.zeros(64, kv_heads, d)
    q = kernels.rope_store(qkv, cos, sin, heads, k_pool, v_pool, slots)
    rotated = apply_rotary(qkv[:, : (heads + kv_heads) * d].view(tokens, -1, d), cos, sin)
    torch.testing.assert_close(q, rotated[:, :heads], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k_pool[slots], rotated[:, heads:], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(v_pool[slots], qkv[:, (heads + kv_heads) * d :].view(tokens, kv_heads, d))
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots] = False
    assert not k_pool[untouched].any() and not v_pool[untouched].any()
