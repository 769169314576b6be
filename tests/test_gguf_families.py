"""GGUF files of the mixtures of experts (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral as
llama.cpp writes it: a `llama` file with experts) and of Phi-3 (its fused q/k/v and gate/up; Phi-4-
mini's partial rotation and longrope): a tiny random checkpoint written by transformers, converted
as llama.cpp's converter converts it (its names, the experts stacked in one tensor each, q/k rows
permuted for `llama`), then read by Stepahead. The reference is the model the file was written
from (its weights Q8_0-rounded as the file holds them) and, for the architectures transformers'
GGUF loading reads, transformers reading the file: the same logits at every step.

transformers' reader takes the experts' widths from its config classes' defaults (768 for
Qwen3-MoE; 1408 and a 5632-wide shared expert for Qwen2-MoE), not from the file: the files here
have those widths, as the published models do.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import pathlib
from typing import Any

import numpy as np
import pytest
import torch
from gguf import (
    ExpertGatingFuncType,
    GGMLQuantizationType,
    GGUFReader,
    GGUFWriter,
    RopeScalingType,
    dequantize,
    quantize,
)

from tests.test_architectures import hf_logits, ours_greedy
from tests.test_checkpoint import write_tokenizer
from tests.test_gguf import (
    GGUF_BLOCK_NAMES,
    add_shape,
    add_tokenizer,
    assert_served_greedy_equals,
    assert_served_greedy_equals_transformers,
    permute_rotary_rows,
    read_by_transformers,
)
from worker_svc.gguf import FileBlocks, load_gguf, tokenizer_from_gguf
from worker_svc.hf_config import config_from_hf_dict
from worker_svc.model import ModelConfig
from worker_svc.quantization import Int4Blocks
from worker_svc.rotary import RotaryEmbedding

transformers: Any = importlib.import_module("transformers")  # dev dependency: the reference

CPU = torch.device("cpu")
Q8_0, Q4_0 = GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0
LOGIT_TOLERANCE = 1e-4
BOUNDARY = 64  # the longrope checkpoint's original context

COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 0,
}
LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0 + 0.1 * i for i in range(12)],
    "long_factor": [2.0 + 0.5 * i for i in range(12)],
    "original_max_position_embeddings": BOUNDARY,
}
# kind -> transformers' config class, the GGUF architecture, the config's own settings
KINDS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3moe": (
        "Qwen3MoeConfig",
        "qwen3moe",
        {"head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True},
    ),
    "qwen2moe": ("Qwen2MoeConfig", "qwen2moe", {"num_experts": 4, "num_experts_per_tok": 2}),
    # a dense layer beside a sparse one (mlp_only_layers), which the file tells by its tensors
    "qwen3moe-dense-layer": (
        "Qwen3MoeConfig",
        "qwen3moe",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
        },
    ),
    "mixtral": ("MixtralConfig", "llama", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "phi3": ("Phi3Config", "phi3", {}),
    # its four multipliers (a `llama` file's layout otherwise: q/k rows permuted)
    "granite": (
        "GraniteConfig",
        "granite",
        {
            "embedding_multiplier": 3.0,
            "attention_multiplier": 0.3,
            "residual_multiplier": 0.5,
            "logits_scaling": 4.0,
        },
    ),
    # every fourth layer without a rotation, as llama.cpp fixes it (whatever the checkpoint says)
    "smollm3": ("SmolLM3Config", "smollm3", {"num_hidden_layers": 4, "no_rope_layer_interval": 4}),
    # norms after each block only, q/k norms over the whole projection
    "olmo2": ("Olmo2Config", "olmo2", {"rope_theta": 5e5}),
    # OLMo 3, as llama.cpp's converter writes it (an `olmo2` file with a window): three windowed
    # layers to one global, those rotating unscaled, the global one with the file's yarn
    "olmo3": (
        "Olmo3Config",
        "olmo2",
        {
            "num_hidden_layers": 4,
            "sliding_window": 16,
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        },
    ),
    # norms after each block, per-head q/k norms; windowed layers (the rotating ones) and global
    "exaone4": ("Exaone4Config", "exaone4", {"sliding_window": 16, "sliding_window_pattern": 2}),
    # norms around each block, q/k/v biases, a fused gate/up, half of each head rotated in pairs
    "glm4": ("Glm4Config", "glm4", {"head_dim": 32, "partial_rotary_factor": 0.5}),
    # rope scaling as llama.cpp's converter writes a checkpoint's: yarn (a long-context Qwen's), linear
    "qwen3-yarn": (
        "Qwen3Config",
        "qwen3",
        {
            "head_dim": 32,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 16.0,
            },
        },
    ),
    "llama-linear": ("LlamaConfig", "llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    # Phi-4-mini's: three quarters of each head rotated, longrope, tied embeddings
    "phi3-longrope": (
        "Phi3Config",
        "phi3",
        {
            "partial_rotary_factor": 0.75,
            "rope_scaling": LONGROPE,
            "original_max_position_embeddings": BOUNDARY,
            "tie_word_embeddings": True,
        },
    ),
}
READ_BY_TRANSFORMERS = ("qwen3moe", "qwen2moe", "phi3")

GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
BLOCK_NAMES = {
    **GGUF_BLOCK_NAMES,
    "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_up_proj": "ffn_up",  # Phi-3's, fused as llama.cpp keeps it
    "mlp.gate": "ffn_gate_inp",
    "mlp.experts.down_proj": "ffn_down_exps",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
# Where the norms are on the blocks' outputs, as llama.cpp's converter names them.
OUTPUT_NORM_NAMES = {
    "post_attention_layernorm": "post_attention_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
FAMILY_BLOCK_NAMES = {
    "olmo2": {**BLOCK_NAMES, **OUTPUT_NORM_NAMES},
    "exaone4": {**BLOCK_NAMES, **OUTPUT_NORM_NAMES},
    "glm4": {
        **BLOCK_NAMES,
        "post_self_attn_layernorm": "post_attention_norm",
        "post_attention_layernorm": "ffn_norm",
        "post_mlp_layernorm": "post_ffw_norm",
    },
}
PERMUTED = ("llama", "granite", "smollm3")  # whose q/k rows llama.cpp's converter permutes


def gguf_pieces(name: str, param: torch.Tensor, architecture: str) -> list[tuple[str, torch.Tensor]]:
    """The GGUF tensors a transformers parameter is written as, each with its view of the
    parameter: the experts' fused gate/up split into llama.cpp's stacked gate and up."""
    module, _, suffix = name.rpartition(".")
    if module in GLOBAL_NAMES:
        return [(f"{GLOBAL_NAMES[module]}.{suffix}", param)]
    _, _, layer, rest = name.split(".", 3)
    if rest == "mlp.experts.gate_up_proj":
        width = param.shape[1] // 2
        return [
            (f"blk.{layer}.ffn_gate_exps.weight", param[:, :width]),
            (f"blk.{layer}.ffn_up_exps.weight", param[:, width:]),
        ]
    if rest == "mlp.experts.down_proj":
        return [(f"blk.{layer}.ffn_down_exps.weight", param)]
    names = FAMILY_BLOCK_NAMES.get(architecture, BLOCK_NAMES)
    return [(f"blk.{layer}.{names[module.split('.', 3)[3]]}.{suffix}", param)]


def write_family_gguf(
    directory: pathlib.Path,
    kind: str,
    experts_type: GGMLQuantizationType = Q8_0,
    gating: ExpertGatingFuncType | None = None,
    matrices_type: GGMLQuantizationType = Q8_0,
    wider: tuple[str, ...] = (),
    pre: str = "default",
) -> tuple[pathlib.Path, Any]:
    """A random `kind` model from transformers, written as a GGUF as llama.cpp converts it:
    matrices `matrices_type` (the experts `experts_type`; those `wider` names Q8_0, as a mixed file
    keeps some), norms, routers and the shared expert's gate F32.
    Returns the file and the model with the weights the file holds, for reference."""
    vocab = write_tokenizer(directory)
    config_class, architecture, extra = KINDS[kind]
    config = getattr(transformers, config_class)(vocab_size=vocab, **{**COMMON, **extra})
    torch.manual_seed(11)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    ours = config_from_hf_dict({**config.to_dict(), "architectures": [type(model).__name__]})
    path = directory / f"{kind}.gguf"
    writer = GGUFWriter(path, architecture)
    add_metadata(writer, ours, kind)
    if gating is not None:
        writer.add_expert_gating_func(gating)
    add_tokenizer(writer, json.loads((directory / "tokenizer.json").read_text()), "gpt2", pre)
    writer.add_pad_token_id(config.pad_token_id)  # Phi-3's config class has its own default otherwise
    with torch.no_grad():
        for name, param in model.state_dict().items():
            if name == "lm_head.weight" and ours.tie_word_embeddings:  # the file holds it once
                continue
            param.normal_(0.0, 0.2)
            for piece_name, piece in gguf_pieces(name, param, architecture):
                heads = {"attn_q": ours.num_heads, "attn_k": ours.num_kv_heads}.get(piece_name.split(".")[-2])
                if architecture in PERMUTED and heads and piece_name.endswith("weight"):
                    # each row is quantized on its own, so the rows of its blocks are permuted alike
                    stored = quantize(piece.numpy(), matrices_type)
                    permuted = permute_rotary_rows(torch.from_numpy(stored), heads).numpy()
                    writer.add_tensor(piece_name, permuted, raw_dtype=matrices_type)
                    piece.copy_(torch.from_numpy(dequantize(stored, matrices_type)))
                elif piece.ndim == 1 or "ffn_gate_inp" in piece_name:
                    writer.add_tensor(piece_name, piece.reshape(-1, piece.shape[-1]).squeeze(0).numpy())
                else:
                    qtype = experts_type if "_exps" in piece_name else matrices_type
                    qtype = Q8_0 if piece_name.split(".")[-2] in wider else qtype
                    stored = quantize(piece.contiguous().numpy(), qtype)
                    writer.add_tensor(piece_name, stored, raw_dtype=qtype)
                    piece.copy_(torch.from_numpy(dequantize(stored, qtype)).reshape(piece.shape))
    if "rope_scaling" in extra:  # llama.cpp's longrope: the factors as tensors
        writer.add_tensor("rope_factors_long.weight", np.array(LONGROPE["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(LONGROPE["short_factor"], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, model


def add_metadata(writer: GGUFWriter, config: ModelConfig, kind: str) -> None:
    """What llama.cpp's converter writes of each: the sizes; the experts' counts and widths; for
    Phi-3 its rotated dimensions, original context, longrope attention factor and sliding window
    (which llama.cpp does not apply)."""
    add_shape(writer, config)
    if config.num_experts:
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.experts_per_token)
        if kind != "mixtral":
            writer.add_expert_feed_forward_length(config.expert_intermediate_size)
        if config.shared_expert_intermediate_size:
            writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if kind == "granite":  # as llama.cpp's converter names them
        writer.add_embedding_scale(config.embedding_scale or 1.0)
        writer.add_attention_scale(config.attention_scale or 1.0)
        writer.add_residual_scale(config.residual_scale)
        writer.add_logit_scale(config.logits_divisor)
    if kind == "glm4":
        writer.add_rope_dimension_count(config.rotary_dim or config.head_dim)
    scaling: dict[str, Any] = dict(config.rope_scaling or ())
    if scaling.get("rope_type") in ("yarn", "linear"):
        writer.add_rope_scaling_type(RopeScalingType(scaling["rope_type"]))
        writer.add_rope_scaling_factor(float(scaling["factor"]))
    if scaling.get("rope_type") == "yarn":
        writer.add_rope_scaling_orig_ctx_len(int(scaling["original_max_position_embeddings"]))
        if "beta_fast" in scaling:
            writer.add_rope_scaling_yarn_beta_fast(float(scaling["beta_fast"]))
    if kind in ("exaone4", "olmo3"):
        assert config.sliding_window is not None and config.sliding_layers is not None
        writer.add_sliding_window(config.sliding_window)
        writer.add_sliding_window_pattern(list(config.sliding_layers))
    if kind.startswith("phi3"):
        writer.add_rope_dimension_count(config.rotary_dim or config.head_dim)
        writer.add_rope_scaling_orig_ctx_len(BOUNDARY if config.rope_scaling else config.max_context_len)
        writer.add_sliding_window(2047)
        if config.rope_scaling:
            scale = config.max_context_len / BOUNDARY
            writer.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(scale) / np.log(BOUNDARY))))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_gguf_computes_as_the_model_it_was_written_from(tmp_path: pathlib.Path, kind: str) -> None:
    path, written = write_family_gguf(tmp_path, kind)
    ours = load_gguf(path, torch.float32, CPU).model
    expected = config_from_hf_dict({**written.config.to_dict(), "architectures": [type(written).__name__]})
    got = ours.config
    for field in ("num_experts", "experts_per_token", "expert_intermediate_size", "normalize_expert_weights"):
        assert getattr(got, field) == getattr(expected, field), field
    assert got.shared_expert_intermediate_size == expected.shared_expert_intermediate_size
    assert got.rotary_dim == expected.rotary_dim
    assert [got.sparse(i) for i in range(2)] == [expected.sparse(i) for i in range(2)]
    for field in (
        "norm_layout",
        "qk_norm",
        "qk_norm_whole",
        "qkv_bias",
        "o_bias",
        "rope_layers",
    ):
        assert getattr(got, field) == getattr(expected, field), field
    if not kind.startswith("phi3"):  # Phi-3's longrope is read from its factor tensors (below)
        assert got.rope_scaling == expected.rope_scaling
    assert (got.sliding_window, got.sliding_layers) == (expected.sliding_window, expected.sliding_layers)
    assert got.local_rope_theta == expected.local_rope_theta
    tokens = [(7 * i + 3) % got.vocab_size for i in range(37)]
    generated, steps = ours_greedy(ours, tokens, 12, [5, 9, 11, 2, 40])
    reference = hf_logits(written, tokens + generated)[len(tokens) - 1 :]
    torch.testing.assert_close(steps, reference, atol=LOGIT_TOLERANCE, rtol=LOGIT_TOLERANCE)


@pytest.mark.parametrize("kind", READ_BY_TRANSFORMERS)
def test_a_gguf_computes_as_transformers_reading_the_file(tmp_path: pathlib.Path, kind: str) -> None:
    path, _ = write_family_gguf(tmp_path, kind)
    reference = read_by_transformers(path)
    ours = load_gguf(path, torch.float32, CPU).model
    tokens = [(5 * i + 1) % ours.config.vocab_size for i in range(29)]
    generated, steps = ours_greedy(ours, tokens, 10, [3, 8, 21])
    expected = hf_logits(reference, tokens + generated)[len(tokens) - 1 :]
    torch.testing.assert_close(steps, expected, atol=LOGIT_TOLERANCE, rtol=LOGIT_TOLERANCE)


def test_phi3s_longrope_past_its_original_context_is_the_checkpoints(tmp_path: pathlib.Path) -> None:
    """The file's factors rotate every position, past the original context too, as the same
    checkpoint's config.json has them (tested against transformers in test_architectures)."""
    path, written = write_family_gguf(tmp_path, "phi3-longrope")
    from_file = load_gguf(path, torch.float32, CPU).model.config
    from_json = config_from_hf_dict({**written.config.to_dict(), "architectures": ["Phi3ForCausalLM"]})
    assert from_file.rotary_dim == from_json.rotary_dim == 24
    positions = torch.tensor([0, 5, BOUNDARY - 1, BOUNDARY, 100, 255])
    tables = [RotaryEmbedding(config).at(positions, torch.float32) for config in (from_file, from_json)]
    for got, want in zip(*tables, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_4_bit_experts_are_kept_as_the_file_has_them(tmp_path: pathlib.Path) -> None:
    """`int4` serving takes a file's own Q4_0 blocks: each expert's rows of the stacked tensor."""
    path, written = write_family_gguf(tmp_path, "qwen3moe", experts_type=Q4_0)
    blocks = load_gguf(path, torch.float32, CPU, quantization="int4").int4_blocks
    stacked = written.state_dict()["model.layers.1.mlp.experts.gate_up_proj"]
    width = stacked.shape[1] // 2
    for expert in range(4):
        got = blocks[f"model.layers.1.mlp.experts.{expert}.up_proj.weight"]
        assert isinstance(got, Int4Blocks)
        assert torch.equal(got.dequantized(), stacked[expert, width:])
    assert dataclasses.astuple(blocks["model.layers.0.mlp.experts.3.down_proj.weight"])[0].shape == (64, 768)


@pytest.mark.parametrize("kind", ["mixtral", "granite", "smollm3", "glm4"])
def test_a_files_4_bit_q_and_k_rows_are_taken_in_the_order_the_model_rotates(
    tmp_path: pathlib.Path, kind: str
) -> None:
    """Rows llama.cpp's converter permuted (`llama`, `granite`, `smollm3`), or that rotate in pairs
    over half of each head (`glm4`): the 4-bit blocks `int4` serving takes are reordered as the
    float weights are, which compute as the checkpoint (above); GLM-4's fused gate/up is split alike."""
    path, _ = write_family_gguf(tmp_path, kind, experts_type=Q4_0, matrices_type=Q4_0)
    model = load_gguf(path, torch.float32, CPU).model
    blocks = FileBlocks(GGUFReader(path), model.config)
    weights = model.state_dict()
    names = [f"model.layers.1.self_attn.{p}_proj.weight" for p in "qk"]
    if kind == "glm4":  # and the halves of its fused gate/up
        names += [f"model.layers.1.mlp.{p}_proj.weight" for p in ("gate", "up")]
    for name in names:
        assert torch.equal(blocks[name].dequantized(), weights[name]), name


def test_a_served_qwen3moe_gguf_streams_transformers_greedy_tokens(tmp_path: pathlib.Path) -> None:
    path, written = write_family_gguf(tmp_path, "qwen3moe")
    assert_served_greedy_equals_transformers(path, written.config.vocab_size)


def test_a_served_glm4_gguf_streams_the_greedy_tokens_of_the_model_it_was_written_from(
    tmp_path: pathlib.Path,
) -> None:
    """GLM-4 (transformers' GGUF reading has no `glm4`): through the services."""
    path, written = write_family_gguf(tmp_path, "glm4")
    assert_served_greedy_equals(path, written, written.config.vocab_size)


@pytest.mark.parametrize("pre", ["glm4", "chatglm-bpe"])
def test_glm4s_byte_level_split_is_its_tokenizers(tmp_path: pathlib.Path, pre: str) -> None:
    """GLM-4's files name their split `glm4` (older ones `chatglm-bpe`), which transformers' GGUF
    conversion does not know: it would split as GPT-2 does. Split as GLM-4's tokenizer.json and
    llama.cpp split it: numbers in threes, contractions of any case apart."""
    path, _ = write_family_gguf(tmp_path, "glm4", pre=pre)
    tokenizer = tokenizer_from_gguf(path)
    assert tokenizer.pre_tokenizer is not None
    words = [word for word, _ in tokenizer.pre_tokenizer.pre_tokenize_str("In 12345 IT'S")]
    assert words == ["In", "Ġ", "123", "45", "ĠIT", "'S"]
    (tmp_path / "gpt2").mkdir()
    default, _ = write_family_gguf(tmp_path / "gpt2", "glm4")
    gpt2 = tokenizer_from_gguf(default).pre_tokenizer
    assert gpt2 is not None and [w for w, _ in gpt2.pre_tokenize_str("In 12345")] == ["In", "Ġ12345"]


def test_a_router_other_than_a_softmax_is_refused_by_name(tmp_path: pathlib.Path) -> None:
    path, _ = write_family_gguf(tmp_path, "qwen3moe", gating=ExpertGatingFuncType.SIGMOID)
    with pytest.raises(ValueError, match=r"qwen3moe\.gguf: expert gating function 2 is not supported"):
        load_gguf(path, torch.float32, CPU)
    (tmp_path / "softmax").mkdir()
    softmax, _ = write_family_gguf(tmp_path / "softmax", "qwen3moe", gating=ExpertGatingFuncType.SOFTMAX)
    assert load_gguf(softmax, torch.float32, CPU).model.config.num_experts == 4
