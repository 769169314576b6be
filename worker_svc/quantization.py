"""Weight-only quantization on the CPU: linear layers whose weights stay 4-bit or 8-bit in memory.

- `int4`: groups of 32 inputs, w = code * scale + minimum with codes 0..15. That is exactly the
  layout of a GGUF's Q4_1 blocks (Q4_0's is the case minimum = -8 * scale), so a GGUF's 4-bit
  weights are taken as the file holds them (`Int4Blocks` from `worker_svc.gguf`); other weights
  are grouped by their own minimum and maximum.
- `int8`: 8-bit codes with a symmetric scale.

The output layer is kept at 8 bits in both modes (as llama.cpp's 4-bit files keep it at Q8_0)
unless the file itself holds it at 4 bits.

Two families of kernels, chosen by the model's dtype:
- float32 (the default where they can be had): Stepahead's own (`worker_svc.cpu_kernels`,
  `BlockLinear`): scales per block of 32 inputs in both modes (int8 as a GGUF's Q8_0, so a Q8_0
  tensor's codes come back as the file holds them), activations written as two 8-bit codes a block
  (15 bits) and multiplied on integers.
- bfloat16: torch's (`Int4Linear`: `_weight_int4pack_mm_for_cpu`; `Int8Linear`: one scale per
  output channel, `_weight_int8pack_mm`). Both take bfloat16 activations and scales; in float32
  they run about ten times slower. So the scales and minima are rounded to bfloat16, which moves a
  GGUF's fp16 scales by at most 2^-9 of their value.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeGuard

import torch
from torch import nn

from worker_svc import cpu_kernels
from worker_svc.cpu_kernels import BLOCK, Q4, Q8, DecodeLayers, Kernels, LayerWeights, PackedWeight
from worker_svc.layers import (
    Embedding,
    Int8Embedding,
    Linear,
    LlamaDecoderLayer,
    LlamaMLP,
    q8_blocks,
    use_cpu_kernels,
)

if TYPE_CHECKING:
    from worker_svc.model import LlamaForCausalLM

QUANTIZATIONS = ("none", "int8", "int4")
INT4_GROUP = 32  # inputs sharing a scale and minimum: GGUF's Q4_0/Q4_1 block, a Q4_K block's group
INT4_ROWS = 16  # the int4 kernel packs outputs in multiples of this
ACTIVATIONS = torch.bfloat16  # what both of torch's kernels take


@dataclass(frozen=True)
class Int4Blocks:
    """A [out, in] weight as 4-bit codes in groups of INT4_GROUP inputs:
    w[o, i] = codes[o, i] * scale[o, i // 32] + minimum[o, i // 32]."""

    codes: torch.Tensor  # uint8 [out, in], 0..15
    scale: torch.Tensor  # float32 [out, in / 32]
    minimum: torch.Tensor  # float32 [out, in / 32]

    @classmethod
    def from_weight(cls, weight: torch.Tensor) -> Int4Blocks:
        """Each group's 16 levels spread from its minimum to its maximum."""
        out, inputs = weight.shape
        groups = weight.float().reshape(out, inputs // INT4_GROUP, INT4_GROUP)
        low, high = groups.amin(-1), groups.amax(-1)
        scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
        codes = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15)
        return cls(codes.to(torch.uint8).reshape(out, inputs), scale, low)

    @classmethod
    def cat(cls, parts: Sequence[Int4Blocks]) -> Int4Blocks:
        """The blocks of the weights stacked along their outputs (fused projections)."""
        return cls(*(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "scale", "minimum")))

    def dequantized(self) -> torch.Tensor:
        """The float32 weight the blocks stand for."""
        scale = self.scale.repeat_interleave(INT4_GROUP, dim=1)
        return self.codes.float() * scale + self.minimum.repeat_interleave(INT4_GROUP, dim=1)


class StoredBlocks(Mapping[str, Int4Blocks]):
    """A file's own quantized weights: its 4-bit blocks by checkpoint name, and `wider`, the
    names it stores with more bits beside them (a mixed file's, as Q4_K_M keeps attn_v and
    ffn_down at 6 bits in some layers), which `int4` serves at 8 bits rather than fewer than
    the file gives them."""

    @property
    @abc.abstractmethod
    def wider(self) -> frozenset[str]: ...


def int4_fits(out_features: int, in_features: int) -> bool:
    """Whether the int4 kernel takes a weight of this shape."""
    return out_features % INT4_ROWS == 0 and in_features % INT4_GROUP == 0


