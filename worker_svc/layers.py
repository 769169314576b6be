"""The Llama decoder's building blocks: the token-slot KV pool, the per-batch attention plan
(causal, or within a sliding window), and the layers (parameter names follow HF checkpoints of
the Llama family); the rotary embeddings are worker_svc.rotary's."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from worker_svc.device_streams import to_device_columns
from worker_svc.forward_batch import ForwardBatch, VerifyRows
from worker_svc.rotary import apply_rotary

if TYPE_CHECKING:
    from worker_svc.cpu_kernels import Kernels

    # NOTE: a type only here; worker_svc.model builds its model from these layers.
    from worker_svc.model import ModelConfig


# ---------------------------------------------------------------------------------------------
# KV pool


@dataclass
class KVCache:
    """K and V of every layer by token slot, each [num_layers, num_slots, kv_heads, head_dim]."""

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def allocate(
        cls, config: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device
    ) -> KVCache:
        shape = (config.num_layers, num_slots, config.num_kv_heads, config.head_dim)
        return cls(
            k=torch.zeros(shape, dtype=dtype, device=device), v=torch.zeros(shape, dtype=dtype, device=device)
        )

    @property
    def num_slots(self) -> int:
        return int(self.k.shape[1])


# ---------------------------------------------------------------------------------------------
# Attention plan: per-batch indexing shared by all layers


@dataclass
class DecodeGroup:
    """All single-token rows, attended in one padded call."""

    token_index: torch.Tensor  # [Bd] index into T of each row's token
    kv_slots: torch.Tensor  # [Bd, Lmax] KV slots; padding points at slot 0 and is masked out
    mask: torch.Tensor  # [Bd, 1, 1, Lmax] True where the key is part of the row's context
    whole_batch: bool = False  # the batch is these rows alone, token i being row i's

    @property
    def valid(self) -> torch.Tensor:
        """[Bd, Lmax]: the mask without its broadcast axes."""
        return self.mask.view(self.kv_slots.shape)


@dataclass
class PrefillRow:
    """One multi-token row, queries at positions ctx_len - num_tokens .. ctx_len - 1."""

    token_start: int
    num_tokens: int
    kv_slots: torch.Tensor  # [1, ctx_len]
    mask: torch.Tensor | None  # [1, 1, group * num_tokens, ctx_len]; None when there is no prefix


@dataclass
class VerifyGroup:
    """All verify rows (speculative decoding), Q = K + 1 queries each, attended in one padded
    call; row i's query j sits at position base[i] + j, held on the device."""

    token_index: torch.Tensor  # [Bv * Q] index into T of each row's tokens, row-major
    queries: int  # Q
    kv_slots: torch.Tensor  # [Bv, Lmax] KV slots; padding points at slot 0 and is masked out
    mask: torch.Tensor  # [Bv, 1, group * Q, Lmax] True where query j may read the key


@dataclass
class AttentionPlan:
    decode: DecodeGroup | None
    prefills: list[PrefillRow]
    verify: list[VerifyGroup] = field(default_factory=list)  # by queries a row
    query_scale: torch.Tensor | None = None  # [T, 1, 1] each token's queries times this (Ministral 3)

    @classmethod
    def build(
        cls,
        batch: ForwardBatch,
        query_group: int,
        window: int | None = None,
        query_scale: torch.Tensor | None = None,
    ) -> AttentionPlan:
        """`window`: each query attends only the keys of its last `window` positions, its own
        included (None: every earlier key)."""
        verify = batch.verify
        device_rows = set(verify.rows) if verify is not None else set()
        decode_rows = [i for i, n in enumerate(batch.row_num_tokens) if n == 1 and i not in device_rows]
        prefill_rows = [i for i, n in enumerate(batch.row_num_tokens) if n > 1 and i not in device_rows]
        decode = _decode_group(batch, decode_rows, window) if decode_rows else None
        groups = []
        if verify is not None:
            for queries in sorted(set(verify.queries)):
                groups.append(_verify_group(batch, verify, queries, query_group, window))
        prefills = [_prefill_row(batch, i, query_group, window) for i in prefill_rows]
        return cls(decode, prefills, groups, query_scale)


