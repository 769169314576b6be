"""Text to token ids and back, including streaming-safe detokenization and stop strings.

Streaming output must only ever contain whole characters: a character whose
bytes span several tokens is emitted once its last token has arrived. Both
decoders keep a bounded amount of state, so the cost of a push does not grow
with the length of the output.
"""

from __future__ import annotations

import codecs
import functools
import json
import re
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

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

    def new_decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        """An incremental decoder; with `skip_special_tokens` False, special tokens are spelled."""
        ...

    def special_tokens(self) -> dict[str, str]:
        """The texts of BOS and EOS (`bos_token`, `eos_token`) as chat templates name them."""
        ...

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for on its own (part of a character, possibly); b"" for
        an id with no text. The log-probabilities name tokens by them."""
        ...

    def added_token(self, text: str) -> int | None:
        """The id of the token added to the vocabulary as `text` (the grammar engine takes such
        a token as special: a grammar names it by id, not by its text); None: there is none."""
        ...


class Utf8ByteDecoder:
    """Decoder for byte ids: ids 0..255 are UTF-8 bytes, every other id decodes to nothing."""

    def __init__(self) -> None:
        # Holds at most the first bytes of one incomplete character; invalid
        # sequences are replaced right away so they never block later text.
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_ids: Sequence[int]) -> str:
        try:
            data = bytes(token_ids)  # all of them bytes: the common case
        except ValueError:
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

    def new_decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        return Utf8ByteDecoder()  # ids past the bytes have no text to spell either way

    def token_bytes(self, token_id: int) -> bytes:
        return bytes((token_id,)) if 0 <= token_id < NUM_BYTE_IDS else b""

    def added_token(self, text: str) -> int | None:
        return None


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
        self._spell = piece_spelling(_decoder_config(self._tokenizer))
        self._added = {i: t.content for i, t in self._tokenizer.get_added_tokens_decoder().items()}
        self._added_ids = {content: i for i, content in self._added.items()}
        self._bytes: dict[int, bytes] = {}

    @property
    def name(self) -> str:
        return "hf"

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A batch of one: unlike `encode`, the library's batch call lets go of the GIL while it
        works, so a long text tokenized on a thread does not stall the event loop."""
        (encoding,) = self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)
        return list(encoding.ids)

    def special_tokens(self) -> dict[str, str]:
        named = {"bos_token": self.bos_id, "eos_token": self.eos_ids[0] if self.eos_ids else None}
        texts = {name: self._tokenizer.id_to_token(i) for name, i in named.items() if i is not None}
        return {name: text for name, text in texts.items() if text is not None}

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def new_decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        if skip_special_tokens:
            return WindowedTokenDecoder(self.decode)
        return WindowedTokenDecoder(functools.partial(self.decode, skip_special_tokens=False))

    def token_bytes(self, token_id: int) -> bytes:
        """Added tokens: their content; others: their vocabulary piece as the decoder spells
        it (see `piece_spelling`). Cached: at most one entry per id of the vocabulary."""
        known = self._bytes.get(token_id)
        if known is None:
            known = self._bytes[token_id] = self._own_bytes(token_id)
        return known

    def added_token(self, text: str) -> int | None:
        return self._added_ids.get(text)

    def _own_bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        piece = self._tokenizer.id_to_token(token_id) if token_id >= 0 else None
        if piece is None:
            return b""
        spelled = self._spell(piece)
        if spelled is None:  # a decoder without a per-piece rule: its decode of the id alone
            return self._tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")
        return spelled


# ---- one token's bytes ---------------------------------------------------------------------

Spelling = Callable[[str], bytes | None]
PieceRule = Callable[[str], str | bytes]
WHOLE_TEXT_STEPS = frozenset({"Fuse", "Strip"})
BYTE_FALLBACK_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def gpt2_unicode_to_byte() -> dict[str, int]:
    """GPT-2's printable spelling of the 256 bytes, the alphabet of byte-level vocabularies,
    as the map back from spelling to byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    extra = (b for b in range(256) if b not in printable)
    spelling = {chr(b): b for b in printable}
    spelling |= {chr(256 + n): b for n, b in enumerate(extra)}
    return spelling


def byte_level_bytes(piece: str) -> bytes:
    """A byte-level BPE piece's bytes; a character outside the alphabet stands for itself."""
    alphabet = gpt2_unicode_to_byte()
    return b"".join(bytes((alphabet[c],)) if c in alphabet else c.encode("utf-8") for c in piece)


