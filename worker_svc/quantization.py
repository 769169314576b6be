"""Weight-only quantization on the CPU: linear layers whose weights stay 4-bit or 8-bit in memory
and are multiplied by torch's own CPU kernels, with bfloat16 activations.

- `int4`: groups of 32 inputs, w = code * scale + minimum with codes 0..15, multiplied by
  `_weight_int4pack_mm_for_cpu`. That is exactly the layout of a GGUF's Q4_1 blocks (Q4_0's is the
  case minimum = -8 * scale), so a GGUF's 4-bit weights are taken as the file holds them
  (`Int4Blocks` from `worker_svc.gguf`); other weights are grouped by their own minimum and maximum.
- `int8`: one symmetric scale per output channel (`_weight_int8pack_mm`).

The output layer is kept at 8 bits in both modes (as llama.cpp's 4-bit files keep it at Q8_0)
unless the file itself holds it at 4 bits.

NOTE: both kernels take bfloat16 activations and scales; in float32 they run about ten times
slower on the CPU. So the scales and minima are rounded to bfloat16, which moves a GGUF's fp16
scales by at most 2^-9 of their value.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from worker_svc.layers import FUSED_PROJECTIONS, Linear

if TYPE_CHECKING:
    from worker_svc.model import LlamaForCausalLM

QUANTIZATIONS = ("none", "int8", "int4")
INT4_GROUP = 32  # inputs sharing a scale and minimum: GGUF's Q4_0/Q4_1 block
INT4_ROWS = 16  # the int4 kernel packs outputs in multiples of this
ACTIVATIONS = torch.bfloat16  # what both kernels take


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


def quantized_linear(
    layer: Linear, names: Sequence[str], mode: str, blocks: Mapping[str, Int4Blocks]
) -> nn.Module:
    """`layer` quantized in `mode`; `names`: the checkpoint weights it stacks (one, or a fused
    projection's parts), whose 4-bit blocks a file may hold. In `int4`, a weight that does not
    pack is int8."""
    weight, bias = layer.weight, layer.bias
    if mode == "int4" and int4_fits(*weight.shape):
        own = [blocks[name] for name in names if name in blocks]
        source = Int4Blocks.cat(own) if len(own) == len(names) else Int4Blocks.from_weight(weight)
        return Int4Linear(source, bias)
    return Int8Linear(weight, bias)


def quantize_model(model: LlamaForCausalLM, mode: str, blocks: Mapping[str, Int4Blocks]) -> None:
    """Replace the model's fused projections (`LlamaForCausalLM.fuse_projections` first) and its
    output layer by quantized ones, in `mode` (`int8` or `int4`); `blocks`: a file's own 4-bit
    weights by checkpoint name. Embeddings and norms stay as they are."""
    if mode not in QUANTIZATIONS[1:]:
        raise ValueError(f"quantization {mode!r} is not one of {QUANTIZATIONS[1:]}")
    for i, layer in enumerate(model.model.layers):
        for fused, parts in FUSED_PROJECTIONS.items():
            owner_name, attr = fused.split(".")
            owner = getattr(layer, owner_name)
            linear = getattr(owner, attr)
            assert isinstance(linear, Linear), f"{fused} is not a fused Linear"
            names = [f"model.layers.{i}.{part}.weight" for part in parts]
            setattr(owner, attr, quantized_linear(linear, names, mode, blocks))
    head_name = "model.embed_tokens.weight" if model.config.tie_word_embeddings else "lm_head.weight"
    head_mode = mode if head_name in blocks else "int8"
    assert isinstance(model.lm_head, Linear)
    model.lm_head = quantized_linear(model.lm_head, [head_name], head_mode, blocks)
