"""Typed per-step outputs of the engine core, one `StepOutputs` per frontend.

The arrays are the wire form of `stepahead.v1.StepOutputs`: building them costs one
append per row, and the link sends them as packed fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from scheduler_svc.engine.request import FinishReason, Request

NO_TOKEN = -1


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability and the most likely alternatives, most likely first."""

    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass
class StepOutputs:
    """Entry i: request `handles[i]` got token `token_ids[i]` (NO_TOKEN: none) and, when
    `finish_reasons[i]` is not 0, ended for that reason. `errors` end requests with a
    status instead: (handle, gRPC status name, message). Entries `logprob_entries[j]` carry
    `logprobs[j]` (only requests that asked for them)."""

    handles: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reasons: list[int] = field(default_factory=list)
    errors: list[tuple[int, str, str]] = field(default_factory=list)
    logprob_entries: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    cached_entries: list[int] = field(default_factory=list)  # entries of first tokens, with
    cached_tokens: list[int] = field(default_factory=list)  # the prompt tokens found cached

    def __bool__(self) -> bool:
        return bool(self.handles or self.errors)

    def add(
        self,
        handle: int,
        token: int,
        finish: FinishReason | None,
        logprob: TokenLogprob | None = None,
        cached: int | None = None,
    ) -> None:
        if cached is not None:
            self.cached_entries.append(len(self.handles))
            self.cached_tokens.append(cached)
        if logprob is not None:
            self.logprob_entries.append(len(self.handles))
            self.logprobs.append(logprob)
        self.handles.append(handle)
        self.token_ids.append(token)
        self.finish_reasons.append(int(finish or 0))

    def entry_logprobs(self) -> list[TokenLogprob | None]:
        """Per entry: its log-probabilities, or None."""
        per_entry: list[TokenLogprob | None] = [None] * len(self.handles)
        if not self.logprobs:
            return per_entry
        for entry, logprob in zip(self.logprob_entries, self.logprobs, strict=True):
            per_entry[entry] = logprob
        return per_entry


class OutputSink(Protocol):
    """Where a frontend's outputs go: the frontend itself, or the link to its process.
    Sinks are compared by identity (the outbox groups outputs by sink)."""

    def send(self, outputs: StepOutputs) -> None:
        """Must not block the core's loop."""


class Outbox:
    """Outputs of the current step, grouped by the owning frontend until `flush`."""

    def __init__(self) -> None:
        self._pending: dict[OutputSink | None, StepOutputs] = {}

    def token(
        self,
        req: Request,
        token: int,
        finish: FinishReason | None = None,
        logprob: TokenLogprob | None = None,
        cached: int | None = None,
    ) -> None:
        self._for(req.owner).add(req.handle, token, finish, logprob, cached)

    def finish(self, req: Request, reason: FinishReason) -> None:
        self._for(req.owner).add(req.handle, NO_TOKEN, reason)

    def error(self, req: Request, code: str, message: str) -> None:
        self._for(req.owner).errors.append((req.handle, code, message))

    def flush(self) -> None:
        """One message per frontend that has news."""
        pending, self._pending = self._pending, {}
        for owner, outputs in pending.items():
            if owner is not None:  # None: a request driven without a frontend (policy tests)
                owner.send(outputs)

    def _for(self, owner: OutputSink | None) -> StepOutputs:
        outputs = self._pending.get(owner)
        if outputs is None:
            outputs = self._pending[owner] = StepOutputs()
        return outputs
