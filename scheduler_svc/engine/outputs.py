"""Typed per-step outputs of the engine core, one `StepOutputs` per frontend.

The arrays are the wire form of `stepahead.v1.StepOutputs`: building them costs one
append per row, and the link sends them as packed fields.
"""

from __future__ import annotations

from scheduler_svc.contract import NO_TOKEN, FinishReason, OutputSink, StepOutputs, TokenLogprob
from scheduler_svc.engine.request import Request


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
        prompt: tuple[TokenLogprob, ...] | None = None,
    ) -> None:
        self._for(req.owner).add(req.handle, token, finish, logprob, cached, prompt)

    def tokens(
        self, owner: OutputSink | None, handles: list[int], tokens: list[int], finishes: list[int]
    ) -> int:
        """Plain rows of one owner: a token each, and a finish reason each (0: none). Returns the
        entry of the first of them in the owner's outputs (`note_first`)."""
        outputs = self._for(owner)
        base = len(outputs.handles)
        outputs.handles.extend(handles)
        outputs.token_ids.extend(tokens)
        outputs.finish_reasons.extend(finishes)
        return base

    def note_first(
        self,
        owner: OutputSink | None,
        entry: int,
        cached: int | None,
        prompt: tuple[TokenLogprob, ...] | None,
    ) -> None:
        """Entry `entry` of the owner's outputs (`tokens`) is a request's first output token,
        which carries the prompt tokens it found cached (None: not its first output) and its
        prompt's log-probabilities (None: none)."""
        self._for(owner).note(entry, cached, prompt)

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
