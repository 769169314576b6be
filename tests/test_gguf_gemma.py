"""Gemma 2 and Gemma 3 GGUF files: a tiny random checkpoint written by transformers, converted as
llama.cpp's converter converts it (its names, norm weights stored as 1 + w, the windows and caps in
the metadata), then read by Stepahead and by transformers' own GGUF loading, the reference: the
same logits at every step, and the same greedy streams served.

The files give head_dim 256, as the Gemma models up to 12B have it: transformers' reader takes
query_pre_attn_scalar from the config's default (256), llama.cpp from head_dim, and the two agree
there. Gemma 3 has six layers, so that one of them is global (five windowed to one).
"""

from __future__ import annotations

import importlib
import json
import pathlib
from dataclasses import replace
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType, dequantize, quantize

from tests.test_architectures import hf_logits, ours_greedy
from tests.test_checkpoint import write_tokenizer
from tests.test_gguf import (
    GGUF_BLOCK_NAMES,
    add_shape,
    add_tokenizer,
    assert_served_greedy_equals_transformers,
    read_by_transformers,
)
from worker_svc.gguf import load_gguf
from worker_svc.hf_config import config_from_hf_dict
from worker_svc.model import LlamaForCausalLM, ModelConfig
from worker_svc.rotary import RotaryEmbedding

transformers: Any = importlib.import_module("transformers")  # dev dependency: the reference

CPU = torch.device("cpu")
Q8_0 = GGMLQuantizationType.Q8_0
WINDOW = 8
LOGIT_TOLERANCE = 1e-4

COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "sliding_window": WINDOW,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 0,
}
KINDS: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma2": ("Gemma2Config", {"num_hidden_layers": 2}),  # its default caps, 50 and 30
    "gemma3": ("Gemma3TextConfig", {"num_hidden_layers": 6, "rope_theta": 1e6, "rope_local_base_freq": 1e4}),
}

# HF names -> llama.cpp's (its tensor_mapping for Gemma 2 and 3)
GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm"}
BLOCK_NAMES = {
    **GGUF_BLOCK_NAMES,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def gguf_name(name: str) -> str:
    module, _, suffix = name.rpartition(".")
    if module in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[module]}.{suffix}"
    _, _, layer, rest = module.split(".", 3)
    return f"blk.{layer}.{BLOCK_NAMES[rest]}.{suffix}"


def config_of(config: Any) -> ModelConfig:
    """The sizes of a transformers config, as Stepahead's ModelConfig holds them."""
    return config_from_hf_dict({**config.to_dict(), "architectures": ["GemmaForCausalLM"]})


def write_gemma_gguf(
    directory: pathlib.Path, kind: str, linear_scaling: float | None = None
) -> tuple[pathlib.Path, Any]:
    """A random `kind` model from transformers, written as a GGUF as llama.cpp converts it:
    matrices Q8_0, norms F32 as 1 + w. Returns the file and the model with the weights the file
    holds (Q8_0-rounded), for reference."""
    vocab = write_tokenizer(directory)
    config_class, extra = KINDS[kind]
    config = getattr(transformers, config_class)(vocab_size=vocab, **COMMON, **extra)
    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    path = directory / f"{kind}.gguf"
    writer = GGUFWriter(path, kind)
    add_shape(writer, replace(config_of(config), rope_theta=1e6 if kind == "gemma3" else 1e4))
    writer.add_sliding_window(WINDOW)
    if linear_scaling is not None:  # Gemma 3 from 4B up: its global layers' rotation
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(linear_scaling)
    if kind == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    add_tokenizer(writer, json.loads((directory / "tokenizer.json").read_text()), "gpt2", "default")
    with torch.no_grad():
        for name, weight in model.state_dict().items():
            if name == "lm_head.weight":  # tied: the file holds it once
                continue
            if weight.ndim == 1:
                param = weight.normal_(0.0, 0.2)
                writer.add_tensor(gguf_name(name), (param + 1).numpy())
                continue
            weight.normal_(0.0, 0.2)
            stored = quantize(weight.numpy(), Q8_0)
            writer.add_tensor(gguf_name(name), stored, raw_dtype=Q8_0)
            weight.copy_(torch.from_numpy(dequantize(stored, Q8_0)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, model


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_gemma_gguf_computes_as_transformers_reading_the_file(tmp_path: pathlib.Path, kind: str) -> None:
    path, written = write_gemma_gguf(tmp_path, kind)
    reference = read_by_transformers(path)
    ours = load_gguf(path, torch.float32, CPU).model
    config = ours.config
    windows = [config.window_of(i) for i in range(config.num_layers)]
    if kind == "gemma2":
        assert windows == [WINDOW, None] and (config.attention_softcap, config.final_softcap) == (50.0, 30.0)
    else:
        assert windows == [WINDOW] * 5 + [None]
        assert [config.rope_of(i) for i in range(6)] == ["local"] * 5 + ["global"]
    tokens = [(7 * i + 3) % config.vocab_size for i in range(37)]
    got, steps = ours_greedy(ours, tokens, 12, [5, 9, 11, 2, 40])
    expected = hf_logits(reference, tokens + got)[len(tokens) - 1 :]
    torch.testing.assert_close(steps, expected, atol=LOGIT_TOLERANCE, rtol=LOGIT_TOLERANCE)
    # The file's weights are the model's it was written from: the same logits as that model's.
    torch.testing.assert_close(hf_logits(written, tokens), hf_logits(reference, tokens), atol=1e-5, rtol=1e-5)


def test_a_served_gemma3_gguf_streams_transformers_greedy_tokens(tmp_path: pathlib.Path) -> None:
    path, written = write_gemma_gguf(tmp_path, "gemma3")
    assert_served_greedy_equals_transformers(path, written.config.vocab_size)


def test_gemma3s_linear_scaling_is_its_global_layers(tmp_path: pathlib.Path) -> None:
    """Gemma 3 from 4B up scales its global layers' rotation (linear, 8); the local ones keep their
    own base unscaled. transformers' reader leaves the scaling out, so the reference here is the
    same file without it: position 8p scaled rotates as position p unscaled."""
    (tmp_path / "scaled").mkdir()
    (tmp_path / "plain").mkdir()
    scaled = load_gguf(write_gemma_gguf(tmp_path / "scaled", "gemma3", 8.0)[0], torch.float32, CPU).model
    plain = load_gguf(write_gemma_gguf(tmp_path / "plain", "gemma3")[0], torch.float32, CPU).model
    assert scaled.config.rope_scaling == (("factor", 8.0), ("rope_type", "linear"))

    def cos(model: LlamaForCausalLM, which: str, positions: list[int]) -> torch.Tensor:
        rotary = model.model.rotary[which]
        assert isinstance(rotary, RotaryEmbedding)
        return rotary.at(torch.tensor(positions), torch.float32)[0]

    assert torch.equal(cos(scaled, "local", [3, 30]), cos(plain, "local", [3, 30]))
    assert torch.equal(cos(scaled, "global", [24, 240]), cos(plain, "global", [3, 30]))
    assert not torch.equal(cos(scaled, "global", [3, 30]), cos(plain, "global", [3, 30]))
