"""Every way a model is found, made or loaded: `tiny` (seeded weights), a Hugging Face checkpoint
directory, a GGUF file (read by worker_svc.gguf) or `smollm2`, with its tokenizer; and its config alone."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import tokenizers
import torch

from stepahead.protocol import TokenizerSpec
from worker_svc.gguf import SMOLLM2_NAME, gguf_config, interleaved_to_halves, load_gguf, smollm2_path
from worker_svc.hf_config import config_from_hf_dict, is_vision_language, token_ids
from worker_svc.model import LlamaForCausalLM, ModelConfig, load_weights, new_model, quantize_as_loaded
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
    quantization: str = "none",
) -> tuple[LlamaForCausalLM, TokenizerSpec, Mapping[str, Int4Blocks]]:
    """`load_llama`, each decoder layer quantized as it is loaded (`quantization`: `int8`, `int4`;
    `prepare_for_serving` quantizes the rest), with, for `int4`, a GGUF's 4-bit weights as the
    file holds them."""
    blocks: Mapping[str, Int4Blocks] = {}
    if model == "tiny":
        llama, spec = build_tiny(dtype, device), BYTE_TOKENIZER
    elif model == SMOLLM2_NAME:
        llama, spec, blocks = _load_gguf(smollm2_path(), dtype, device, SMOLLM2_NAME, quantization)
    elif (path := Path(model)).suffix == ".gguf" and path.is_file():
        llama, spec, blocks = _load_gguf(path, dtype, device, path.stem, quantization)
    elif path.is_dir():
        model_config(model)  # first: an architecture not served is the first thing to say
        if tokenizer is None and not (path / TOKENIZER_FILE).is_file():
            raise ValueError(
                f"--model {path}: no {TOKENIZER_FILE} there; give the model's tokenizer with "
                f"--tokenizer PATH (a {TOKENIZER_FILE}, or a directory with one)"
            )
        llama = load_hf_checkpoint(path, dtype, device, quantization)
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
    path: Path, dtype: torch.dtype, device: torch.device, name: str, quantization: str
) -> tuple[LlamaForCausalLM, TokenizerSpec, Mapping[str, Int4Blocks]]:
    loaded = load_gguf(path, dtype, device, name, quantization)
    spec = TokenizerSpec("hf", loaded.tokenizer_json, loaded.chat_template or "")
    return loaded.model, spec, loaded.int4_blocks


def checkpoint_chat_template(path: Path) -> str:
    """A checkpoint's chat template: chat_template.jinja, else tokenizer_config.json's, else
    chat_template.json's (a vision-language checkpoint's processor keeps it there)."""
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    template = _tokenizer_config(path).get("chat_template")
    processor = path / "chat_template.json"
    if not isinstance(template, str) and processor.is_file():
        template = json.loads(processor.read_text()).get("chat_template")
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
    eos = [*config.eos_token_ids, *token_ids(generation.get("eos_token_id"))]
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


def load_hf_checkpoint(
    path: Path, dtype: torch.dtype, device: torch.device, quantization: str = "none"
) -> LlamaForCausalLM:
    """Load config.json and every *.safetensors file of a HF Llama checkpoint directory, a tensor
    at a time; `quantization` (`int8`, `int4`): each decoder layer quantized as soon as it is
    loaded, so that loading holds one layer's weights in `dtype` beside the quantized ones."""
    path = Path(path)
    d = json.loads((path / "config.json").read_text())
    config = config_from_hf_dict(d, name=path.name)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {path}")
    model = new_model(config, dtype, device, lazy_layers=quantization != "none")
    text_only = is_vision_language(d)
    tensors = (language_model(t) if text_only else t for t in _checkpoint_tensors(files))
    load_weights(
        model, (split_fused(config, t) for t in tensors), quantize_as_loaded(model, quantization, {})
    )
    return model


def _checkpoint_tensors(files: list[Path]) -> Iterator[dict[str, torch.Tensor]]:
    """Each tensor of the safetensors files, one at a time (the files are memory-mapped)."""
    for file in files:
        with safetensors.safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (a safetensors handle is not iterable)
                yield {name: handle.get_tensor(name)}


