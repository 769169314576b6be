"""The FutureMap: each request's last sampled token, kept on the device.

Indexed by request slot (not a ring of future ids): a slot belongs to one live
request at a time, so an entry cannot be overwritten by another request's
tokens while its reader is still to come.
"""

from __future__ import annotations

import torch

SENTINEL = -1


class FutureMapSentinelError(RuntimeError):
    """A forward asked for a token that no batch has produced."""


class FutureMap:
    """Device-resident `slot -> last sampled token`, starting at SENTINEL.

    NOTE: reads and writes happen on the forward stream only, in launch
    order; so a decode row of batch k+1 reads what batch k stored, whether or
    not the scheduler has seen that token yet. Each is one device op with
    device indices (no host value, no read back), except the sentinel check.
    """

    def __init__(self, num_slots: int, device: torch.device, check_sentinel: bool) -> None:
        self._tokens = torch.full((num_slots,), SENTINEL, dtype=torch.int64, device=device)
        self._check_sentinel = check_sentinel
        self.sentinel_reads = 0

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        tokens = self._tokens.index_select(0, slots)
        if self._check_sentinel:
            self._assert_written(tokens)
        return tokens

    def store(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        self._tokens.index_copy_(0, slots, tokens)

    def reset(self, slots: torch.Tensor) -> None:
        self._tokens.index_fill_(0, slots, SENTINEL)

    def reset_all(self) -> None:
        self._tokens.fill_(SENTINEL)

    def _assert_written(self, tokens: torch.Tensor) -> None:
        # NOTE: reads a count back, so the forward thread waits for the device here:
        # the one sync on that thread, under --check-invariants (tests and debug runs) only.
        unwritten = int((tokens == SENTINEL).sum().item())
        if unwritten:
            self.sentinel_reads += unwritten
            raise FutureMapSentinelError(f"{unwritten} decode rows read an unwritten FutureMap entry")
