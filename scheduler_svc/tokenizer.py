"""Text to token ids and back, including streaming-safe detokenization and stop strings.

Streaming output must only ever contain whole characters: a character whose
bytes span several tokens is emitted once its last token has arrived. Both
decoders keep a bounded amount of state, so the cost of a push does not grow
with the length of the output.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence
from typing import Protocol

import tokenizers

REPLACEMENT_CHAR = "\ufffd"
NUM_BYTE_IDS = 256
BYTE_BOS_ID = 256
BYTE_EOS_ID = 257
BYTE_VOCAB_SIZE = 258


class IncrementalDecoder(Protocol):
    """Turns a stream of token ids into a stream of text, one request at a time."""

    def push(self, token_ids: Sequence[int]) -> str:
        """Returns the text that became final with these tokens."""
        ...

    def flush(self) -> str:
        """Returns whatever is still held back; undecodable bytes come out as U+FFFD."""
        ...


class Tokenizer(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`add_special_tokens=False` for rendered chat templates, which write their own."""
        ...

    def new_decoder(self) -> IncrementalDecoder: ...

    def special_tokens(self) -> dict[str, str]:
        """The texts of BOS and EOS (`bos_token`, `eos_token`) as chat templates name them."""
        ...


class Utf8ByteDecoder:
    """Decoder for byte ids: ids 0..255 are UTF-8 bytes, every other id decodes to nothing."""

    def __init__(self) -> None:
        # Holds at most the first bytes of one incomplete character; invalid
        # sequences are replaced right away so they never block later text.
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_ids: Sequence[int]) -> str:
        data = bytes(token for token in token_ids if 0 <= token < NUM_BYTE_IDS)
        return self._utf8.decode(data, final=False)

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class ByteTokenizer:
    """Byte-level tokenizer: the text's UTF-8 bytes are its token ids."""

    def __init__(
        self,
        vocab_size: int = BYTE_VOCAB_SIZE,
        bos_id: int | None = BYTE_BOS_ID,
        eos_ids: Sequence[int] = (BYTE_EOS_ID,),
    ) -> None:
        if vocab_size < NUM_BYTE_IDS:
            raise ValueError(f"byte tokenizer needs vocab_size >= {NUM_BYTE_IDS}, got {vocab_size}")
        special_ids = ([] if bos_id is None else [bos_id]) + list(eos_ids)
        for special_id in special_ids:
            if not 0 <= special_id < vocab_size:
                raise ValueError(f"special id {special_id} outside vocab of size {vocab_size}")
        self._vocab_size = vocab_size
        self.bos_id = bos_id
        self.eos_ids = tuple(eos_ids)

    @property
    def name(self) -> str:
        return "byte"

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def special_tokens(self) -> dict[str, str]:
        return {}  # byte ids 256+ have no text

    def new_decoder(self) -> IncrementalDecoder:
        return Utf8ByteDecoder()


class WindowedTokenDecoder:
    """Incremental decoder over any `decode(ids) -> str`, using a sliding window of ids.

    The window is `context + pending`: `context` holds the ids of the last
    emitted chunk and `pending` the ids not emitted yet. Decoding the window and
    dropping the text of the context alone yields the new text with the same
    surroundings (word-joining spaces, leading-space stripping) as a decode of
    the whole output. New text is held back while it ends in U+FFFD, i.e. in the
    middle of a character.
    """

    # Valid text ends mid-character for at most 3 ids in a row (a character
    # has at most 4 bytes); longer runs are invalid bytes and get emitted as
    # U+FFFD so they never stall the stream.
    MAX_INCOMPLETE_IDS = 8
    # Ids that add no text yet (special tokens) stay pending to keep their
    # context, but only this many, so that the window stays bounded.
    MAX_SILENT_IDS = 16

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._window: list[int] = []
        self._context_len = 0
        self._context_text = ""
        self._incomplete_count = 0

    def push(self, token_ids: Sequence[int]) -> str:
        chunks = []
        for token_id in token_ids:
            self._window.append(token_id)
            chunks.append(self._emit_ready_text())
        return "".join(chunks)

    def flush(self) -> str:
        text = self._new_text()
        self._window = []
        self._context_len = 0
        self._context_text = ""
        self._incomplete_count = 0
        return text

    def _emit_ready_text(self) -> str:
        new_text = self._new_text()
        if new_text.endswith(REPLACEMENT_CHAR):
            self._incomplete_count += 1
        if self._is_held_back(new_text):
            return ""
        self._window = self._window[self._context_len :]
        self._context_len = len(self._window)
        self._context_text = self._decode(self._window)
        self._incomplete_count = 0
        return new_text

    def _is_held_back(self, new_text: str) -> bool:
        if new_text.endswith(REPLACEMENT_CHAR):
            return self._incomplete_count <= self.MAX_INCOMPLETE_IDS
        pending_count = len(self._window) - self._context_len
        return new_text == "" and pending_count <= self.MAX_SILENT_IDS

    def _new_text(self) -> str:
        return self._decode(self._window)[len(self._context_text) :]