# A vision-language checkpoint's language model's weights, as transformers has named them
# (its older and newer layouts), and the prefixes of the rest, which are left out.
LANGUAGE_MODEL_PREFIXES = {
    "model.language_model.": "model.",
    "language_model.model.": "model.",
    "language_model.lm_head.": "lm_head.",
}
NOT_LANGUAGE_MODEL = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)


def language_model(shard: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`shard`'s language-model weights under the text model's names; the vision tower's and
    projector's dropped (the text is served, not images)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in shard.items():
        if name.startswith(NOT_LANGUAGE_MODEL):
            continue
        prefix = next((p for p in LANGUAGE_MODEL_PREFIXES if name.startswith(p)), None)
        out[name if prefix is None else LANGUAGE_MODEL_PREFIXES[prefix] + name[len(prefix) :]] = tensor
    return out


# Mixtral's names of its sparse MLP's parts -> the model's (Qwen3-MoE's).
MIXTRAL_NAMES = {
    ".block_sparse_moe.": ".mlp.",
    ".w1.": ".gate_proj.",
    ".w2.": ".down_proj.",
    ".w3.": ".up_proj.",
}

# A checkpoint's fused projections (Phi-3's) -> the parts the model loads, in their order.
FUSED_IN_CHECKPOINTS = {
    "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "mlp.gate_up_proj": ("gate_proj", "up_proj"),
}


# GLM-4's names of its four norms -> the model's (the sandwich layout's, Gemma's names)
GLM4_NORMS = {
    "post_self_attn_layernorm": "post_attention_layernorm",
    "post_attention_layernorm": "pre_feedforward_layernorm",
    "post_mlp_layernorm": "post_feedforward_layernorm",
}


def glm4_layout(config: ModelConfig, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    """A GLM-4 checkpoint's tensor as the model loads it: its norms renamed, and each head's
    q/k rows reordered so that the rotation of its interleaved pairs (2i, 2i + 1), over the
    rotated part of the head, is the model's rotation of halves (i, i + rotary_dim / 2): the
    same rows rotate by the same angle, and q . k is a sum over the same products."""
    module, _, leaf = name.rpartition(".")
    owner, _, last = module.rpartition(".")
    if last in GLM4_NORMS:
        return f"{owner}.{GLM4_NORMS[last]}.{leaf}", tensor
    if last in ("q_proj", "k_proj"):
        heads = config.num_heads if last == "q_proj" else config.num_kv_heads
        return name, interleaved_to_halves(
            tensor, heads, config.head_dim, config.rotary_dim or config.head_dim
        )
    return name, tensor


def split_fused(config: ModelConfig, shard: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`shard` under the model's names: Phi-3's and GLM-4's qkv_proj and gate_up_proj split into
    the q/k/v and gate/up weights the model is loaded as (and a tensor-parallel rank slices part
    by part), Mixtral's experts named as Qwen3-MoE's, GLM-4's norms and rotated rows as the
    model has them (`glm4_layout`)."""
    sizes = {
        "self_attn.qkv_proj": [config.q_size, config.kv_size, config.kv_size],
        "mlp.gate_up_proj": [config.intermediate_size] * 2,
    }
    out: dict[str, torch.Tensor] = {}
    for name, tensor in shard.items():
        if ".block_sparse_moe." in name:
            for theirs, ours in MIXTRAL_NAMES.items():
                name = name.replace(theirs, ours)
        fused = next((f for f in FUSED_IN_CHECKPOINTS if name.endswith(f"{f}.weight")), None)
        if fused is None:
            if config.architecture == "glm4":
                name, tensor = glm4_layout(config, name, tensor)
            out[name] = tensor
            continue
        if tensor.shape[0] != sum(sizes[fused]):
            raise ValueError(f"weight {name} has {tensor.shape[0]} rows, expected {sum(sizes[fused])}")
        owner = name[: -len(f"{fused.split('.')[1]}.weight")]
        for part, piece in zip(FUSED_IN_CHECKPOINTS[fused], torch.split(tensor, sizes[fused]), strict=True):
            out[f"{owner}{part}.weight"] = piece
    return out
