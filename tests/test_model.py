"""The pooled-KV Llama forward against a dense reference, and HF checkpoint loading."""

from __future__ import annotations

import importlib
import json
import math
import pathlib
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
import safetensors.torch
import torch

from worker_svc import layers as layers_module
from worker_svc.backends import LlamaBackend
from worker_svc.forward_batch import ForwardBatch
from worker_svc.hf_config import config_from_hf_dict
from worker_svc.layers import (
    WEIGHT_SIDE_MAX_ROWS,
    Embedding,
    KVCache,
    Linear,
    use_weight_side_products,
    weight_side_product,
)
from worker_svc.loading import BYTE_TOKENIZER, TINY_CONFIG, build_tiny, load_hf_checkpoint
from worker_svc.model import LlamaForCausalLM, ModelConfig

CPU = torch.device("cpu")
NUM_SLOTS = 512
NUM_REQ_SLOTS = 8
UNUSED_SLOT = NUM_SLOTS + 1000  # out of range: reading it would fail loudly


# ---------------------------------------------------------------------------------------------
# Dense reference: the whole sequence at once, no KV pool.


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def checkpoint_weights(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """The model's weights by checkpoint name, whether laid out as loaded or as served (fused)."""
    cfg = model.config
    weights: dict[str, torch.Tensor] = dict(model.state_dict())
    splits = {
        "self_attn.qkv_proj": (("q_proj", "k_proj", "v_proj"), (cfg.q_size, cfg.kv_size, cfg.kv_size)),
        "mlp.gate_up_proj": (("gate_proj", "up_proj"), (cfg.intermediate_size, cfg.intermediate_size)),
    }
    for i in range(cfg.num_layers):
        for fused, (parts, sizes) in splits.items():
            owner = fused.split(".")[0]
            for kind in ("weight", "bias"):
                name = f"model.layers.{i}.{fused}.{kind}"
                if name in weights:
                    for part, piece in zip(parts, torch.split(weights.pop(name), list(sizes)), strict=True):
                        weights[f"model.layers.{i}.{owner}.{part}.{kind}"] = piece
    return weights


def reference_logits(model: LlamaForCausalLM, tokens: list[int]) -> torch.Tensor:
    """Logits [n, V] of every position of `tokens`, computed densely."""
    cfg = model.config
    w = checkpoint_weights(model)
    n, d, group = len(tokens), cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2).float() / d)
    freqs = torch.arange(n).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    dtype = w["model.norm.weight"].dtype
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    x = w["model.embed_tokens.weight"][torch.tensor(tokens)]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        h = rms_norm(x, w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
        q = (h @ w[p + "self_attn.q_proj.weight"].T).view(n, cfg.num_heads, d).transpose(0, 1)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).view(n, cfg.num_kv_heads, d).transpose(0, 1)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(n, cfg.num_kv_heads, d).transpose(0, 1)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
        scores = (q @ k.transpose(1, 2)) / math.sqrt(d)
        attn = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        x = x + attn.transpose(0, 1).reshape(n, -1) @ w[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    x = rms_norm(x, w["model.norm.weight"], cfg.rms_norm_eps)
    return (x @ w["lm_head.weight"].T).float()


# ---------------------------------------------------------------------------------------------
# A minimal KV-slot bookkeeper building ForwardBatch the way a worker would.


@dataclass
class Seq:
    req_slot: int
    tokens: list[int]
    cached: int = 0


@dataclass
class Step:
    seq: Seq
    num_new: int
    sample: bool = True


@dataclass
class SlotPool:
    """Hands out KV slots in a shuffled order, so a request's slots are never contiguous."""

    seed: int
    free: list[int] = field(default_factory=list)
    req_to_token: torch.Tensor = field(
        default_factory=lambda: torch.full(
            (NUM_REQ_SLOTS, TINY_CONFIG.max_context_len), UNUSED_SLOT, dtype=torch.int64
        )
    )

    def __post_init__(self) -> None:
        order = torch.randperm(NUM_SLOTS, generator=torch.Generator().manual_seed(self.seed))
        self.free = order.tolist()

    def batch(self, steps: list[Step]) -> ForwardBatch:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts: list[int] = []
        sample_index: list[int] = []
        for step in steps:
            seq, start = step.seq, step.seq.cached
            new_slots = [self.free.pop() for _ in range(step.num_new)]
            self.req_to_token[seq.req_slot, start : start + step.num_new] = torch.tensor(new_slots)
            starts.append(len(ids))
            ids += seq.tokens[start : start + step.num_new]
            positions += range(start, start + step.num_new)
            slots += new_slots
            seq.cached += step.num_new
            if step.sample:
                sample_index.append(len(ids) - 1)
        return ForwardBatch(
            input_ids=torch.tensor(ids),
            positions=torch.tensor(positions),
            out_kv_slots=torch.tensor(slots),
            row_req_slots=torch.tensor([s.seq.req_slot for s in steps]),
            row_token_starts=starts,
            row_num_tokens=[s.num_new for s in steps],
            row_ctx_lens=[s.seq.cached for s in steps],
            sample_token_index=torch.tensor(sample_index, dtype=torch.int64),
            req_to_token=self.req_to_token,
        )


def sharp_tiny_model(dtype: torch.dtype) -> LlamaForCausalLM:
    """The tiny model with sharper attention, so that position errors show in the logits."""
    model = build_tiny(dtype, CPU, seed=1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(4.0)
    return model


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def expected_last(model: LlamaForCausalLM, steps: list[Step]) -> torch.Tensor:
    rows = [reference_logits(model, s.seq.tokens[: s.seq.cached])[-1] for s in steps if s.sample]
    return torch.stack(rows)


# ---------------------------------------------------------------------------------------------
# Pooled forward == dense reference


@pytest.fixture(scope="module")
def model32() -> LlamaForCausalLM:
    return sharp_tiny_model(torch.float32)


def test_prefill_batch_of_different_lengths(model32: LlamaForCausalLM) -> None:
    pool = SlotPool(seed=0)
    kv = KVCache.allocate(model32.config, NUM_SLOTS, torch.float32, CPU)
    seqs = [Seq(req_slot=r, tokens=random_tokens(n, r)) for r, n in [(3, 5), (0, 23), (5, 1), (1, 40)]]
    steps = [Step(seq, len(seq.tokens)) for seq in seqs]
    logits = model32(pool.batch(steps), kv)
    assert logits.shape == (4, TINY_CONFIG.vocab_size) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected_last(model32, steps), atol=1e-4, rtol=0)


def test_all_positions_can_be_sampled(model32: LlamaForCausalLM) -> None:
    pool = SlotPool(seed=1)
    kv = KVCache.allocate(model32.config, NUM_SLOTS, torch.float32, CPU)
    seq = Seq(req_slot=2, tokens=random_tokens(12, 9))
    batch = pool.batch([Step(seq, 12)])
    batch.sample_token_index = torch.arange(12)
    torch.testing.assert_close(model32(batch, kv), reference_logits(model32, seq.tokens), atol=1e-4, rtol=0)


def test_chunked_prefill_then_mixed_decode(model32: LlamaForCausalLM) -> None:
    pool = SlotPool(seed=2)
    kv = KVCache.allocate(model32.config, NUM_SLOTS, torch.float32, CPU)
    long = Seq(req_slot=4, tokens=random_tokens(30, 11))
    short = Seq(req_slot=1, tokens=random_tokens(9, 12))
    late = Seq(req_slot=6, tokens=random_tokens(14, 13))
    batches = [
        # A first chunk does not sample; its second chunk attends to the first chunk's KV.
        [Step(long, 18, sample=False), Step(short, 9)],
        [Step(late, 7, sample=False), Step(long, 12)],
        # Decode rows next to another request's prefill chunk.
        [Step(short, 1), Step(late, 7), Step(long, 1)],
        [Step(long, 1), Step(short, 1), Step(late, 1)],
        [Step(late, 1), Step(long, 1)],
        [Step(short, 1), Step(late, 1), Step(long, 1)],
    ]
    for number, steps in enumerate(batches):
        for step in steps:
            if step.num_new == 1:
                step.seq.tokens.append(random_tokens(1, 100 * number + step.seq.req_slot)[0])
        logits = model32(pool.batch(steps), kv)
        torch.testing.assert_close(logits, expected_last(model32, steps), atol=1e-4, rtol=0)


def greedy_reference(model: LlamaForCausalLM, prompt: list[int], steps: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(reference_logits(model, tokens)[-1].argmax()))
    return tokens


def test_greedy_decode_float64_matches_reference_exactly() -> None:
    model = sharp_tiny_model(torch.float64)
    pool = SlotPool(seed=3)
    kv = KVCache.allocate(model.config, NUM_SLOTS, torch.float64, CPU)
    prompts = [random_tokens(n, 20 + n) for n in (7, 19, 3)]
    seqs = [Seq(req_slot=r, tokens=list(p)) for r, p in zip((0, 7, 2), prompts, strict=True)]
    logits = model(pool.batch([Step(s, len(s.tokens)) for s in seqs]), kv)
    for _ in range(10):
        for seq, token in zip(seqs, logits.argmax(-1).tolist(), strict=True):
            seq.tokens.append(token)
        logits = model(pool.batch([Step(s, 1) for s in seqs]), kv)
    for seq, prompt in zip(seqs, prompts, strict=True):
        assert seq.tokens == greedy_reference(model, prompt, 10)


def test_tiny_model_is_seeded_and_not_degenerate() -> None:
    a, b = build_tiny(torch.float32, CPU, seed=5), build_tiny(torch.float32, CPU, seed=5)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
    c = build_tiny(torch.float32, CPU, seed=6)
    assert isinstance(a.lm_head, Linear) and isinstance(c.lm_head, Linear)
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    pool = SlotPool(seed=4)
    kv = KVCache.allocate(a.config, NUM_SLOTS, torch.float32, CPU)
    seqs = [Seq(req_slot=r, tokens=random_tokens(6, 50 + r)) for r in range(NUM_REQ_SLOTS)]
    logits = a(pool.batch([Step(s, 6) for s in seqs]), kv)
    assert len(set(logits.argmax(-1).tolist())) >= NUM_REQ_SLOTS // 2
    assert float(logits.std(-1).min()) > 0.5


def test_tiny_weights_are_pinned() -> None:
    # Pinned so a platform or library change in weight generation cannot go unnoticed.
    model = build_tiny(torch.float32, CPU, seed=0)
    embeddings = model.model.embed_tokens
    assert isinstance(embeddings, Embedding)
    assert embeddings.weight[0, :3].tolist() == PINNED_EMBED_SEED0


PINNED_EMBED_SEED0 = [-0.31929007172584534, 1.0462011098861694, 0.14951597154140472]


# ---------------------------------------------------------------------------------------------
# HF checkpoints

SMALL = replace(
    TINY_CONFIG,
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_context_len=128,
    name="small",
)


def hf_config_dict(cfg: ModelConfig) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_context_len,
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": 1,
        "eos_token_id": [2, 3],
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
    }


