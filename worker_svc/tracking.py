"""The token history's updates on the forward stream, while a live slot is penalized:
a launch's prompt-sourced tokens before its logits are processed, its sampled ids after."""

from __future__ import annotations

import torch

from worker_svc.forward_batch import ForwardBatch
from worker_svc.logits_processors import TokenHistory
from worker_svc.rows import DeviceRows
from worker_svc.speculative import Drafted

__all__ = ["track_drafts", "track_prompt_sourced", "track_sampled"]


def track_prompt_sourced(history: TokenHistory, batch: ForwardBatch, on_device: DeviceRows) -> None:
    """The history takes the prefill tokens `plan_processing` picked, read on the device."""
    slots, ids, positions = on_device.token_req_slots, batch.input_ids, on_device.positions
    tokens, outputs = on_device.history_token_index, on_device.history_output_index
    history.add_tokens(*(t.index_select(0, tokens) for t in (slots, positions, ids)))
    history.add_outputs(slots.index_select(0, outputs), ids.index_select(0, outputs))


def track_sampled(
    history: TokenHistory, on_device: DeviceRows, token_ids: torch.Tensor, emitted: torch.Tensor | None = None
) -> None:
    """Each sampled id at the position it was sampled for, and counted; with verify rows, only
    the `emitted` [R] int32 entries count (the others' tokens lie past their row's length, to
    be written over before any row reads them)."""
    history.add_tokens(on_device.sample_req_slots, on_device.sample_positions, token_ids)
    history.add_outputs(on_device.sample_req_slots, token_ids, emitted)


def track_drafts(history: TokenHistory, slots: torch.Tensor, drafted: Drafted) -> None:
    """A launch's verify rows' proposed drafts at their positions (the rest to the spare column,
    which no row reads), so that entry j's penalties see d1 .. dj among its tokens."""
    k = drafted.drafts.shape[1]
    history.add_tokens(
        slots.repeat_interleave(k),
        drafted.table_positions[:, 1:].reshape(-1),
        drafted.inputs[:, 1:].reshape(-1),
    )
