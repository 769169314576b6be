"""The rotary tables: they cover the positions served so far and double as contexts grow, with the
values a table of the whole context would hold."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from worker_svc.loading import TINY_CONFIG
from worker_svc.model import RopeScaling
from worker_svc.rotary import INITIAL_POSITIONS, RotaryEmbedding

LONG = replace(TINY_CONFIG, max_context_len=5 * INITIAL_POSITIONS)
LONGROPE: RopeScaling = (
    ("long_factor", (4.0,) * 16),
    ("original_max_position_embeddings", INITIAL_POSITIONS + 100),
    ("rope_type", "longrope"),
    ("short_factor", (1.5,) * 16),
)


@pytest.mark.parametrize("rope_scaling", [None, LONGROPE], ids=["default", "longrope"])
def test_the_tables_grow_to_the_positions_served(rope_scaling: RopeScaling | None) -> None:
    config = replace(LONG, rope_scaling=rope_scaling)
    rotary = RotaryEmbedding(config)
    assert rotary.positions == INITIAL_POSITIONS
    early = torch.tensor([0, 7, INITIAL_POSITIONS - 1])
    before = rotary.at(early, torch.float32, INITIAL_POSITIONS)
    assert rotary.positions == INITIAL_POSITIONS  # nothing past the table: it stays
    late = torch.tensor([3, INITIAL_POSITIONS + 50, 2 * INITIAL_POSITIONS + 1])
    grown = rotary.at(late, torch.float32, 2 * INITIAL_POSITIONS + 2)
    assert rotary.positions == 4 * INITIAL_POSITIONS  # doubled until it covers them
    for got, again in zip(before, rotary.at(early, torch.float32), strict=True):
        assert torch.equal(got, again)  # the positions it had keep their values
    full = RotaryEmbedding(config)
    full._fill(config.max_context_len, torch.device("cpu"))
    for got, expected in zip(grown, full.at(late, torch.float32), strict=True):
        assert torch.equal(got, expected)
    rotary.at(torch.tensor([config.max_context_len - 1]), torch.float32)
    assert rotary.positions == config.max_context_len  # capped at the context
    with pytest.raises(ValueError, match="past the model's context"):
        rotary.at(torch.tensor([config.max_context_len]), torch.float32)
