"""A quantized model is loaded a decoder layer at a time: each layer's weights are allocated at
its first tensor and quantized as soon as it has all of them, so that loading holds one layer's
float weights beside the quantized ones, not the whole model's (a 7B model's float32 weights
alone are 28 GB; in `int4` they take about 5). Whatever order the files hold the tensors in, the
model served is the one quantized after a whole load, to the bit."""

from __future__ import annotations

import json
import pathlib
from dataclasses import replace
from typing import Any

import pytest
import safetensors.torch
import torch
from gguf import GGUFReader

import worker_svc.gguf
import worker_svc.loading
from tests.test_checkpoint import write_tokenizer
from tests.test_gguf import GGUF_SMALL, write_llama_gguf
from tests.test_gguf_families import Q4_0, write_family_gguf
from tests.test_model import hf_config_dict, prefill_all_logits, random_model
from worker_svc.cpu_kernels import Q4, Q8
from worker_svc.gguf import FileBlocks, load_gguf
from worker_svc.layers import LlamaDecoderLayer
from worker_svc.loading import load_hf_checkpoint
from worker_svc.model import LayerLoaded, LlamaForCausalLM, prepare_for_serving
from worker_svc.quantization import BlockLinear

CPU = torch.device("cpu")
# Every projection's inputs in blocks of 32, so that every one of them is quantized.
CONFIG = replace(
    GGUF_SMALL, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16
)
TOKENS = [3, 17, 42, 5, 99, 7, 64, 12, 150, 33, 8, 71]


def float_layers(model: LlamaForCausalLM) -> list[int]:
    """The decoder layers holding a float matrix (unquantized, allocated)."""
    return [
        i
        for i, layer in enumerate(model.model.layers)
        if any(p.ndim == 2 and not p.is_meta for p in layer.parameters())
    ]