def piece_spelling(decoder: dict[str, Any] | None) -> Spelling:
    """How a tokenizer.json's decoder spells one vocabulary piece: byte-level (GPT-2's table),
    or the piece's text after the decoder's per-piece steps (`Replace`, `Metaspace`'s
    replacement, `ByteFallback`'s `<0xAB>`, `WordPiece`'s word starts and continuations).
    Steps over the whole text (`Fuse`, `Strip`, cleanups) are left out: a token alone has no
    neighbours, so a word's first piece keeps its leading space even at the text's start.
    None from the spelling: the decoder has a step without a per-piece rule."""
    steps = _decoder_steps(decoder)
    if any(step.get("type") == "ByteLevel" for step in steps):
        return byte_level_bytes
    rules = [_piece_rule(step) for step in steps]
    if any(rule is None for rule in rules):
        return lambda piece: None
    return functools.partial(_spell_piece, [rule for rule in rules if rule is not None])


def _decoder_config(tokenizer: tokenizers.Tokenizer) -> dict[str, Any] | None:
    decoder = tokenizer.decoder
    return None if decoder is None else cast(dict[str, Any], json.loads(decoder.__getstate__()))


def _decoder_steps(decoder: dict[str, Any] | None) -> list[dict[str, Any]]:
    if decoder is None:
        return []
    if decoder.get("type") == "Sequence":
        return [step for inner in decoder.get("decoders", []) for step in _decoder_steps(inner)]
    return [decoder]


def _piece_rule(step: dict[str, Any]) -> PieceRule | None:
    kind = step.get("type")
    if kind in WHOLE_TEXT_STEPS:
        return lambda piece: piece
    if kind == "Replace" and "String" in step.get("pattern", {}):
        old, new = step["pattern"]["String"], step.get("content", "")
        return lambda piece: piece.replace(old, new)
    if kind == "Metaspace":
        replacement = step.get("replacement", "▁")
        return lambda piece: piece.replace(replacement, " ")
    if kind == "ByteFallback":
        return _byte_fallback
    if kind == "WordPiece":
        return functools.partial(_word_piece, step.get("prefix", "##"))
    return None


def _word_piece(prefix: str, piece: str) -> str:
    """A continuation piece joins its word; any other starts a word, after a space."""
    return piece[len(prefix) :] if piece.startswith(prefix) else " " + piece


def _byte_fallback(piece: str) -> str | bytes:
    match = BYTE_FALLBACK_PIECE.fullmatch(piece)
    return bytes((int(match.group(1), 16),)) if match else piece


def _spell_piece(rules: list[PieceRule], piece: str) -> bytes:
    """The rules in the decoder's order, until one yields bytes (a byte-fallback piece)."""
    text = piece
    for rule in rules:
        spelled = rule(text)
        if isinstance(spelled, bytes):
            return spelled
        text = spelled
    return text.encode("utf-8")


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
    """Cuts a text stream before the first stop string, never emitting part of one (with
    `include`, after it: the stop string that ends the text is its last part, as vLLM's
    include_stop_str_in_output; of two starting at one place, the shorter, which is whole first
    however the text comes in pieces).

    Invariant: the held-back text is the longest tail of the text seen so far
    that is a proper prefix of some stop string, and it contains no full stop
    string. So it is shorter than the longest stop, and a push only searches
    the held-back text plus the new text.
    """

    def __init__(self, stops: Sequence[str], include: bool = False) -> None:
        # An empty stop string would match before any text; it is ignored.
        self._stops = tuple(dict.fromkeys(stop for stop in stops if stop))
        self._include = include
        self._stop_prefixes = frozenset(
            stop[:length] for stop in self._stops for length in range(1, len(stop))
        )
        self._max_held_len = max((len(stop) for stop in self._stops), default=1) - 1
        self._held = ""
        self._stopped = False
        self.matched: str | None = None  # the stop string found

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def has_stops(self) -> bool:
        return bool(self._stops)

    def push(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit now, whether a stop string was found)."""
        if not self._stops:
            return text, False
        if self._stopped:
            return "", True
        pending = self._held + text
        match = self._earliest_match(pending)
        if match is not None:
            self._held = ""
            self._stopped = True
            start, self.matched = match
            return pending[: start + len(self.matched) if self._include else start], True
        safe_len = len(pending) - self._held_back_len(pending)
        self._held = pending[safe_len:]
        return pending[:safe_len], False

    def flush(self) -> str:
        """Returns the held-back text; call at the end of a stream that did not stop."""
        held, self._held = self._held, ""
        return held

    def _earliest_match(self, pending: str) -> tuple[int, str] | None:
        """(where the first stop string in `pending` starts, which one it is: the shorter of
        two that start there)."""
        found = [(pending.find(stop), len(stop), stop) for stop in self._stops]
        start, _, stop = min((f for f in found if f[0] >= 0), default=(-1, 0, ""))
        return None if start < 0 else (start, stop)

    def _held_back_len(self, pending: str) -> int:
        for length in range(min(len(pending), self._max_held_len), 0, -1):
            if pending[-length:] in self._stop_prefixes:
                return length
        return 0
