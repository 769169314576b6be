"""A request's output text: incremental detokenization plus stop strings."""

from __future__ import annotations

from scheduler_svc.frontend.tokenizer import StopStringMatcher, Tokenizer


class RequestText:
    """Text the client may see: whole characters only, never any part of a
    stop string (unless `include_stop`: the one that ends the text), nothing after one."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        stops: tuple[str, ...],
        skip_special_tokens: bool = True,
        include_stop: bool = False,
    ) -> None:
        self._decoder = tokenizer.new_decoder(skip_special_tokens)
        self._stops = StopStringMatcher(stops, include_stop)

    @property
    def stopped(self) -> bool:
        return self._stops.stopped

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the text; None while none has."""
        return self._stops.matched

    def push(self, token_id: int, match_stops: bool = True) -> tuple[str, bool]:
        """(text now safe to send, whether a stop string ended the output). Without
        `match_stops` (the request's first min_tokens tokens) the text is not searched: stop
        strings are looked for in the text that comes after it."""
        text = self._decoder.push((token_id,))
        return self._stops.push(text) if match_stops else (text, False)

    @property
    def has_stops(self) -> bool:
        return self._stops.has_stops

    def push_ids(self, token_ids: list[int]) -> str:
        """The text of several tokens at once (a request without stop strings: no stop to
        find between them)."""
        assert not self.has_stops
        return self._decoder.push(token_ids)

    def finish(self) -> str:
        """What was held back, when the request ends other than on a stop string."""
        text, stopped = self._stops.push(self._decoder.flush())
        return text if stopped else text + self._stops.flush()