def _decode_group(batch: ForwardBatch, rows: list[int], window: int | None) -> DecodeGroup:
    device = batch.input_ids.device
    host_ctx_lens = [batch.row_ctx_lens[i] for i in rows]
    # NOTE: one transfer, through the running step's streams (worker_svc/device_streams.py),
    # so that building the plan never waits for the device.
    row_index, ctx_lens, token_index = to_device_columns(
        [rows, host_ctx_lens, [batch.row_token_starts[i] for i in rows]], device
    )
    max_len = max(host_ctx_lens)
    req_slots = batch.row_req_slots.index_select(0, row_index)
    table = batch.req_to_token.index_select(0, req_slots)[:, :max_len]
    keys = torch.arange(max_len, device=device)[None, :]
    valid = keys < ctx_lens[:, None]
    if window is not None:  # the query is at ctx_len - 1
        valid &= keys >= ctx_lens[:, None] - window
    kv_slots = torch.where(valid, table, torch.zeros_like(table))
    whole = len(rows) == len(batch.row_num_tokens) and all(batch.row_token_starts[i] == i for i in rows)
    return DecodeGroup(token_index, kv_slots, valid[:, None, None, :], whole)


def _verify_group(
    batch: ForwardBatch, verify: VerifyRows, queries: int, query_group: int, window: int | None
) -> VerifyGroup:
    """The rows of `verify` with `queries` tokens each."""
    device = batch.input_ids.device
    members = [i for i, n in enumerate(verify.queries) if n == queries]
    rows = [verify.rows[i] for i in members]
    starts = [0, *itertools.accumulate(verify.queries)]
    tokens = [verify.token_index[starts[i] + j] for i in members for j in range(queries)]
    # NOTE: one transfer, through the running step's streams, as the decode group's.
    row_index, member_index, token_index = to_device_columns([rows, members, tokens], device)
    base = verify.base.index_select(0, member_index)
    max_len = max(batch.row_ctx_lens[i] for i in rows)
    req_slots = batch.row_req_slots.index_select(0, row_index)
    table = batch.req_to_token.index_select(0, req_slots)[:, :max_len]
    keys = torch.arange(max_len, device=device)[None, None, :]
    query_pos = base[:, None, None] + torch.arange(queries, device=device)[None, :, None]
    allowed = keys <= query_pos  # [Bv, Q, Lmax]
    if window is not None:
        allowed &= keys > query_pos - window
    kv_slots = torch.where(allowed.any(1), table, torch.zeros_like(table))
    mask = allowed.repeat(1, query_group, 1)[:, None]
    return VerifyGroup(token_index, queries, kv_slots, mask)


def _prefill_row(batch: ForwardBatch, row: int, query_group: int, window: int | None) -> PrefillRow:
    device = batch.input_ids.device
    num_tokens, ctx_len = batch.row_num_tokens[row], batch.row_ctx_lens[row]
    req_slot = batch.row_req_slots[row : row + 1]
    kv_slots = batch.req_to_token.index_select(0, req_slot)[:, :ctx_len]
    prefix_len = ctx_len - num_tokens
    mask = None
    if prefix_len > 0 or (window is not None and ctx_len > window):
        query_pos = prefix_len + torch.arange(num_tokens, device=device)
        keys = torch.arange(ctx_len, device=device)[None, :]
        allowed = keys <= query_pos[:, None]
        if window is not None:
            allowed &= keys > query_pos[:, None] - window
        mask = allowed.repeat(query_group, 1)[None, None]
    return PrefillRow(batch.row_token_starts[row], num_tokens, kv_slots, mask)


@dataclass(frozen=True)
class Scores:
    """How a layer's attention scores are made: their scale (None: head_dim ** -0.5) and cap."""

    scale: float | None = None
    softcap: float | None = None  # Gemma 2: cap * tanh(s / cap), before the mask


