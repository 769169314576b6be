"""Every way a model is found, made or loaded: `tiny` (seeded weights), a Hugging Face checkpoint
directory, a GGUF file (read by worker_svc.gguf) or `smollm2`, with its tokenizer; and its config alone."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import safetensors.torch
import tokenizers
import torch

from stepahead.protocol import TokenizerSpec
from worker_svc.gguf import SMOLLM2_NAME, gguf_config, load_gguf, smollm2_path
from worker_svc.model import (
    LlamaForCausalLM,
    ModelConfig,
    RopeScaling,
    check_rope_scaling,
    load_weights,
    new_model,
)
from worker_svc.quantization import Int4Blocks
from worker_svc.tensor_parallel import check_divisible

BYTE_TOKENIZER = TokenizerSpec("byte")

# Byte-level vocabulary: ids 0..255 are bytes, 256 is BOS, 257 is EOS.
TINY_CONFIG = ModelConfig(
    vocab_size=258,
    hidden_size=256,
    intermediate_size=688,
    num_layers=4,
    num_heads=8,
    num_kv_heads=2,
    head_dim=32,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_context_len=2048,
    tie_word_embeddings=False,
    eos_token_ids=(257,),
    bos_token_id=256,
    rope_scaling=None,
    name="tiny",
)


# ---------------------------------------------------------------------------------------------
# Finding a model by its --model name


def check_shardable(model: str, size: int) -> None:
    """ValueError, before any rank starts, where `model` cannot run over `size` ranks: the sim
    device, or head counts that do not divide. Reads the model's config only, not its weights."""
    if model == "sim":
        raise ValueError("--tp: the sim device has no weights to shard (run it with --tp 1)")
    check_divisible(model_config(model), size)


def model_config(model: str) -> ModelConfig:
    """The config of `tiny`, `smollm2`, a `.gguf` file or a checkpoint directory, weights unread."""
    if model == "tiny":
        return TINY_CONFIG
    path = smollm2_path() if model == SMOLLM2_NAME else Path(model)
    if path.suffix == ".gguf" and path.is_file():
        return gguf_config(path, SMOLLM2_NAME if model == SMOLLM2_NAME else path.stem)
    if not (path / "config.json").is_file():
        raise ValueError(
            f"--model: {model!r} is not tiny, sim, {SMOLLM2_NAME}, a .gguf file or a checkpoint directory"
        )
    return config_from_hf_dict(json.loads((path / "config.json").read_text()), name=path.name)


def load_llama(
    model: str, device: torch.device, dtype: torch.dtype, tokenizer: Path | None = None
) -> tuple[LlamaForCausalLM, TokenizerSpec]:
    """The model of `tiny`, `smollm2`, a `.gguf` file or a checkpoint directory, in `dtype` on
    `device`, with its tokenizer (`tokenizer`: a tokenizer.json, or a directory with one, used
    instead of the model's own)."""
    llama, spec, _ = load_llama_with_blocks(model, device, dtype, tokenizer)
    return llama, spec


def load_llama_with_blocks(
    model: str,
    device: torch.device,
    dtype: torch.dtype,
    tokenizer: Path | None = None,
    keep_int4: bool = False,
) -> tuple[LlamaForCausalLM, TokenizerSpec, dict[str, Int4Blocks]]:
    """`load_llama`, and with `keep_int4` a GGUF's 4-bit weights as the file holds them."""
    blocks: dict[str, Int4Blocks] = {}
    if model == "tiny":
        llama, spec = build_tiny(dtype, device), BYTE_TOKENIZER
    elif model == SMOLLM2_NAME:
        llama, spec, blocks = _load_gguf(smollm2_path(), dtype, device, SMOLLM2_NAME, keep_int4)
    elif (path := Path(model)).suffix == ".gguf" and path.is_file():
        llama, spec, blocks = _load_gguf(path, dtype, device, path.stem, keep_int4)
    elif path.is_dir():
        model_config(model)  # first: an architecture not served is the first thing to say
        if tokenizer is None and not (path / TOKENIZER_FILE).is_file():
            raise ValueError(
                f"--model {path}: no {TOKENIZER_FILE} there; give the model's tokenizer with "
                f"--tokenizer PATH (a {TOKENIZER_FILE}, or a directory with one)"
            )
        llama = load_hf_checkpoint(path, dtype, device)
        llama.config = _with_special_ids(llama.config, path)
        spec = BYTE_TOKENIZER if tokenizer is not None else checkpoint_tokenizer(path)
    else:
        raise ValueError(
            f"--model: {model!r} is not tiny, sim, {SMOLLM2_NAME}, a .gguf file or a checkpoint directory"
        )
    if tokenizer is not None:
        spec = checkpoint_tokenizer(tokenizer)
        llama.config = _with_special_ids(llama.config, tokenizer)
    return llama, spec, blocks