class Watch:
    """Wraps a module's `quantize_as_loaded`: at each layer loaded, which layers hold float
    matrices, and the order the layers were completed in."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, module: Any) -> None:
        self.completed: list[int] = []
        self.float_layers: list[list[int]] = []
        original = module.quantize_as_loaded

        def watched(model: LlamaForCausalLM, quantization: str, blocks: Any) -> LayerLoaded | None:
            hook = original(model, quantization, blocks)
            if hook is None:  # not quantized: nothing to watch
                return None

            def watch(index: int, layer: LlamaDecoderLayer) -> None:
                self.completed.append(index)
                self.float_layers.append(float_layers(model))
                hook(index, layer)

            return watch

        monkeypatch.setattr(module, "quantize_as_loaded", watched)


def quantized_after_loading(path: pathlib.Path, quantization: str) -> LlamaForCausalLM:
    """The model loaded whole in float32, then quantized (the file's own 4-bit blocks for int4)."""
    model = load_gguf(path, torch.float32, CPU).model
    blocks = FileBlocks(GGUFReader(path), model.config) if quantization == "int4" else {}
    prepare_for_serving(model, quantization, blocks)
    return model


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_a_gguf_is_quantized_a_layer_at_a_time(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, quantization: str
) -> None:
    vocab = write_tokenizer(tmp_path)
    model = random_model(replace(CONFIG, vocab_size=vocab), seed=3)
    path = tmp_path / "small.gguf"
    write_llama_gguf(path, model, json.loads((tmp_path / "tokenizer.json").read_text()))
    watch = Watch(monkeypatch, worker_svc.gguf)
    loaded = load_gguf(path, torch.float32, CPU, quantization=quantization)
    assert watch.completed == [0, 1, 2]
    assert watch.float_layers == [[0], [1], [2]]  # the layer being quantized alone
    assert float_layers(loaded.model) == []
    prepare_for_serving(loaded.model, quantization, loaded.int4_blocks)
    expected = quantized_after_loading(path, quantization)
    assert torch.equal(prefill_all_logits(loaded.model, TOKENS), prefill_all_logits(expected, TOKENS))


@pytest.mark.parametrize("kind", ["phi3", "mixtral", "glm4"])
def test_a_files_own_4_bit_blocks_are_taken_a_layer_at_a_time(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Q4_0 matrices throughout: Phi-3's fused q/k/v split, Mixtral's permuted q/k and stacked
    experts, GLM-4's q/k rows reordered over the rotated half of each head. Each of the file's
    tensors is unpacked once, however many experts it stacks."""
    path, _ = write_family_gguf(tmp_path, kind, experts_type=Q4_0, matrices_type=Q4_0)
    unpacked: list[str] = []
    original = worker_svc.gguf.int4_blocks

    def counted(tensor: Any) -> Any:
        unpacked.append(tensor.name)
        return original(tensor)

    monkeypatch.setattr(worker_svc.gguf, "int4_blocks", counted)
    loaded = load_gguf(path, torch.float32, CPU, quantization="int4")
    assert len(unpacked) == len(set(unpacked)) and any("exps" in n for n in unpacked) == (kind == "mixtral")
    monkeypatch.undo()
    prepare_for_serving(loaded.model, "int4", loaded.int4_blocks)
    tokens = [t % loaded.model.config.vocab_size for t in TOKENS]
    expected = quantized_after_loading(path, "int4")
    assert torch.equal(prefill_all_logits(loaded.model, tokens), prefill_all_logits(expected, tokens))


def test_a_checkpoint_in_any_order_is_quantized_as_each_layer_completes(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two shards, the first holding layer 2 and part of layer 0, the second the rest: each layer
    is quantized when its last tensor arrives."""
    model = random_model(replace(CONFIG, vocab_size=300), seed=4)
    tensors = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    first = {n: t for n, t in tensors.items() if n.startswith("model.layers.2.") or "layers.0.self_attn" in n}
    directory = tmp_path / "checkpoint"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(hf_config_dict(model.config)))
    safetensors.torch.save_file(first, str(directory / "model-00001-of-00002.safetensors"))
    rest = {n: t for n, t in tensors.items() if n not in first}
    safetensors.torch.save_file(rest, str(directory / "model-00002-of-00002.safetensors"))
    watch = Watch(monkeypatch, worker_svc.loading)
    loaded = load_hf_checkpoint(directory, torch.float32, CPU, quantization="int8")
    assert watch.completed == [2, 0, 1]
    assert watch.float_layers == [[0, 2], [0], [1]]  # layer 0 started in the first shard
    prepare_for_serving(loaded, "int8")
    expected = load_hf_checkpoint(directory, torch.float32, CPU)
    prepare_for_serving(expected, "int8")
    assert torch.equal(prefill_all_logits(loaded, TOKENS), prefill_all_logits(expected, TOKENS))


def test_a_mixed_files_wider_weights_are_served_at_8_bits_in_int4(tmp_path: pathlib.Path) -> None:
    """A 4-bit file that keeps some weights wider (Q4_K_M's attn_v and ffn_down): in `int4`, a
    projection with a wider part is 8-bit, the others the file's own 4-bit blocks. A file of wider
    weights throughout is 4-bit as asked."""
    mixed, _ = write_family_gguf(
        tmp_path, "mixtral", Q4_0, matrices_type=Q4_0, wider=("attn_v", "ffn_down_exps")
    )
    model = load_gguf(mixed, torch.float32, CPU, quantization="int4").model
    for layer in model.model.layers:
        assert isinstance(layer, LlamaDecoderLayer)
        assert kind_of(layer.self_attn.qkv_proj) == Q8 and kind_of(layer.self_attn.o_proj) == Q4
        assert {kind_of(e.gate_up_proj) for e in layer.mlp.experts} == {Q4}  # type: ignore[union-attr]
        assert {kind_of(e.down_proj) for e in layer.mlp.experts} == {Q8}  # type: ignore[union-attr]
    (tmp_path / "q8").mkdir()
    wide, _ = write_family_gguf(tmp_path / "q8", "mixtral")
    model = load_gguf(wide, torch.float32, CPU, quantization="int4").model
    layer = model.model.layers[0]
    assert isinstance(layer, LlamaDecoderLayer)
    assert kind_of(layer.self_attn.qkv_proj) == Q4 and kind_of(layer.self_attn.o_proj) == Q4


def kind_of(projection: Any) -> int:
    assert isinstance(projection, BlockLinear)
    return projection.kind