def grouped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scores: Scores = Scores()
) -> torch.Tensor:
    """Attention of q [B, n, H, d] over k, v [B, L, kvh, d] -> [B, n, H * d].

    With a mask, the query heads sharing a KV head are folded into the query axis so the KV heads
    are never expanded; `mask` is then [B, 1, group * n, L] or broadcastable to it. Without one,
    attention is causal and n == L.
    """
    batch, num_q, num_heads, head_dim = q.shape
    k, v = k.transpose(1, 2), v.transpose(1, 2)
    q = q.transpose(1, 2)
    if scores.softcap is not None:
        if mask is None:  # causal: folded row r is query r % n
            rows = torch.arange(num_q, device=q.device).repeat(num_heads // k.shape[1])
            mask = torch.arange(num_q, device=q.device)[None, :] <= rows[:, None]
        folded = q.reshape(batch, k.shape[1], -1, head_dim)
        out = _capped_attention(folded, k, v, mask, scores.scale or head_dim**-0.5, scores.softcap)
    elif mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=scores.scale)
    else:
        folded = q.reshape(batch, k.shape[1], -1, head_dim)
        out = F.scaled_dot_product_attention(folded, k, v, attn_mask=mask, scale=scores.scale)
    out = out.reshape(batch, num_heads, num_q, head_dim).transpose(1, 2)
    return out.reshape(batch, num_q, num_heads * head_dim)


def _capped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, cap: float
) -> torch.Tensor:
    """Softmax attention with the scores capped, in transformers' order of operations (eager)."""
    weights = torch.matmul(q, k.transpose(2, 3)) * scale
    weights = torch.tanh(weights / cap) * cap
    weights = weights.masked_fill(~mask, float("-inf"))
    return torch.matmul(F.softmax(weights, dim=-1, dtype=torch.float32).to(q.dtype), v)


# ---------------------------------------------------------------------------------------------
# Layers (parameter names follow HF Llama checkpoints)