def random_model(cfg: ModelConfig, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn_like(param) * 0.3)
    return model


def write_checkpoint(
    directory: pathlib.Path, config: dict[str, object], tensors: dict[str, torch.Tensor]
) -> pathlib.Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    safetensors.torch.save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors")
    )
    return directory


def prefill_all_logits(model: LlamaForCausalLM, tokens: list[int]) -> torch.Tensor:
    n = len(tokens)
    req_to_token = torch.full((1, model.config.max_context_len), UNUSED_SLOT)
    slots = torch.randperm(n, generator=torch.Generator().manual_seed(0)) + 3
    req_to_token[0, :n] = slots
    batch = ForwardBatch(
        input_ids=torch.tensor(tokens),
        positions=torch.arange(n),
        out_kv_slots=slots,
        row_req_slots=torch.tensor([0]),
        row_token_starts=[0],
        row_num_tokens=[n],
        row_ctx_lens=[n],
        sample_token_index=torch.arange(n),
        req_to_token=req_to_token,
    )
    kv = KVCache.allocate(model.config, n + 3, torch.float32, CPU)
    logits: torch.Tensor = model(batch, kv)
    return logits


@pytest.mark.parametrize("tied", [False, True])
def test_load_hf_checkpoint_matches_in_memory_model(tmp_path: pathlib.Path, tied: bool) -> None:
    cfg = replace(SMALL, tie_word_embeddings=tied)
    model = random_model(cfg, seed=7)
    tensors = dict(model.state_dict())
    if tied:
        del tensors["lm_head.weight"]
    path = write_checkpoint(tmp_path / "my-llama", hf_config_dict(cfg), tensors)
    loaded = load_hf_checkpoint(path, torch.float32, CPU)
    assert loaded.config == replace(cfg, name="my-llama", eos_token_ids=(2, 3), bos_token_id=1)
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tied
    tokens = random_tokens(20, 3)
    tokens = [t % cfg.vocab_size for t in tokens]
    torch.testing.assert_close(
        prefill_all_logits(loaded, tokens), prefill_all_logits(model, tokens), atol=0, rtol=0
    )


