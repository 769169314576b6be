"""The worker's serving layout and its quantized modes (`--quantization int8|int4`): fused
projections that leave float32 as it was, int4 weights taken from a GGUF exactly as the file holds
them, quantized layers that compute what their weights say, and smollm2 quantized staying close to
float32 (held-out likelihood, chat answers through the services)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import openai
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import quantize
from tokenizers import Tokenizer

from stepahead.processes import Service, spawn_scheduler, spawn_worker, wait_serving
from tests.live import CALL_TIMEOUT_S, unused_port
from tests.test_tensor_parallel import GEMMA_FEATURES, MOE_FEATURES, OLMO_FEATURES, OTHER_FEATURES
from worker_svc.cli import parse_args
from worker_svc.cpu_kernels import BLOCK, GROUP, Q4, Q8
from worker_svc.dtypes import choose_dtype
from worker_svc.forward_batch import ForwardBatch
from worker_svc.gguf import SMOLLM2_NAME, dequantize_tensor, int4_blocks, load_gguf, smollm2_path
from worker_svc.layers import Embedding, Int8Embedding, KVCache, Linear, LlamaDecoderLayer, q8_blocks
from worker_svc.loading import TINY_CONFIG, load_llama_with_blocks
from worker_svc.model import LlamaForCausalLM, ModelConfig, new_model, prepare_for_serving
from worker_svc.quantization import (
    BlockLinear,
    Int4Blocks,
    Int4Linear,
    Int8Linear,
    TiedInt8Embedding,
    quantized_linear,
)

CPU = torch.device("cpu")

# Not in any prompt of the tests: text the model is scored on.
HELD_OUT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, "
    "polished the great lens and wrote the weather in a leather book: wind from the north-west, a "
    "grey swell, two fishing boats returning late. In winter the storms came in from the sea and "
    "the tower shook, but the light never failed. When the lamp was finally replaced by an "
    "automatic beacon, he kept the book, and his grandchildren still read it aloud."
)


def _prefill_every_logit(tokens: list[int]) -> ForwardBatch:
    """One row of `tokens`, the logits of each of its positions sampled."""
    n = len(tokens)
    return ForwardBatch(
        input_ids=torch.tensor(tokens),
        positions=torch.arange(n),
        out_kv_slots=torch.arange(n),
        row_req_slots=torch.tensor([0]),
        row_token_starts=[0],
        row_num_tokens=[n],
        row_ctx_lens=[n],
        sample_token_index=torch.arange(n),
        req_to_token=torch.arange(n + 64)[None],
    )


def _decode_batch(tokens: list[int], ctx_lens: list[int], width: int) -> ForwardBatch:
    """One new token per row; row r owns the KV slots r * width ..."""
    rows = len(tokens)
    positions = torch.tensor([c - 1 for c in ctx_lens])
    return ForwardBatch(
        input_ids=torch.tensor(tokens),
        positions=positions,
        out_kv_slots=torch.arange(rows) * width + positions,
        row_req_slots=torch.arange(rows),
        row_token_starts=list(range(rows)),
        row_num_tokens=[1] * rows,
        row_ctx_lens=ctx_lens,
        sample_token_index=torch.arange(rows),
        req_to_token=torch.arange(rows * width).reshape(rows, width),
    )


def _greedy_run(
    model: LlamaForCausalLM, prompts: list[list[int]], steps: int
) -> tuple[torch.Tensor, list[list[int]]]:
    """Prefill each prompt (one row at a time, into its own slots), then decode the rows together:
    the first step's logits and every row's greedy tokens."""
    width = max(len(p) for p in prompts) + steps + 1
    kv = KVCache.allocate(model.config, len(prompts) * width, model.dtype, CPU)
    firsts = []
    for r, prompt in enumerate(prompts):
        n = len(prompt)
        batch = ForwardBatch(
            input_ids=torch.tensor(prompt),
            positions=torch.arange(n),
            out_kv_slots=r * width + torch.arange(n),
            row_req_slots=torch.tensor([r]),
            row_token_starts=[0],
            row_num_tokens=[n],
            row_ctx_lens=[n],
            sample_token_index=torch.tensor([n - 1]),
            req_to_token=torch.arange(len(prompts) * width).reshape(len(prompts), width),
        )
        firsts.append(model(batch, kv))
    logits = torch.cat(firsts)
    tokens = [[int(t)] for t in logits.argmax(-1)]
    lens = [len(p) + 1 for p in prompts]
    for _ in range(steps - 1):
        out = model(_decode_batch([row[-1] for row in tokens], lens, width), kv)
        for row, t in zip(tokens, out.argmax(-1).tolist(), strict=True):
            row.append(t)
        lens = [n + 1 for n in lens]
    return logits, tokens


def _random_model(config: ModelConfig, seed: int) -> LlamaForCausalLM:
    model = new_model(config, torch.float32, CPU)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(0.08 * torch.randn(param.shape, generator=generator))
    return model


@pytest.mark.parametrize(
    "features",
    [{}, {"qkv_bias": True, "o_bias": True}, {"qk_norm": True}],
    ids=["llama", "biases", "qk-norm"],
)
def test_fused_projections_leave_float32_as_it_was(features: dict[str, bool]) -> None:
    import dataclasses

    config = dataclasses.replace(TINY_CONFIG, **features)  # type: ignore[arg-type]
    prompts = [[5, 17, 99, 3, 250, 42, 7], [1, 2, 3]]
    plain = _random_model(config, seed=3)
    served = _random_model(config, seed=3)
    prepare_for_serving(served)
    prepare_for_serving(served)  # a second backend over the same model finds it laid out already
    layer = served.model.layers[0]
    assert isinstance(layer, LlamaDecoderLayer)
    assert layer.self_attn.q_proj is None and layer.mlp.gate_up_proj is not None  # the serving layout
    with torch.inference_mode():
        logits, tokens = _greedy_run(plain, prompts, 12)
        fused_logits, fused_tokens = _greedy_run(served, prompts, 12)
    torch.testing.assert_close(fused_logits, logits, rtol=0, atol=1e-4)  # as transformers is held
    assert fused_tokens == tokens


def _tiny_gguf(path: Path, kind: GGMLQuantizationType, weight: np.ndarray) -> GGUFReader:
    writer = GGUFWriter(str(path), "llama")
    data = quantize(weight, kind)
    writer.add_tensor("blk.0.ffn_up.weight", data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFReader(path)


@pytest.mark.parametrize("kind", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1], ids=["Q4_0", "Q4_1"])
def test_int4_blocks_are_the_files_own_weights(tmp_path: Path, kind: GGMLQuantizationType) -> None:
    weight = np.random.default_rng(0).normal(0.0, 0.5, (48, 96)).astype(np.float32)
    weight[3] += 7.0  # a row far from zero: Q4_1's minimum carries it
    (tensor,) = _tiny_gguf(tmp_path / "w.gguf", kind, weight).tensors
    blocks = int4_blocks(tensor)
    assert blocks is not None and blocks.codes.shape == (48, 96) and blocks.scale.shape == (48, 3)
    assert int(blocks.codes.max()) <= 15
    # Exactly what llama.cpp's reader dequantizes, not an approximation of the float weights.
    assert torch.equal(blocks.dequantized(), dequantize_tensor(tensor))


def q4_k_bytes(rows: int, columns: int, seed: int) -> np.ndarray:
    """Q4_K blocks [rows, columns / 256 * 144] as llama.cpp lays them out, of random contents: fp16
    d and dmin, 12 bytes of packed 6-bit scales and minima (any 12 bytes are such), 128 of codes."""
    rng = np.random.default_rng(seed)
    count = rows * columns // 256
    d = rng.uniform(0.001, 0.02, count).astype(np.float16).view(np.uint8).reshape(count, 2)
    dmin = rng.uniform(0.001, 0.02, count).astype(np.float16).view(np.uint8).reshape(count, 2)
    rest = rng.integers(0, 256, (count, 140), dtype=np.uint8)
    return np.concatenate([d, dmin, rest], axis=1).reshape(rows, -1)


def test_q4_k_blocks_are_the_files_own_weights(tmp_path: Path) -> None:
    """Q4_K (most 4-bit files' type, Q4_K_M's): each group of 32 its own scale and minimum, the
    same weights as the `gguf` package dequantizes, to the bit."""
    writer = GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    writer.add_tensor("blk.0.ffn_up.weight", q4_k_bytes(8, 512, 1), raw_dtype=GGMLQuantizationType.Q4_K)
    writer.add_tensor(
        "blk.0.ffn_gate_exps.weight",
        q4_k_bytes(3 * 8, 256, 2).reshape(3, 8, -1),
        raw_dtype=GGMLQuantizationType.Q4_K,
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    matrix, stacked = GGUFReader(tmp_path / "k.gguf").tensors
    blocks = int4_blocks(matrix)
    assert blocks is not None and blocks.codes.shape == (8, 512) and blocks.scale.shape == (8, 16)
    assert len(set(blocks.scale[0].tolist())) > 2 and len(set(blocks.minimum[0].tolist())) > 2
    assert torch.equal(blocks.dequantized(), dequantize_tensor(matrix))
    experts = int4_blocks(stacked)
    assert experts is not None and experts.codes.shape == (24, 256)
    assert torch.equal(experts.dequantized(), dequantize_tensor(stacked).reshape(24, 256))


@pytest.mark.parametrize("tied", [False, True])
def test_quantized_serving_keeps_the_embeddings_at_8_bits(tied: bool) -> None:
    """The embedding table is int8 with a scale a group of 32: each row looked up within half a
    step of its group's grid, and no float table of the vocabulary's size left in the model."""
    config = replace(TINY_CONFIG, tie_word_embeddings=tied)
    model = new_model(config, torch.float32, CPU)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.5)
    float_table = model.model.embed_tokens
    assert isinstance(float_table, Embedding)
    table = float_table.weight.detach().clone()
    prepare_for_serving(model, "int8")
    embeddings = model.model.embed_tokens
    own = Int8Embedding(table)
    assert own.codes.dtype == torch.int8
    ids = torch.tensor([0, 5, 257, 5, 100, 1])
    step = table[ids].reshape(len(ids), -1, 32).abs().amax(-1, keepdim=True) / 127
    error = (own(ids).reshape(len(ids), -1, 32) - table[ids].reshape(len(ids), -1, 32)).abs()
    assert bool((error <= step / 2 + 1e-7).all()) and own(ids).dtype == torch.float32
    # Tied: the output layer's Q8 blocks are the table, read in place, to the bit.
    assert isinstance(embeddings, TiedInt8Embedding if tied else Int8Embedding)
    assert torch.equal(embeddings(ids), own(ids))
    assert torch.equal(embeddings(torch.arange(config.vocab_size)), own(torch.arange(config.vocab_size)))
    assert not [name for name, p in model.named_parameters() if p.shape == table.shape]
    rows, width = table.shape
    sizes = {rows * width, -(-rows // GROUP) * GROUP * width}  # a table's codes; the head's, in groups
    tables = [b for b in model.buffers() if b.dtype == torch.int8 and b.numel() in sizes]
    assert len(tables) == (1 if tied else 2)  # the head's codes, and an untied table's own


def test_8_bit_blocks_are_the_same_whatever_rows_are_quantized_at_a_time() -> None:
    """A vocabulary's table is quantized a chunk of rows at a time (no float copy of it made whole):
    the codes and scales are those of the whole table at once, to the bit."""
    weight = torch.randn(37, 96) * torch.logspace(-3, 2, 37)[:, None]
    weight[5] = 0.0  # a row of zeros: scale 0, codes 0
    whole = q8_blocks(weight, 32, chunk_rows=1 << 20)
    groups = weight.reshape(37, 3, 32)
    scale = groups.abs().amax(-1) / 127
    codes = (groups / scale.clamp(min=torch.finfo(torch.float32).tiny)[..., None]).round().clamp(-127, 127)
    assert torch.equal(whole[0], codes.to(torch.int8).reshape(37, 96)) and torch.equal(whole[1], scale)
    for chunk in (1, 4, 36):
        parts = q8_blocks(weight, 32, chunk_rows=chunk)
        assert torch.equal(parts[0], whole[0]) and torch.equal(parts[1], whole[1])


def test_smollm2_int4_blocks_are_its_q4_1_weights() -> None:
    reader = GGUFReader(smollm2_path())
    layer0 = [t for t in reader.tensors if t.name.startswith("blk.0.")]
    checked = 0
    for tensor in layer0:
        blocks = int4_blocks(tensor)
        if tensor.tensor_type == GGMLQuantizationType.Q4_1:
            assert blocks is not None and torch.equal(blocks.dequantized(), dequantize_tensor(tensor))
            checked += 1
        else:
            assert blocks is None  # norms (F32); the Q8_0 embeddings are not 4-bit
    assert checked == 7


def test_quantized_layers_compute_their_weights() -> None:
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(64, 96, generator=generator) * 0.2
    bias = torch.randn(64, generator=generator)
    x = torch.randn(5, 96, generator=generator).bfloat16()
    blocks = Int4Blocks.from_weight(weight)
    assert (blocks.dequantized() - weight).abs().max() <= blocks.scale.max() / 2 + 1e-6
    int4 = Int4Linear(blocks, bias)
    reference = x.float() @ blocks.dequantized().t() + bias
    torch.testing.assert_close(int4(x).float(), reference, rtol=2e-2, atol=5e-2)
    int8 = Int8Linear(weight, None)
    scales = weight.abs().amax(1, keepdim=True) / 127
    reference8 = x.float() @ ((weight / scales).round() * scales.bfloat16().float()).t()
    torch.testing.assert_close(int8(x).float(), reference8, rtol=2e-2, atol=5e-2)
    # The int4 kernel packs outputs by 16: another shape is served at 8 bits.
    odd = Linear(96, 24)
    odd.weight.data = torch.randn(24, 96, generator=generator)
    assert isinstance(quantized_linear(odd, ["x"], "int4", {}), Int8Linear)


def test_quantization_flags_refuse_what_they_cannot_serve(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, said in [
        (
            ["--quantization", "int4", "--dtype", "float16"],
            "--quantization int4: computes in float32 (Stepahead's",
        ),
        (["--quantization", "int8", "--tp", "2"], "--quantization int8: serves with --tp 1 only"),
        (["--quantization", "int2"], "--quantization: invalid choice"),
    ]:
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert said in capsys.readouterr().err
    assert parse_args(["--quantization", "int4"]).placement.quantization == "int4"
    assert parse_args(["--quantization", "int4", "--dtype", "bfloat16"]).placement.dtype == "bfloat16"
    with pytest.raises(ValueError, match="CPU only"):
        choose_dtype(None, torch.device("cuda"), "int4")
    dtype, why = choose_dtype("bfloat16", CPU, "int4")
    assert (
        dtype == torch.bfloat16
        and "int4 weights with bfloat16 activations on the CPU, torch's kernels" in why
    )


def _mean_nll(model: LlamaForCausalLM, tokens: list[int]) -> float:
    kv = KVCache.allocate(model.config, len(tokens) + 64, model.dtype, CPU)
    with torch.inference_mode():
        logits = model(_prefill_every_logit(tokens), kv)
    nll = torch.nn.functional.cross_entropy(logits[:-1].float(), torch.tensor(tokens[1:]))
    return float(nll)


@pytest.fixture(scope="module")
def held_out_tokens() -> list[int]:
    loaded = load_gguf(smollm2_path(), torch.float32, CPU, SMOLLM2_NAME)
    return Tokenizer.from_str(loaded.tokenizer_json.decode()).encode(HELD_OUT).ids


def _served(quantization: str, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """smollm2 as the worker serves it: `quantization` on Stepahead's kernels in float32, on torch's
    in bfloat16."""
    model, _, blocks = load_llama_with_blocks(SMOLLM2_NAME, CPU, dtype, quantization=quantization)
    prepare_for_serving(model, quantization, blocks)
    return model


# Mean per-token negative log-likelihood of HELD_OUT above float32's, in nats, at most (measured:
# float32 4.2498; Stepahead's kernels int4 4.2496 (the file's own 4-bit weights, which float32
# dequantizes), int8 4.2495 (a scale a block of 32, as Q8_0); torch's int4 4.261, int8 4.277).
NLL_MARGIN = {"int8": 0.05, "int4": 0.10}


@pytest.fixture(scope="module")
def exact_nll(held_out_tokens: list[int]) -> float:
    return _mean_nll(_served("none"), held_out_tokens)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["stepahead-kernels", "torch-kernels"])
def test_quantized_smollm2_scores_held_out_text_as_float32_does(
    quantization: str, dtype: torch.dtype, held_out_tokens: list[int], exact_nll: float
) -> None:
    exact = exact_nll
    quantized_model = _served(quantization, dtype)
    layer = quantized_model.model.layers[0]
    assert isinstance(layer, LlamaDecoderLayer)
    if dtype == torch.float32:
        head, projection = quantized_model.lm_head, layer.self_attn.qkv_proj
        assert isinstance(head, BlockLinear) and head.kind == Q8  # the output layer stays at 8 bits
        assert isinstance(projection, BlockLinear) and projection.kind == (
            Q4 if quantization == "int4" else Q8
        )
    else:
        assert isinstance(quantized_model.lm_head, Int8Linear)
        kind = Int4Linear if quantization == "int4" else Int8Linear
        assert isinstance(layer.self_attn.qkv_proj, kind)
    quantized = _mean_nll(quantized_model, held_out_tokens)
    assert math.isfinite(quantized) and 1.0 < exact < 6.0
    assert abs(quantized - exact) <= NLL_MARGIN[quantization], (quantization, exact, quantized)


def test_int4_uses_the_files_blocks_not_a_requantization() -> None:
    model = _served("int4", torch.bfloat16)
    reader = GGUFReader(smollm2_path())
    (down,) = [t for t in reader.tensors if t.name == "blk.0.ffn_down.weight"]
    blocks = int4_blocks(down)
    assert blocks is not None
    decoder = model.model.layers[0]
    assert isinstance(decoder, LlamaDecoderLayer)
    layer = decoder.mlp.down_proj
    assert isinstance(layer, Int4Linear)
    zeros = (blocks.minimum + 8 * blocks.scale).bfloat16()
    assert torch.equal(layer.scales_and_zeros[..., 0], blocks.scale.t().bfloat16())
    assert torch.equal(layer.scales_and_zeros[..., 1], zeros.t())
    # On Stepahead's kernels, the weight read back through them is the file's own.
    ours = _served("int4").model.layers[0]
    assert isinstance(ours, LlamaDecoderLayer) and isinstance(ours.mlp.down_proj, BlockLinear)
    torch.testing.assert_close(ours.mlp.down_proj.dequantized(), blocks.dequantized(), rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def int4_services() -> Iterator[Service]:
    worker = spawn_worker(["--model", "smollm2", "--quantization", "int4", "--kv-slots", "2048"])
    scheduler = None
    try:
        wait_serving(worker.address)
        flags = ["--http-port", str(unused_port()), "--worker-step-timeout", str(CALL_TIMEOUT_S)]
        scheduler = spawn_scheduler(worker.address, flags)
        wait_serving(scheduler.address)
        yield scheduler
    finally:
        if scheduler is not None:
            scheduler.stop()
        worker.stop()


@pytest.mark.parametrize(
    ("question", "answer"),
    [("What is the capital of France?", "Paris"), ("What is 2 + 2? Answer with a number.", "4")],
)
def test_int4_smollm2_still_answers_right(int4_services: Service, question: str, answer: str) -> None:
    client = openai.OpenAI(
        base_url=int4_services.http_url + "/v1", api_key="unused", max_retries=0, timeout=CALL_TIMEOUT_S
    )
    reply = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": question}], max_tokens=24, temperature=0
    )
    content = reply.choices[0].message.content
    assert content is not None and answer in content, content


@pytest.mark.parametrize(
    "features",
    [GEMMA_FEATURES, OTHER_FEATURES, MOE_FEATURES, OLMO_FEATURES],
    ids=["gemma", "phi3-smollm3-granite-ministral3", "moe", "olmo"],
)
def test_int8_runs_each_familys_own_arithmetic(features: dict[str, object]) -> None:
    """A model of the family's other members quantized: its projections on the int8 kernels, its
    own norms, scales, caps and rotations in torch (Stepahead's kernels for the small operators
    are Llama's arithmetic, and are left out). Random weights, so closeness is loose: within a
    quarter of the logits' spread (9% and 19% here; with the kernels' small operators run on them
    anyway, 28% and NaN)."""
    import dataclasses

    config = dataclasses.replace(TINY_CONFIG, **features)  # type: ignore[arg-type]
    assert not config.llama_arithmetic and TINY_CONFIG.llama_arithmetic
    prompts = [[5, 17, 99, 3, 250, 42, 7], [1, 2, 3]]
    plain, served = _random_model(config, seed=3), _random_model(config, seed=3)
    prepare_for_serving(served, "int8")
    assert served.model.decode_kernel is None and served.model.norm.kernels is None
    # The reference looks up the same 8-bit embeddings: the projections' and operators' error is
    # what is measured (these random weights amplify the embeddings' rounding by a third again).
    embeddings, float_table = served.model.embed_tokens, plain.model.embed_tokens
    assert isinstance(embeddings, Int8Embedding | TiedInt8Embedding) and isinstance(float_table, Embedding)
    with torch.no_grad():
        float_table.weight.copy_(embeddings(torch.arange(config.vocab_size)))
    # Every projection is on the kernels (each expert's, in a sparse MLP) but the routers and those
    # whose inputs are not in blocks of 32 (these tiny MLPs' down projections).
    modules = dict(served.named_modules())
    left = [name for name, m in modules.items() if type(m) is Linear]
    routers = (".mlp.gate", ".mlp.shared_expert_gate")
    assert all(name.endswith(routers) or modules[name].weight.shape[1] % BLOCK for name in left), left
    experts = [name for name, m in modules.items() if ".experts." in name and isinstance(m, BlockLinear)]
    assert len(experts) == 2 * config.num_experts * sum(map(config.sparse, range(config.num_layers)))
    with torch.inference_mode():
        logits, _ = _greedy_run(plain, prompts, 12)
        quantized, _ = _greedy_run(served, prompts, 12)
    assert float((quantized - logits).abs().max()) < 0.25 * float(logits.std())