class Linear(nn.Module):
    """A linear layer (bias-free unless asked) whose weights are left uninitialised until loaded."""

    bias: nn.Parameter | None
    # Inputs of up to this many rows are multiplied weight-side (`weight_side_product`); 0: never.
    weight_side_rows: int = 0

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and 0 < x.shape[0] <= self.weight_side_rows:
            return weight_side_product(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def weight_side_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for a few rows of `x`, computed as `(weight @ x.T).T`; one row
    goes in twice (see `use_weight_side_products`)."""
    rows = x.shape[0]
    columns = x if rows > 1 else torch.cat((x, x))
    out = torch.mm(weight, columns.t())[:, :rows].t().contiguous()
    return out if bias is None else out.add_(bias)


def stack_linears(layers: list[Linear]) -> Linear:
    """One Linear computing `layers` side by side along its outputs."""
    stacked = Linear(0, 0)
    stacked.weight = nn.Parameter(torch.cat([layer.weight for layer in layers]), requires_grad=False)
    biases: list[torch.Tensor] = [layer.bias for layer in layers if layer.bias is not None]
    if len(biases) == len(layers):
        stacked.bias = nn.Parameter(torch.cat(biases), requires_grad=False)
    return stacked


# Up to how many rows a CPU float32 Linear multiplies weight-side (`use_weight_side_products`).
WEIGHT_SIDE_MAX_ROWS = 128


def use_weight_side_products(model: nn.Module, max_rows: int = WEIGHT_SIDE_MAX_ROWS) -> None:
    """Every Linear multiplies inputs of up to `max_rows` rows as `(weight @ x.T).T` over its
    row-major [out, in] weight, instead of `x @ weight.T`.

    NOTE: on the CPU in float32 (torch's MKL products), `x @ weight.T` over a row-major weight
    costs about as much for 2 rows as the weight-side product for 16: for a few rows it is not
    bound by reading the weight, as it should be. Measured on smollm2's projections (2 threads,
    ms for all 60 of them): 1 row 12.9 (input-major layout) -> 13.7 (one row in twice), 2 rows
    19.9 -> 12.6, 5 rows 30.6 -> 17.2, 16 rows 40.5 -> 25.8, 64 rows 81.3 -> 61.6; from about 256
    rows on `F.linear` is as fast or faster. So a speculative verify row of 5 tokens costs about
    1.2x a one-token step instead of 1.5-2x, and a batch of 16 decodes 1.25-1.5x faster. One row
    goes in twice: MKL's matrix-vector product over a row-major weight reads it at about half
    speed, and the two-column product does not. Float32 only: bfloat16 products are no faster
    weight-side."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.weight_side_rows = max_rows


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


Q8_CHUNK_ROWS = 4096  # rows quantized at a time: a vocabulary's table has no float copy made whole


def q8_blocks(
    weight: torch.Tensor, group: int, chunk_rows: int = Q8_CHUNK_ROWS
) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` [rows, width] as signed 8-bit codes [rows, width] and a scale for each group of
    `group` inputs [rows, width / group]: each group's codes -127..127 over its largest magnitude,
    as a GGUF's Q8_0. Computed `chunk_rows` rows at a time, so that the temporaries stay small
    (a 128K-token table of width 2048 is 1 GiB in float32); the result does not depend on it."""
    rows, width = weight.shape
    codes = torch.empty(rows, width, dtype=torch.int8, device=weight.device)
    scale = torch.empty(rows, width // group, dtype=torch.float32, device=weight.device)
    for start in range(0, rows, chunk_rows):
        part = weight[start : start + chunk_rows].float().reshape(-1, width // group, group)
        part_scale = part.abs().amax(-1) / 127
        part_codes = (part / part_scale.clamp(min=torch.finfo(torch.float32).tiny)[..., None]).round()
        codes[start : start + chunk_rows] = part_codes.clamp_(-127, 127).reshape(-1, width).to(torch.int8)
        scale[start : start + chunk_rows] = part_scale
    return codes, scale


class Int8Embedding(nn.Module):
    """Embeddings kept as 8-bit codes, a scale for each group of 32 (of a row, where the width is
    not a multiple of 32): the rows looked up are dequantized, a quarter of float32's room for
    the whole table (a 128K-token vocabulary of width 4096 takes 2 GB in float32)."""

    codes: torch.Tensor
    scale: torch.Tensor

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        width = weight.shape[1]
        self.group = 32 if width % 32 == 0 else width
        self.dtype = weight.dtype
        codes, scale = q8_blocks(weight.detach(), self.group)
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        codes = self.codes.index_select(0, ids).float()
        scale = self.scale.index_select(0, ids)
        rows = codes.reshape(*scale.shape, self.group) * scale[..., None]
        return rows.reshape(codes.shape).to(self.dtype)


class RMSNorm(nn.Module):
    # Stepahead's CPU kernels, where the model runs on them (`use_cpu_kernels`)
    kernels: Kernels | None = None

    def __init__(self, hidden_size: int, eps: float, offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self.offset = offset  # Gemma's: scaled by 1 + weight, in float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offset:  # as transformers' Gemma norms: normed and scaled in float32, then cast
            normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
            return (normed * (1.0 + self.weight.float())).type_as(x)
        if self.kernels is not None and x.dtype == torch.float32:
            return self.kernels.rms_norm(x, self.weight, self.eps)
        # NOTE: one fused op (normalised in float32 whatever the model dtype) in place of the
        # eight of the written-out formula: a decode step at batch 1 runs 61 of them.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class LlamaAttention(nn.Module):
    # Stepahead's CPU kernels, where the model runs on them (`use_cpu_kernels`): decode rows
    kernels: Kernels | None = None

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        # As checkpoints name them; `fuse` stacks q/k/v into qkv_proj for serving.
        self.q_proj: Linear | None = Linear(config.hidden_size, config.q_size, config.qkv_bias)
        self.k_proj: Linear | None = Linear(config.hidden_size, config.kv_size, config.qkv_bias)
        self.v_proj: Linear | None = Linear(config.hidden_size, config.kv_size, config.qkv_bias)
        self.qkv_proj: nn.Module | None = None
        self.o_proj: nn.Module = Linear(config.q_size, config.hidden_size, config.o_bias)
        # Qwen3, Gemma 3: each head of q and k normalised over head_dim, before the rotation;
        # OLMo 2 (qk_norm_whole): all of q and all of k, each over its whole width.
        eps, offset, whole = config.rms_norm_eps, config.norm_offset, config.qk_norm_whole
        self.qk_norm_whole = whole
        q_width, k_width = (config.q_size, config.kv_size) if whole else (config.head_dim, config.head_dim)
        self.q_norm = RMSNorm(q_width, eps, offset) if config.qk_norm else None
        self.k_norm = RMSNorm(k_width, eps, offset) if config.qk_norm else None
        self.scores = Scores(config.attention_scale, config.attention_softcap)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        kv: tuple[torch.Tensor, torch.Tensor],
        out_kv_slots: torch.Tensor,
        plan: AttentionPlan,
    ) -> torch.Tensor:
        k_pool, v_pool = kv
        if (
            self.kernels is not None
            and rope is not None
            and self.qkv_proj is not None
            and self.q_norm is None
            and x.dtype == torch.float32
        ):
            # Rotated and written in one call (the same arithmetic as `_project` and the copies)
            q = self.kernels.rope_store(
                self.qkv_proj(x), rope[0], rope[1], self.num_heads, k_pool, v_pool, out_kv_slots
            )
            return self.o_proj(self._attend(q, k_pool, v_pool, plan))  # type: ignore[no-any-return]
        q, k, v = self._project(x, rope)
        if plan.query_scale is not None:  # after the rotation, as transformers scales them
            q = q * plan.query_scale
        # Written before attending: every row's context includes its own new tokens.
        k_pool.index_copy_(0, out_kv_slots, k.to(k_pool.dtype))
        v_pool.index_copy_(0, out_kv_slots, v.to(v_pool.dtype))
        projected: torch.Tensor = self.o_proj(self._attend(q, k_pool, v_pool, plan))
        return projected

    def fuse(self) -> None:
        """q/k/v as one projection (one matrix product instead of three), for serving; once."""
        if self.qkv_proj is not None:
            return
        assert self.q_proj is not None and self.k_proj is not None and self.v_proj is not None
        self.qkv_proj = stack_linears([self.q_proj, self.k_proj, self.v_proj])
        self.q_proj = self.k_proj = self.v_proj = None

    def _project(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, d] and k [T, KVH, d] rotated (unless `rope` is None), v [T, KVH, d]."""
        num_tokens, heads, kv_heads, head_dim = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_proj is not None and self.q_norm is None and rope is not None:
            # Fused: q and k side by side in the output, rotated in one go.
            qkv = self.qkv_proj(x)
            qk = apply_rotary(qkv[:, : (heads + kv_heads) * head_dim].view(num_tokens, -1, head_dim), *rope)
            v = qkv[:, (heads + kv_heads) * head_dim :].view(num_tokens, kv_heads, head_dim)
            return qk[:, :heads], qk[:, heads:], v
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
        else:
            assert self.q_proj is not None and self.k_proj is not None and self.v_proj is not None
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm_whole and self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(num_tokens, heads, head_dim)
        k = k.reshape(num_tokens, kv_heads, head_dim)
        v = v.reshape(num_tokens, kv_heads, head_dim)
        if self.q_norm is not None and self.k_norm is not None and not self.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is None:
            return q, k, v
        return apply_rotary(q, *rope), apply_rotary(k, *rope), v

    def _attend(
        self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, plan: AttentionPlan
    ) -> torch.Tensor:
        if plan.decode is not None and plan.decode.whole_batch:
            return self._attend_decode(q, k_pool, v_pool, plan.decode)
        out = torch.empty(q.shape[0], self.num_heads * self.head_dim, dtype=q.dtype, device=q.device)
        if plan.decode is not None:
            out.index_copy_(0, plan.decode.token_index, self._attend_decode(q, k_pool, v_pool, plan.decode))
        for group in plan.verify:
            out.index_copy_(0, group.token_index, self._attend_verify(q, k_pool, v_pool, group))
        for row in plan.prefills:
            end = row.token_start + row.num_tokens
            out[row.token_start : end] = self._attend_prefill(q[row.token_start : end], k_pool, v_pool, row)
        return out

    def _attend_decode(
        self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, group: DecodeGroup
    ) -> torch.Tensor:
        if self.kernels is not None and q.dtype == torch.float32:
            q_rows = q if group.whole_batch else q.index_select(0, group.token_index)
            return self.kernels.decode_attention(q_rows, k_pool, v_pool, group.kv_slots, group.valid)
        q_rows = (q if group.whole_batch else q.index_select(0, group.token_index))[:, None]
        dtype = _attention_dtype(q)
        k, v = _gather(k_pool, group.kv_slots, dtype), _gather(v_pool, group.kv_slots, dtype)
        return grouped_attention(q_rows.to(dtype), k, v, group.mask, self.scores)[:, 0].to(q.dtype)

    def _attend_verify(
        self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, group: VerifyGroup
    ) -> torch.Tensor:
        q_rows = q.index_select(0, group.token_index)
        q_rows = q_rows.view(-1, group.queries, *q_rows.shape[1:])
        dtype = _attention_dtype(q)
        k, v = _gather(k_pool, group.kv_slots, dtype), _gather(v_pool, group.kv_slots, dtype)
        out = grouped_attention(q_rows.to(dtype), k, v, group.mask, self.scores)
        return out.reshape(-1, out.shape[-1]).to(q.dtype)

    def _attend_prefill(
        self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, row: PrefillRow
    ) -> torch.Tensor:
        dtype = _attention_dtype(q)
        k, v = _gather(k_pool, row.kv_slots, dtype), _gather(v_pool, row.kv_slots, dtype)
        return grouped_attention(q[None].to(dtype), k, v, row.mask, self.scores)[0].to(q.dtype)


def use_cpu_kernels(model: nn.Module, kernels: Kernels) -> None:
    """Run `model`'s norms, rotations and KV writes, silu(gate) * up and decode rows' attention on
    Stepahead's CPU kernels (float32): a decode step's small operators cost more than its products
    there (docs/BENCHMARKS.md). Not in the exact mode, whose float32 follows transformers'
    operators."""
    for module in model.modules():
        if isinstance(module, (RMSNorm, LlamaAttention, LlamaMLP)):
            module.kernels = kernels


def _attention_dtype(q: torch.Tensor) -> torch.dtype:
    """What attention computes in: on the CPU float32 for bfloat16 activations.

    NOTE: torch's CPU attention kernel is slower in bfloat16 than in float32 at a decode row's
    sizes (87 vs 31 us at batch 1, 24 keys); the casts cost less (smollm2 int4: 35 -> 32.5 ms a step
    at batch 1, 120 -> 104 ms at 16)."""
    return torch.float32 if q.device.type == "cpu" and q.dtype == torch.bfloat16 else q.dtype


def _gather(pool: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """pool [num_slots, kvh, d] at slots [B, L] -> [B, L, kvh, d]."""
    rows = pool.index_select(0, slots.reshape(-1))
    return rows.view(*slots.shape, *pool.shape[1:]).to(dtype)


class LlamaMLP(nn.Module):
    # Stepahead's CPU kernels, where the model runs on them (`use_cpu_kernels`): silu(gate) * up
    kernels: Kernels | None = None

    def __init__(self, config: ModelConfig, intermediate_size: int | None = None) -> None:
        """`intermediate_size`: an expert's (MixtureOfExperts), else the config's."""
        super().__init__()
        self.gelu = config.hidden_act == "gelu_tanh"  # else silu
        width = intermediate_size or config.intermediate_size
        # As checkpoints name them; `fuse` stacks gate/up into gate_up_proj for serving.
        self.gate_proj: Linear | None = Linear(config.hidden_size, width)
        self.up_proj: Linear | None = Linear(config.hidden_size, width)
        self.gate_up_proj: nn.Module | None = None
        self.down_proj: nn.Module = Linear(width, config.hidden_size)

    def fuse(self) -> None:
        """gate/up as one projection, for serving; once."""
        if self.gate_up_proj is not None:
            return
        assert self.gate_proj is not None and self.up_proj is not None
        self.gate_up_proj = stack_linears([self.gate_proj, self.up_proj])
        self.gate_proj = self.up_proj = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and self.gate_up_proj is not None and x.dtype == torch.float32:
            return self.down_proj(self.kernels.silu_mul(self.gate_up_proj(x)))  # type: ignore[no-any-return]
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            assert self.gate_proj is not None and self.up_proj is not None
            gate, up = self.gate_proj(x), self.up_proj(x)
        gated = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        out: torch.Tensor = self.down_proj(gated * up)
        return out


class MixtureOfExperts(nn.Module):
    """A sparse MLP (Qwen3-MoE, Qwen2-MoE, Mixtral): a router's softmax picks each token's top k experts,
    whose SwiGLU outputs are summed weighted by their probabilities (renormalised over the k where
    the model asks). As transformers computes it: the experts in ascending order, each over the
    tokens that picked it, added into the output one expert at a time.

    NOTE: which experts a step's tokens picked is read on the host (one read a layer): on a GPU
    that is a synchronisation inside the forward, which a dense layer does not have."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.normalize = config.experts_per_token, config.normalize_expert_weights
        self.gate = Linear(config.hidden_size, config.num_experts)  # the router, as checkpoints name it
        self.experts = nn.ModuleList(
            LlamaMLP(config, config.expert_intermediate_size) for _ in range(config.num_experts)
        )
        # Qwen2-MoE: an expert every token takes, weighted by sigmoid(shared_expert_gate(x)).
        shared = config.shared_expert_intermediate_size
        self.shared_expert = LlamaMLP(config, shared) if shared else None
        self.shared_expert_gate = Linear(config.hidden_size, 1) if shared else None

    def fuse(self) -> None:
        for expert in [*self.experts, *([self.shared_expert] if self.shared_expert is not None else [])]:
            assert isinstance(expert, LlamaMLP)
            expert.fuse()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        probabilities = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probabilities, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for expert in torch.unique(chosen).tolist():  # ascending
            tokens, slot = torch.where(chosen == expert)
            computed = self.experts[expert](x.index_select(0, tokens)) * weights[tokens, slot, None]
            out.index_add_(0, tokens, computed)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class LlamaDecoderLayer(nn.Module):
    """Llama's layer ("pre" norms): x + attention(norm(x)), then x + mlp(norm(x)). Gemma 2/3's
    ("sandwich") norm each block's output too: x + norm(attention(norm(x))), x + norm(mlp(norm(x)));
    OLMo 2's ("post") its output only: x + norm(attention(x)), x + norm(mlp(x)). Each norm is named
    as the checkpoints name it (post_attention_layernorm is the attention's output norm but in
    Llama's layout, where it is the MLP's input norm)."""

    def __init__(self, config: ModelConfig, sparse: bool = False) -> None:
        """`sparse`: a mixture of experts in place of the MLP."""
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp: LlamaMLP | MixtureOfExperts = MixtureOfExperts(config) if sparse else LlamaMLP(config)
        layout, hidden, eps, offset = (
            config.norm_layout,
            config.hidden_size,
            config.rms_norm_eps,
            config.norm_offset,
        )
        self.layout = layout
        self.input_layernorm = RMSNorm(hidden, eps, offset) if layout != "post" else None
        self.post_attention_layernorm = RMSNorm(hidden, eps, offset)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, offset) if layout == "sandwich" else None
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, offset) if layout != "pre" else None
        self.residual_scale = config.residual_scale

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        kv: tuple[torch.Tensor, torch.Tensor],
        out_kv_slots: torch.Tensor,
        plan: AttentionPlan,
    ) -> torch.Tensor:
        normed = x if self.input_layernorm is None else self.input_layernorm(x)
        attended = self.self_attn(normed, rope, kv, out_kv_slots, plan)
        if self.post_feedforward_layernorm is None:  # Llama's
            x = self._add(x, attended)
            return self._add(x, self.mlp(self.post_attention_layernorm(x)))
        x = self._add(x, self.post_attention_layernorm(attended))
        normed = x if self.pre_feedforward_layernorm is None else self.pre_feedforward_layernorm(x)
        return self._add(x, self.post_feedforward_layernorm(self.mlp(normed)))

    def _add(self, x: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
        return x + (block if self.residual_scale == 1.0 else block * self.residual_scale)