class HFTokenizer:
    """A tokenizer described by a `tokenizer.json`."""

    def __init__(
        self,
        tokenizer_json: bytes,
        vocab_size: int | None = None,
        bos_id: int | None = None,
        eos_ids: Sequence[int] = (),
    ) -> None:
        self._tokenizer = _parse_tokenizer_json(tokenizer_json)
        own_vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self._vocab_size = own_vocab_size if vocab_size is None else vocab_size
        if self._vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {self._vocab_size}")
        self.bos_id = bos_id
        self.eos_ids = tuple(eos_ids)

    @property
    def name(self) -> str:
        return "hf"

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def special_tokens(self) -> dict[str, str]:
        named = {"bos_token": self.bos_id, "eos_token": self.eos_ids[0] if self.eos_ids else None}
        texts = {name: self._tokenizer.id_to_token(i) for name, i in named.items() if i is not None}
        return {name: text for name, text in texts.items() if text is not None}

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)

    def new_decoder(self) -> IncrementalDecoder:
        return WindowedTokenDecoder(self.decode)


def _parse_tokenizer_json(tokenizer_json: bytes) -> tokenizers.Tokenizer:
    if not tokenizer_json:
        raise ValueError("hf tokenizer needs the contents of a tokenizer.json")
    try:
        return tokenizers.Tokenizer.from_str(tokenizer_json.decode("utf-8"))
    except Exception as error:  # the tokenizers library raises bare Exception
        raise ValueError(f"invalid tokenizer.json: {error}") from error


def load_tokenizer(
    kind: str,
    hf_json: bytes,
    vocab_size: int,
    bos_id: int | None,
    eos_ids: Sequence[int],
) -> Tokenizer:
    """Builds the tokenizer a worker's handshake describes."""
    if kind == "byte":
        return ByteTokenizer(vocab_size=vocab_size, bos_id=bos_id, eos_ids=eos_ids)
    if kind == "hf":
        return HFTokenizer(hf_json, vocab_size=vocab_size, bos_id=bos_id, eos_ids=eos_ids)
    raise ValueError(f"unknown tokenizer kind {kind!r}; expected 'byte' or 'hf'")


class StopStringMatcher:
    """Cuts a text stream before the first stop string, never emitting part of one.

    Invariant: the held-back text is the longest tail of the text seen so far
    that is a proper prefix of some stop string, and it contains no full stop
    string. So it is shorter than the longest stop, and a push only searches
    the held-back text plus the new text.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        # An empty stop string would match before any text; it is ignored.
        self._stops = tuple(dict.fromkeys(stop for stop in stops if stop))
        self._stop_prefixes = frozenset(
            stop[:length] for stop in self._stops for length in range(1, len(stop))
        )
        self._max_held_len = max((len(stop) for stop in self._stops), default=1) - 1
        self._held = ""
        self._stopped = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    def push(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit now, whether a stop string was found)."""
        if not self._stops:
            return text, False
        if self._stopped:
            return "", True
        pending = self._held + text
        match_start = self._earliest_match_start(pending)
        if match_start is not None:
            self._held = ""
            self._stopped = True
            return pending[:match_start], True
        safe_len = len(pending) - self._held_back_len(pending)
        self._held = pending[safe_len:]
        return pending[:safe_len], False

    def flush(self) -> str:
        """Returns the held-back text; call at the end of a stream that did not stop."""
        held, self._held = self._held, ""
        return held

    def _earliest_match_start(self, pending: str) -> int | None:
        starts = (pending.find(stop) for stop in self._stops)
        return min((start for start in starts if start >= 0), default=None)

    def _held_back_len(self, pending: str) -> int:
        for length in range(min(len(pending), self._max_held_len), 0, -1):
            if pending[-length:] in self._stop_prefixes:
                return length
        return 0