TOKENIZER_FILE = "tokenizer.json"


def _load_gguf(
    path: Path, dtype: torch.dtype, device: torch.device, name: str, keep_int4: bool
) -> tuple[LlamaForCausalLM, TokenizerSpec, dict[str, Int4Blocks]]:
    loaded = load_gguf(path, dtype, device, name, keep_int4)
    spec = TokenizerSpec("hf", loaded.tokenizer_json, loaded.chat_template or "")
    return loaded.model, spec, loaded.int4_blocks


def checkpoint_chat_template(path: Path) -> str:
    """A checkpoint's chat template: chat_template.jinja, else tokenizer_config.json's."""
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    template = _tokenizer_config(path).get("chat_template")
    return template if isinstance(template, str) else ""


def checkpoint_tokenizer(where: Path) -> TokenizerSpec:
    """The tokenizer of a checkpoint directory (or a --tokenizer: a tokenizer.json, or a
    directory with one): its tokenizer.json and chat template; ValueError naming what is missing."""
    where = Path(where)
    file = where if where.is_file() else where / TOKENIZER_FILE
    if not file.is_file():
        raise ValueError(f"--tokenizer {where}: no {TOKENIZER_FILE} there")
    return TokenizerSpec("hf", file.read_bytes(), checkpoint_chat_template(file.parent))


def _tokenizer_config(directory: Path) -> dict[str, Any]:
    file = directory / "tokenizer_config.json"
    loaded = json.loads(file.read_text()) if file.is_file() else {}
    return loaded if isinstance(loaded, dict) else {}


def _with_special_ids(config: ModelConfig, where: Path) -> ModelConfig:
    """The config with every end-of-sequence id the checkpoint names, as transformers'
    `generate` stops at them: config.json's, generation_config.json's, and tokenizer_config.json's
    `eos_token`; and `bos_token` where config.json names none."""
    directory = where if where.is_dir() else where.parent
    generation_file = directory / "generation_config.json"
    generation = json.loads(generation_file.read_text()) if generation_file.is_file() else {}
    eos = [*config.eos_token_ids, *_token_ids(generation.get("eos_token_id"))]
    bos = config.bos_token_id
    named = _tokenizer_config(directory)
    file = where if where.is_file() else where / TOKENIZER_FILE
    if file.is_file() and named:
        vocab = tokenizers.Tokenizer.from_str(file.read_text())
        eos_id = vocab.token_to_id(_token_text(named.get("eos_token")))
        if eos_id is not None:
            eos.append(eos_id)
        if bos is None:
            bos = vocab.token_to_id(_token_text(named.get("bos_token")))
    ids = tuple(i for i in dict.fromkeys(eos) if i < config.vocab_size)
    return replace(config, eos_token_ids=ids, bos_token_id=bos)


