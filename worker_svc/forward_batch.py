"""The device-side view of one launched batch, as the model consumes it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VerifyRows:
    """A batch's rows at positions the device holds (speculative decoding: verify rows of K + 1
    queries, decode rows of 1): row i's query j at `base[i] + j` (worker_svc/speculative.py)."""

    rows: list[int]  # [Bv] host: their row indexes
    queries: list[int]  # [Bv] host: each one's tokens
    token_index: list[int]  # host: index into T of their tokens, row-major
    base: torch.Tensor  # [Bv] the position of each row's first token


@dataclass
class ForwardBatch:
    """Inputs of one forward; tensors live on the model's device.

    Tokens of all rows are flattened into one axis of length T, row after row.
    NOTE: `req_to_token` already holds this batch's KV slots, so row i attends
    to the KV slots `req_to_token[row_req_slots[i], :row_ctx_lens[i]]`, its own
    new tokens included (causally).
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute position of each token in its request
    out_kv_slots: torch.Tensor  # [T] int64, KV pool slot each token's K/V is written to
    row_req_slots: torch.Tensor  # [B] int64, request slot of each row
    row_token_starts: list[int]  # [B] host: offset of row i's first token in T
    row_num_tokens: list[int]  # [B] host: tokens row i brings (1 for decode)
    row_ctx_lens: list[int]  # [B] host: start position + num tokens of row i
    sample_token_index: torch.Tensor  # [R] int64: index into T of each sampling row's last token
    req_to_token: torch.Tensor  # [request_slots, max_context_len + 1] int64 KV slot table (+ a spare)
    verify: VerifyRows | None = None  # None: no verify row
    # [S] int64: index into T of each scored prompt position (Launch.row_scores), whose logits
    # follow the sampling rows'; None: none scored.
    score_token_index: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_rows(self) -> int:
        return len(self.row_num_tokens)
