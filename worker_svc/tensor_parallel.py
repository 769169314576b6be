"""Tensor parallelism of the Llama model: the slice of each weight a rank holds, and the
all-reduce after the row-parallel layers (the Megatron split).

Per decoder layer, rank r of N holds
  q/k/v_proj, gate/up_proj  column-parallel: rows r*out/N .. (r+1)*out/N of the [out, in] weight,
                            i.e. heads r*H/N .. and KV heads r*KVH/N .. (GQA groups stay whole),
  o_proj, down_proj         row-parallel: the matching columns; each rank's partial output is
                            summed over the ranks (one all-reduce after each, two a layer),
and a replica of the norms, the embeddings and the output layer, so that every rank computes
the same full logits from the same all-reduced hidden states and samples the same ids.

NOTE: the output layer is replicated rather than vocab-parallel: split, each rank would need
every other rank's logits to sample (an all-gather of [rows, vocab] a step, and gloo has no
all_gather_into_tensor), while replicated it costs one [hidden, vocab] weight a rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

from worker_svc.layers import Linear, LlamaDecoderLayer
from worker_svc.model import LlamaForCausalLM, ModelConfig, new_model

AllReduce = Callable[[torch.Tensor], None]  # sums a tensor over the ranks, in place

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


class RowParallelLinear(Linear):
    """A Linear over this rank's slice of the input features, summed over the ranks."""

    def __init__(
        self, in_features: int, out_features: int, all_reduce: AllReduce, bias: bool = False
    ) -> None:
        super().__init__(in_features, out_features, bias)
        self._all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        self._all_reduce(out)
        if self.bias is not None:  # once, on the sum (every rank holds all of it)
            out += self.bias
        return out


def check_divisible(config: ModelConfig, size: int) -> None:
    """ValueError naming what does not divide by `size` (every rank holds whole heads), or where
    the model has a mixture of experts or q/k norms over every head (served on one rank)."""
    if config.num_experts and size > 1:
        raise ValueError(f"--tp {size}: {config.name} is a mixture of experts, served on one rank (--tp 1)")
    if config.qk_norm_whole and size > 1:  # a norm over every head's q: the ranks' heads together
        raise ValueError(
            f"--tp {size}: {config.name}'s q/k norms span every head, served on one rank (--tp 1)"
        )
    counts = {
        "attention heads": config.num_heads,
        "KV heads": config.num_kv_heads,
        "FFN width": config.intermediate_size,
    }
    for what, count in counts.items():
        if count % size:
            raise ValueError(f"--tp {size}: {config.name}'s {count} {what} do not divide by {size}")


def shard_config(config: ModelConfig, size: int) -> ModelConfig:
    """The per-rank shape: a 1/size share of the heads, KV heads and FFN width."""
    check_divisible(config, size)
    return dataclasses.replace(
        config,
        num_heads=config.num_heads // size,
        num_kv_heads=config.num_kv_heads // size,
        intermediate_size=config.intermediate_size // size,
    )


def shard_weight(name: str, weight: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s part of the full model's weight `name` (all of it when replicated)."""
    module = name.split(".")[-2] if "." in name else ""
    if module in COLUMN_PARALLEL:  # the weight's rows and the bias alike
        return weight.chunk(size, dim=0)[rank]
    if module in ROW_PARALLEL and name.endswith(".weight"):  # a bias is added whole, after the sum
        return weight.chunk(size, dim=1)[rank]
    return weight


def _row_parallel(linear: Linear, all_reduce: AllReduce) -> RowParallelLinear:
    out_features, in_features = linear.weight.shape
    return RowParallelLinear(in_features, out_features, all_reduce, linear.bias is not None)


def shard_model(full: LlamaForCausalLM, rank: int, size: int, all_reduce: AllReduce) -> LlamaForCausalLM:
    """Rank `rank`'s model, on the full model's device and dtype, with copies of its slices
    (the full model can be freed after)."""
    local = new_model(shard_config(full.config, size), full.dtype, full.device)
    for layer in local.model.layers:
        assert isinstance(layer, LlamaDecoderLayer)
        attn, mlp = layer.self_attn, layer.mlp
        assert isinstance(attn.o_proj, Linear) and isinstance(mlp.down_proj, Linear)
        attn.o_proj = _row_parallel(attn.o_proj, all_reduce)
        mlp.down_proj = _row_parallel(mlp.down_proj, all_reduce)
    local.to(full.device, full.dtype)
    full_weights = dict(full.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name, param in local.named_parameters(remove_duplicate=False):
            param.copy_(shard_weight(name, full_weights[name], rank, size))
    return local