class Int4Linear(nn.Module):
    """A linear layer over 4-bit weights packed for torch's CPU int4 kernel."""

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, blocks: Int4Blocks, bias: torch.Tensor | None) -> None:
        super().__init__()
        out_features, in_features = blocks.codes.shape
        if not int4_fits(out_features, in_features):
            raise ValueError(f"int4: a [{out_features}, {in_features}] weight does not pack")
        self.out_features, self.in_features = out_features, in_features
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(blocks.codes.to(torch.int32), 1)
        # The kernel's zero is the value of code 8: w = (code - 8) * scale + zero.
        zeros = blocks.minimum + 8 * blocks.scale
        scales_and_zeros = torch.stack([blocks.scale, zeros], dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(ACTIVATIONS))
        self.register_buffer("bias", None if bias is None else bias.to(ACTIVATIONS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, INT4_GROUP, self.scales_and_zeros)
        if self.bias is not None:
            out = out + self.bias
        result: torch.Tensor = out.view(*x.shape[:-1], self.out_features)
        return result


class Int8Linear(nn.Module):
    """A linear layer over int8 weights with one scale per output channel."""

    weight_int8: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        w = weight.float()
        scales = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        codes = (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
        self.register_buffer("weight_int8", codes.contiguous())
        self.register_buffer("scales", scales.to(ACTIVATIONS))
        self.register_buffer("bias", None if bias is None else bias.to(ACTIVATIONS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        out = torch.ops.aten._weight_int8pack_mm(flat, self.weight_int8, self.scales)
        if self.bias is not None:
            out = out + self.bias
        result: torch.Tensor = out.view(*x.shape[:-1], self.out_features)
        return result


class BlockLinear(nn.Module):
    """A linear layer over weights in blocks of 32 inputs (Q4: codes packed two a byte, a scale and
    a minimum a block; Q8: signed codes and a scale a block), multiplied by Stepahead's CPU kernels
    with float32 activations."""

    codes: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor | None
    bias: torch.Tensor | None

    def __init__(
        self,
        kernels: Kernels,
        kind: int,
        codes: torch.Tensor,
        scale: torch.Tensor,
        minimum: torch.Tensor | None,
        bias: torch.Tensor | None,
    ) -> None:
        """codes [out, in] (Q4: uint8 0..15; Q8: int8), scale and minimum [out, in / 32]."""
        super().__init__()
        self.kernels, self.kind = kernels, kind
        self.out_features, self.in_features = codes.shape
        packed = cpu_kernels.pack_q4(codes) if kind == Q4 else cpu_kernels.pack_q8(codes)
        self.register_buffer("codes", packed)
        self.register_buffer("scale", cpu_kernels.pack_scales(scale))
        self.register_buffer("minimum", None if minimum is None else cpu_kernels.pack_scales(minimum))
        self.register_buffer("bias", None if bias is None else bias.float())

    @classmethod
    def q4(cls, kernels: Kernels, blocks: Int4Blocks, bias: torch.Tensor | None) -> BlockLinear:
        """The 4-bit blocks as they are."""
        return cls(kernels, Q4, blocks.codes, blocks.scale, blocks.minimum, bias)

    @classmethod
    def q8(cls, kernels: Kernels, weight: torch.Tensor, bias: torch.Tensor | None) -> BlockLinear:
        """Each block's codes -127..127 over its largest magnitude, as a GGUF's Q8_0."""
        codes, scale = q8_blocks(weight, BLOCK)
        return cls(kernels, Q8, codes, scale, None, bias)

    def packed(self) -> PackedWeight:
        """The weight as the kernels take it."""
        return PackedWeight(
            self.kind, self.codes, self.scale, self.minimum, self.bias, self.out_features, self.in_features
        )

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [out, in] the layer multiplies by, read back through the kernels with
        unit inputs (which 8 bits hold exactly)."""
        eye = torch.eye(self.in_features)
        with torch.no_grad():
            return self.kernels.linear(
                self.kind, eye, self.codes, self.scale, self.minimum, self.out_features
            ).t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float().contiguous()
        out = self.kernels.linear(self.kind, flat, self.codes, self.scale, self.minimum, self.out_features)
        if self.bias is not None:
            out += self.bias
        result: torch.Tensor = out.view(*x.shape[:-1], self.out_features).to(x.dtype)
        return result


class TiedInt8Embedding(nn.Module):
    """A tied model's 8-bit embeddings read from its output layer's Q8 blocks: the codes and block
    scales `Int8Embedding` would hold (the same table, quantized the same way), held once. Each
    row looked up is gathered out of the kernels' layout (`cpu_kernels.pack_q8`, `pack_scales`:
    rows in groups of GROUP, each block's codes in fours) and dequantized."""

    def __init__(self, head: BlockLinear, dtype: torch.dtype) -> None:
        super().__init__()
        assert head.kind == Q8 and head.minimum is None
        self._head = (head,)  # not a submodule: the head's buffers are its own
        self.dtype = dtype
        self.width = head.in_features
        self.blocks = head.in_features // BLOCK

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        (head,) = self._head
        flat = ids.reshape(-1)
        group, row = flat // cpu_kernels.GROUP, flat % cpu_kernels.GROUP
        codes = head.codes.view(-1, self.blocks, BLOCK // 4, cpu_kernels.GROUP, 4)[group, :, :, row, :]
        scale = head.scale.view(-1, self.blocks, cpu_kernels.GROUP)[group, :, row]
        rows = codes.reshape(-1, self.blocks, BLOCK).float() * scale[..., None]
        return rows.reshape(*ids.shape, self.width).to(self.dtype)


QUANTIZED = (Int4Linear, Int8Linear, BlockLinear)  # the projections' quantized forms


def blocks_fit(in_features: int) -> bool:
    """Whether Stepahead's kernels take a weight of this many inputs."""
    return in_features % BLOCK == 0


def quantized_linear(
    layer: Linear,
    names: Sequence[str],
    mode: str,
    blocks: Mapping[str, Int4Blocks],
    kernels: Kernels | None = None,
) -> nn.Module:
    """`layer` quantized in `mode`; `names`: the checkpoint weights it stacks (one, or a fused
    projection's parts), whose 4-bit blocks a file may hold; `kernels`: Stepahead's, else torch's.
    On Stepahead's, a weight whose inputs are not in blocks of 32 stays as it is; on torch's, in
    `int4` a weight that does not pack is int8. In `int4`, a projection with a part the file stores
    wider than 4 bits beside its 4-bit ones (`StoredBlocks.wider`) is int8."""
    weight, bias = layer.weight, layer.bias
    if mode == "int4" and isinstance(blocks, StoredBlocks) and any(name in blocks.wider for name in names):
        mode = "int8"  # the file keeps a part wider than 4 bits: served at 8
    if kernels is not None and blocks_fit(weight.shape[1]):
        if mode == "int4":
            return BlockLinear.q4(kernels, _int4_blocks(weight, names, blocks), bias)
        return BlockLinear.q8(kernels, weight, bias)
    if kernels is not None:
        return layer  # not in blocks of 32: kept in float32, as it was
    if mode == "int4" and int4_fits(*weight.shape):
        return Int4Linear(_int4_blocks(weight, names, blocks), bias)
    return Int8Linear(weight, bias)


def _int4_blocks(weight: torch.Tensor, names: Sequence[str], blocks: Mapping[str, Int4Blocks]) -> Int4Blocks:
    """The file's own 4-bit blocks of `names` (stacked), else `weight` grouped anew."""
    own = [blocks[name] for name in names if name in blocks]
    return Int4Blocks.cat(own) if len(own) == len(names) else Int4Blocks.from_weight(weight)


def kernels_for(dtype: torch.dtype, mode: str) -> Kernels | None:
    """The kernels a model of `dtype` is quantized for: Stepahead's in float32 (ValueError where they
    cannot be had), torch's (None) in bfloat16."""
    if dtype == torch.bfloat16:
        return None
    if dtype != torch.float32:
        raise ValueError(f"--quantization {mode}: computes in float32 or bfloat16, not {dtype}")
    kernels = cpu_kernels.load()
    if kernels is None:
        raise ValueError(
            f"--quantization {mode} in float32: no CPU kernels here ({cpu_kernels.unavailable()})"
        )
    return kernels


def quantize_model(model: LlamaForCausalLM, mode: str, blocks: Mapping[str, Int4Blocks]) -> None:
    """Replace the model's fused projections (`LlamaForCausalLM.fuse_projections` first) and its
    output layer by quantized ones, in `mode` (`int8` or `int4`); `blocks`: a file's own 4-bit
    weights by checkpoint name. The embeddings are 8-bit (a tied model's read from its Q8 output
    layer), norms stay as they are; on Stepahead's kernels (a
    float32 model) the step's small operators run on them too (`layers.use_cpu_kernels`), and a
    step of decode rows alone runs the decoder layers in one call (`decode_layers`)."""
    if mode not in QUANTIZATIONS[1:]:
        raise ValueError(f"quantization {mode!r} is not one of {QUANTIZATIONS[1:]}")
    kernels = kernels_for(model.dtype, mode)
    for i, layer in enumerate(model.model.layers):
        assert isinstance(layer, LlamaDecoderLayer)
        quantize_layer(layer, i, mode, blocks, kernels)
    head_name = "model.embed_tokens.weight" if model.config.tie_word_embeddings else "lm_head.weight"
    head_mode = mode if head_name in blocks else "int8"
    assert isinstance(model.lm_head, Linear)
    model.lm_head = quantized_linear(model.lm_head, [head_name], head_mode, blocks, kernels)
    embeddings, head = model.model.embed_tokens, model.lm_head
    if isinstance(embeddings, Embedding):  # its float table dropped
        if model.config.tie_word_embeddings and _whole_q8(head, model.config.vocab_size):
            model.model.embed_tokens = TiedInt8Embedding(head, embeddings.weight.dtype)
        else:
            model.model.embed_tokens = Int8Embedding(embeddings.weight)
    if kernels is not None and model.config.llama_arithmetic:
        use_cpu_kernels(model, kernels)
        model.model.decode_kernel = decode_layers(model, kernels)


def _whole_q8(head: nn.Module, vocab_size: int) -> TypeGuard[BlockLinear]:
    """Whether `head` holds the whole vocabulary's rows as Q8 blocks (a tied table's 8 bits)."""
    return isinstance(head, BlockLinear) and head.kind == Q8 and head.out_features == vocab_size


def quantize_layer(
    layer: LlamaDecoderLayer, index: int, mode: str, blocks: Mapping[str, Int4Blocks], kernels: Kernels | None
) -> None:
    """Decoder layer `index`'s projections fused (once) and quantized in `mode`; a projection
    already quantized (the layer quantized as it was loaded) is left as it is."""
    layer.self_attn.fuse()
    layer.mlp.fuse()
    for prefix, owner, attr, parts in _projections(layer, f"model.layers.{index}."):
        linear = getattr(owner, attr)
        if isinstance(linear, QUANTIZED):
            continue
        assert isinstance(linear, Linear), f"{prefix}{attr} is not a fused Linear"
        names = [f"{prefix}{part}.weight" for part in parts]
        setattr(owner, attr, quantized_linear(linear, names, mode, blocks, kernels))


def _projections(
    layer: LlamaDecoderLayer, prefix: str
) -> Iterator[tuple[str, nn.Module, str, tuple[str, ...]]]:
    """Each fused projection of a decoder layer: its checkpoint names' prefix, its owner module,
    its attribute there and the checkpoint layers it stacks (an expert's each, for a sparse MLP)."""
    yield f"{prefix}self_attn.", layer.self_attn, "qkv_proj", ("q_proj", "k_proj", "v_proj")
    yield f"{prefix}self_attn.", layer.self_attn, "o_proj", ("o_proj",)
    mlp = layer.mlp
    if isinstance(mlp, LlamaMLP):
        mlps: list[tuple[str, nn.Module]] = [(f"{prefix}mlp.", mlp)]
    else:
        mlps = [(f"{prefix}mlp.experts.{e}.", expert) for e, expert in enumerate(mlp.experts)]
        if mlp.shared_expert is not None:
            mlps.append((f"{prefix}mlp.shared_expert.", mlp.shared_expert))
    for mlp_prefix, owner in mlps:
        yield mlp_prefix, owner, "gate_up_proj", ("gate_proj", "up_proj")
        yield mlp_prefix, owner, "down_proj", ("down_proj",)


def decode_layers(model: LlamaForCausalLM, kernels: Kernels) -> DecodeLayers | None:
    """The model's decoder layers as one call of the kernels for decode steps, where all their
    projections are on them (fused, in blocks of 32) and they have no q/k norms; else None (the
    layers' modules run one by one)."""
    weights = []
    for layer in model.model.layers:
        assert isinstance(layer, LlamaDecoderLayer)
        attention, mlp = layer.self_attn, layer.mlp
        if not isinstance(mlp, LlamaMLP):  # a mixture of experts
            return None
        projections = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
        packed = [p.packed() for p in projections if isinstance(p, BlockLinear)]
        if attention.q_norm is not None or len(packed) != len(projections):
            return None
        assert layer.input_layernorm is not None  # Llama's layout (model.llama_arithmetic)
        norms = (layer.input_layernorm.weight.float(), layer.post_attention_layernorm.weight.float())
        weights.append(LayerWeights(*norms, *packed))
    config = model.config
    return DecodeLayers(
        kernels, weights, config.rms_norm_eps, config.num_heads, config.num_kv_heads, config.head_dim
    )