def _token_text(value: object) -> str:
    """A special token as tokenizer_config.json writes it: its text, or {"content": text}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


# ---------------------------------------------------------------------------------------------
# Tiny seeded model


def build_tiny(dtype: torch.dtype, device: torch.device, seed: int = 0) -> LlamaForCausalLM:
    """TINY_CONFIG with seeded weights, bit-identical on every machine for a given seed."""
    model = new_model(TINY_CONFIG, dtype, device)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(_tiny_init(name, tuple(param.shape), generator))
    return model


def _tiny_init(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name == "model.embed_tokens.weight":
        return portable_normal(shape, 1.0, generator)
    if name == "lm_head.weight":
        # Larger than the inner matrices so that logits have a spread of a few units.
        return portable_normal(shape, 0.15, generator)
    return portable_normal(shape, 0.02, generator)


def portable_normal(shape: tuple[int, ...], std: float, generator: torch.Generator) -> torch.Tensor:
    """Approximately normal float32 values, a sum of four uniforms (Irwin-Hall), built only from
    integer draws and exactly rounded arithmetic so that no platform's libm enters the result."""
    draws = torch.randint(0, 1 << 24, (4, *shape), generator=generator, dtype=torch.int64)
    uniforms = (draws.to(torch.float64) + 0.5) / float(1 << 24)
    # Four 25-bit uniforms sum exactly in float64, so summation order cannot matter.
    unit_normal = (uniforms.sum(0) - 2.0) * math.sqrt(3.0)
    return (unit_normal * std).to(torch.float32)


# ---------------------------------------------------------------------------------------------
# HF checkpoints


def config_from_hf_dict(d: dict[str, Any], name: str = "llama") -> ModelConfig:
    """ModelConfig from the config.json dict of a checkpoint of the Llama family: Llama, Mistral,
    Qwen2 or Qwen3; ValueError naming what is not supported."""
    family = _family(d)
    _check_unsupported_options(d, family)
    num_heads = int(d["num_attention_heads"])
    rope_theta, rope_scaling = _rope_settings(d)
    # As transformers builds each: Llama's and Qwen3's attention_bias covers q/k/v and the
    # output; Qwen2's q/k/v always have a bias, its output never; Mistral has none.
    attention_bias = bool(d.get("attention_bias", False)) and family in ("llama", "qwen3")
    window = d.get("sliding_window") if family == "mistral" else None
    max_len = int(d["max_position_embeddings"])
    return ModelConfig(
        vocab_size=int(d["vocab_size"]),
        hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]),
        num_layers=int(d["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
        head_dim=int(d.get("head_dim") or d["hidden_size"] // num_heads),
        rope_theta=rope_theta,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        max_context_len=max_len,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        eos_token_ids=_token_ids(d.get("eos_token_id")),
        bos_token_id=d.get("bos_token_id"),
        rope_scaling=rope_scaling,
        name=name,
        qkv_bias=attention_bias or family == "qwen2",
        o_bias=attention_bias,
        qk_norm=family == "qwen3",
        sliding_window=int(window) if window is not None and int(window) < max_len else None,
        architecture=family,
    )


# The Llama family's members: architectures (config.json) -> model_type.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
MODEL_TYPES = set(ARCHITECTURES.values())


def _family(d: dict[str, Any]) -> str:
    """The member of the Llama family a config describes (its model_type)."""
    architectures = list(d.get("architectures") or [])
    model_type = d.get("model_type")
    known = [ARCHITECTURES[a] for a in architectures if a in ARCHITECTURES]
    if known:
        return known[0]
    if not architectures and model_type in MODEL_TYPES:
        return str(model_type)
    raise ValueError(
        f"unsupported architecture {architectures} (model_type {model_type!r}); supported: "
        f"{', '.join(sorted(ARCHITECTURES))}"
    )


def _check_unsupported_options(d: dict[str, Any], family: str) -> None:
    if d.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported")
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r} (only 'silu')")
    if d.get("use_sliding_window"):
        raise ValueError(
            f"use_sliding_window=true is not supported for {family} (Mistral's sliding_window is)"
        )


def _rope_settings(d: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    # Newer configs fold rope_theta and the scaling into one "rope_parameters" dict.
    params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    rope_theta = float(params.pop("rope_theta", d.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return rope_theta, None
    check_rope_scaling(params)
    return rope_theta, tuple(sorted(params.items()))


def _token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def load_hf_checkpoint(path: Path, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    """Load config.json and every *.safetensors file of a HF Llama checkpoint directory."""
    path = Path(path)
    config = config_from_hf_dict(json.loads((path / "config.json").read_text()), name=path.name)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {path}")
    model = new_model(config, dtype, device)
    load_weights(model, (safetensors.torch.load_file(str(f)) for f in files))
    return model
