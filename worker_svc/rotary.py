"""Rotary position embeddings: each rope type's frequencies as transformers computes them
(default, llama3, linear, yarn, longrope; a GGUF's precomputed factors), the cos/sin tables of
every position, and the rotation itself (of a whole head or its first part)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    # NOTE: a type only here; worker_svc.model builds its model from these layers.
    from worker_svc.model import ModelConfig


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """The global rotation's inverse frequencies [rotary_dim / 2] in float32, computed the way HF
    checkpoints expect (longrope's: those of the positions the model was trained on)."""
    return _rope_frequencies(config, local=False).short


@dataclass
class RopeFrequencies:
    short: torch.Tensor  # [rotary_dim / 2] the inverse frequencies
    long: torch.Tensor | None = None  # longrope's, from position `boundary` on
    boundary: int = 0
    attention_factor: float = 1.0  # cos and sin times this (yarn, longrope)


def _rope_frequencies(config: ModelConfig, local: bool) -> RopeFrequencies:
    """Each rope type's frequencies as transformers computes them (`modeling_rope_utils`), op for
    op: the tables then match its float32 ones bit for bit."""
    dim = config.rotary_dim or config.head_dim
    base = config.local_rope_theta if local and config.local_rope_theta is not None else config.rope_theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (base**exponents)
    scaling: dict[str, Any] = (
        dict(config.rope_scaling) if config.rope_scaling is not None and not local else {}
    )
    if config.rope_factors is not None and not local:
        return RopeFrequencies(inv_freq / torch.tensor(config.rope_factors, dtype=torch.float32))
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type is None:
        return RopeFrequencies(inv_freq)
    if rope_type == "llama3":
        return RopeFrequencies(_llama3_scaled(inv_freq, scaling))
    if rope_type == "linear":
        return RopeFrequencies(inv_freq / float(scaling["factor"]))
    if rope_type == "yarn":
        return _yarn(base, dim, scaling, config.max_context_len)
    assert rope_type == "longrope", rope_type  # ModelConfig checked the type
    return _longrope(base, dim, scaling, config.max_context_len)


def _yarn(base: float, dim: int, scaling: dict[str, Any], max_len: int) -> RopeFrequencies:
    original = float(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or max_len / original)
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, float(mscale)) / get_mscale(factor, float(mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast, beta_slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers does: no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return RopeFrequencies(
        interpolation * (1 - keep) + extrapolation * keep, attention_factor=float(attention_factor)
    )


def _longrope(base: float, dim: int, scaling: dict[str, Any], max_len: int) -> RopeFrequencies:
    """Phi-3's: short factors for the positions the model was trained on, long ones past them.

    NOTE: transformers picks one set for a whole forward by its longest sequence, so a sequence
    that grows past the boundary is rotated by both over its life there too (its cached keys keep
    the short set). Here the set is the position's: a token's rotation never depends on its batch
    or on how far its sequence will grow, and up to the boundary it is transformers' exactly."""
    original = int(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or max_len / original)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim

    def frequencies(factors: Any) -> torch.Tensor:
        return 1.0 / (torch.tensor(list(factors), dtype=torch.float32) * base**shape)

    short, long = frequencies(scaling["short_factor"]), frequencies(scaling["long_factor"])
    return RopeFrequencies(short, long, original, float(attention_factor))


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


# Positions the tables first cover; they double as longer contexts come (`RotaryEmbedding.at`).
INITIAL_POSITIONS = 4096


class RotaryEmbedding(nn.Module):
    """cos and signed sin of positions, the rotated part of a head wide (see apply_rotary);
    `local`: Gemma 3's sliding layers' (their own base, unscaled).

    NOTE: the tables cover the positions served so far, doubled as needed up to max_context_len,
    not the whole of it at start: a 128K-context model's would take 64 MiB to 512 MiB (Gemma 3's
    two rotations of 256-wide heads) for contexts most servers never reach."""

    cos_cache: torch.Tensor
    sin_cache: torch.Tensor

    def __init__(self, config: ModelConfig, local: bool = False) -> None:
        super().__init__()
        self._rope = _rope_frequencies(config, local)
        self.max_positions = config.max_context_len
        self._fill(min(config.max_context_len, INITIAL_POSITIONS), self._rope.short.device)

    @property
    def positions(self) -> int:
        """How many positions the tables cover now."""
        return int(self.cos_cache.shape[0])

    def _fill(self, count: int, device: torch.device) -> None:
        rope = self._rope
        positions = torch.arange(count, dtype=torch.float32, device=device)
        freqs = positions[:, None] * rope.short.to(device)[None, :]
        if rope.long is not None and rope.boundary < count:
            freqs[rope.boundary :] = positions[rope.boundary :, None] * rope.long.to(device)[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        if rope.attention_factor != 1.0:
            cos, sin = cos * rope.attention_factor, sin * rope.attention_factor
        self.register_buffer("cos_cache", torch.cat((cos, cos), dim=-1), persistent=False)
        self.register_buffer("sin_cache", torch.cat((-sin, sin), dim=-1), persistent=False)

    def at(
        self, positions: torch.Tensor, dtype: torch.dtype, upto: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin of shape [T, 1, head_dim], broadcastable over heads; `upto`: more than
        the largest position, known on the host (None: read from `positions`)."""
        needed = int(positions.max()) + 1 if upto is None else upto
        if needed > self.positions:
            if needed > self.max_positions:
                raise ValueError(f"position {needed - 1} is past the model's context ({self.max_positions})")
            count = self.positions
            while count < needed:
                count *= 2
            self._fill(min(count, self.max_positions), self.cos_cache.device)
        cos = self.cos_cache.index_select(0, positions).to(dtype)
        sin = self.sin_cache.index_select(0, positions).to(dtype)
        return cos[:, None, :], sin[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [T, heads, head_dim] pairs (i, i + head_dim / 2), the rotate_half convention:
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), with `sin` signed (-sin, sin) a head wide.

    NOTE: x rolled by half a head is (x2, x1), so the whole rotation is three ops where the
    written-out halves take eight (half the time at a decode step's sizes, 30 times a step).
    Where cos is narrower than a head (a partial rotation), its first cos-width dims are rotated
    and the rest pass through."""
    width = cos.shape[-1]
    if width == x.shape[-1]:
        return torch.addcmul(x * cos, x.roll(width // 2, dims=-1), sin)
    part = x[..., :width]
    return torch.cat((torch.addcmul(part * cos, part.roll(width // 2, dims=-1), sin), x[..., width:]), dim=-1)