@pytest.fixture
def good_checkpoint() -> tuple[dict[str, object], dict[str, torch.Tensor]]:
    return hf_config_dict(SMALL), dict(random_model(SMALL, seed=8).state_dict())


def test_load_rejects_missing_weight(
    tmp_path: pathlib.Path, good_checkpoint: tuple[dict[str, object], dict[str, torch.Tensor]]
) -> None:
    config, tensors = good_checkpoint
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(32)
    path = write_checkpoint(tmp_path / "ckpt", config, tensors)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight") as err:
        load_hf_checkpoint(path, torch.float32, CPU)
    assert "model.layers.0.self_attn.q_proj.bias" in str(err.value)


def test_load_rejects_wrong_shape(
    tmp_path: pathlib.Path, good_checkpoint: tuple[dict[str, object], dict[str, torch.Tensor]]
) -> None:
    config, tensors = good_checkpoint
    tensors["model.norm.weight"] = torch.ones(31)
    path = write_checkpoint(tmp_path / "ckpt", config, tensors)
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        load_hf_checkpoint(path, torch.float32, CPU)


def test_load_rejects_unsupported_architecture(
    tmp_path: pathlib.Path, good_checkpoint: tuple[dict[str, object], dict[str, torch.Tensor]]
) -> None:
    config, tensors = good_checkpoint
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    path = write_checkpoint(tmp_path / "ckpt", config, tensors)
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_hf_checkpoint(path, torch.float32, CPU)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "dynamic"),
        ({"rope_scaling": {"type": "linear"}}, "factor"),
        ({"mlp_bias": True}, "mlp_bias"),
    ],
)
def test_config_rejects_unsupported_options(override: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config_from_hf_dict({**hf_config_dict(SMALL), **override})


def test_config_defaults_and_rope_parameters() -> None:
    d = hf_config_dict(SMALL)
    for key in ("num_key_value_heads", "rope_theta", "tie_word_embeddings"):
        del d[key]
    d.update(
        eos_token_id=2,
        architectures=["MistralForCausalLM"],
        sliding_window=None,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    )
    cfg = config_from_hf_dict(d)
    assert cfg.num_kv_heads == cfg.num_heads == 4 and cfg.head_dim == 8
    assert cfg.rope_theta == 500000.0 and cfg.eos_token_ids == (2,)
    assert not cfg.tie_word_embeddings
    assert cfg.rope_scaling is not None and dict(cfg.rope_scaling)["factor"] == 8.0


# ---------------------------------------------------------------------------------------------
# Against the transformers implementation, when it is installed


@pytest.mark.parametrize(
    "rope_scaling",
    [
        None,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ],
)
@pytest.mark.parametrize("tied", [False, True])
def test_matches_transformers(
    tmp_path: pathlib.Path, rope_scaling: dict[str, object] | None, tied: bool
) -> None:
    transformers: Any = importlib.import_module("transformers")  # dev dependency: the reference
    hf_config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=10000.0,
        rope_scaling=rope_scaling,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(11)
    hf_model = transformers.LlamaForCausalLM(hf_config).eval()
    with torch.no_grad():
        for param in hf_model.parameters():
            param.normal_(0.0, 0.2)
    hf_model.save_pretrained(tmp_path / "hf-llama")
    ours = load_hf_checkpoint(tmp_path / "hf-llama", torch.float32, CPU)
    assert (ours.config.rope_scaling is not None) == (rope_scaling is not None)
    tokens = [t % 96 for t in random_tokens(40, 4)]
    with torch.no_grad():
        expected = hf_model(torch.tensor([tokens])).logits[0].float()
    torch.testing.assert_close(prefill_all_logits(ours, tokens), expected, atol=1e-4, rtol=1e-4)


def test_weight_side_products_keep_every_weight_and_the_logits() -> None:
    model = build_tiny(torch.float32, CPU)
    before = {name: p.clone() for name, p in model.named_parameters()}
    seqs = [Seq(req_slot=0, tokens=random_tokens(9, 1)), Seq(req_slot=3, tokens=random_tokens(4, 2))]
    expected = model(SlotPool(seed=4).batch([Step(s, len(s.tokens)) for s in seqs]), new_kv(model))
    use_weight_side_products(model)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.weight_side_rows == WEIGHT_SIDE_MAX_ROWS for m in linears)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    for seq in seqs:
        seq.cached = 0
    got = model(SlotPool(seed=4).batch([Step(s, len(s.tokens)) for s in seqs]), new_kv(model))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("rows", [1, 2, 5, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_a_weight_side_product_is_the_linear_layers_product(rows: int, bias: bool) -> None:
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 48, generator=generator)
    weight = torch.randn(80, 48, generator=generator)
    b = torch.randn(80, generator=generator) if bias else None
    got = weight_side_product(x, weight, b)
    assert got.shape == (rows, 80) and got.is_contiguous()
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, b), atol=1e-5, rtol=1e-5)


def test_a_linear_multiplies_weight_side_only_up_to_its_row_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = Linear(8, 4)
    torch.nn.init.normal_(layer.weight)
    calls: list[int] = []

    def counted(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        calls.append(x.shape[0])
        return weight_side_product(x, weight, bias)

    monkeypatch.setattr(layers_module, "weight_side_product", counted)
    layer.weight_side_rows = 3
    for rows in (1, 3, 4):
        layer(torch.ones(rows, 8))
    assert calls == [1, 3]
    layer.weight_side_rows = 0
    layer(torch.ones(1, 8))
    assert calls == [1, 3]


def new_kv(model: LlamaForCausalLM) -> KVCache:
    return KVCache.allocate(model.config, NUM_SLOTS, torch.float32, CPU)


def test_the_cpu_backend_serves_weight_side_products() -> None:
    backend = LlamaBackend(build_tiny(torch.float32, CPU), BYTE_TOKENIZER)
    assert isinstance(backend.model.lm_head, Linear)
    assert backend.model.lm_head.weight_side_rows == WEIGHT_SIDE_MAX_ROWS
