from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import pytest
from tokenizers import Tokenizer as HFRawTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

from scheduler_svc.frontend.tokenizer import (
    BYTE_BOS_ID,
    BYTE_EOS_ID,
    REPLACEMENT_CHAR,
    ByteTokenizer,
    HFTokenizer,
    IncrementalDecoder,
    StopStringMatcher,
    WindowedTokenDecoder,
    load_tokenizer,
)
from worker_svc.gguf import smollm2_path, tokenizer_from_gguf

MULTILINGUAL = "héllo wörld 你好 🎉"
ASCII_TRAINING_TEXT = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello there. streaming text arrives one token at a time",
]
# Seen once in training, so that some tokens hold a whole character plus part of the next.
PARTLY_MERGED_TEXT = "héllo wörld 你好"
RANDOM_TEXT_ALPHABET = "abcdehlorw .,éö你好🎉ж"
NUM_RANDOM_TRIALS = 200

T = TypeVar("T")


# ---------------------------------------------------------------- helpers


def random_pieces(items: Sequence[T], rng: random.Random) -> list[list[T]]:
    """Splits items into consecutive pieces of random sizes, empty pieces included."""
    pieces = []
    start = 0
    while start < len(items):
        size = rng.choice([0, 1, 1, 2, 3, 5])
        pieces.append(list(items[start : start + size]))
        start += size
    return pieces


def decode_pieces(decoder: IncrementalDecoder, pieces: Sequence[Sequence[int]]) -> list[str]:
    """Push outputs in order, then the flush output last."""
    return [decoder.push(piece) for piece in pieces] + [decoder.flush()]


def random_text(rng: random.Random, length: int) -> str:
    return "".join(rng.choice(RANDOM_TEXT_ALPHABET) for _ in range(length))


def is_well_formed(text: str) -> bool:
    """No lone surrogates: the text can be encoded as UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def assert_whole_characters(chunks: Sequence[str]) -> None:
    for chunk in chunks:
        assert is_well_formed(chunk), repr(chunk)
        assert REPLACEMENT_CHAR not in chunk, repr(chunk)


# ---------------------------------------------------------------- test tokenizers


def trained_byte_level_bpe(special_tokens: list[str], texts: list[str]) -> HFRawTokenizer:
    """A small byte-level BPE (as GPT-2's and Qwen's) of 300 ids, trained on `texts`, its
    `special_tokens` first."""
    tokenizer = HFRawTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=special_tokens,
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def byte_level_bpe_json() -> bytes:
    """Small byte-level BPE with a BOS post-processor; rare characters span several tokens."""
    tokenizer = trained_byte_level_bpe(["<s>", "</s>"], [*ASCII_TRAINING_TEXT, PARTLY_MERGED_TEXT])
    bos_id = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos_id)]
    )
    return tokenizer.to_str().encode()


def metaspace_byte_fallback_json() -> bytes:
    """Metaspace BPE whose unknown characters fall back to one token per UTF-8 byte."""
    tokenizer = HFRawTokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tokenizer.train_from_iterator(ASCII_TRAINING_TEXT, trainer)
    config = json.loads(tokenizer.to_str())
    vocab = config["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    config["model"]["byte_fallback"] = True
    with_fallback = HFRawTokenizer.from_str(json.dumps(config))
    with_fallback.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return with_fallback.to_str().encode()


def wordpiece_json() -> bytes:
    """WordPiece, where whether a space joins two tokens depends on the second one."""
    tokenizer = HFRawTokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer()
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=80, special_tokens=["[UNK]", "[CLS]", "[SEP]"], show_progress=False
    )
    tokenizer.train_from_iterator([*ASCII_TRAINING_TEXT, MULTILINGUAL], trainer)
    return tokenizer.to_str().encode()


@pytest.fixture(scope="module")
def byte_level_bpe() -> HFTokenizer:
    return HFTokenizer(byte_level_bpe_json())


@pytest.fixture(scope="module", params=["byte_level_bpe", "metaspace_byte_fallback", "wordpiece"])
def any_hf_tokenizer(request: pytest.FixtureRequest) -> HFTokenizer:
    builders = {
        "byte_level_bpe": byte_level_bpe_json,
        "metaspace_byte_fallback": metaspace_byte_fallback_json,
        "wordpiece": wordpiece_json,
    }
    return HFTokenizer(builders[request.param]())


# ---------------------------------------------------------------- byte tokenizer


def test_byte_tokenizer_encodes_utf8_bytes_without_bos() -> None:
    tokenizer = ByteTokenizer()
    assert tokenizer.encode("aé") == [0x61, 0xC3, 0xA9]
    assert tokenizer.vocab_size == 258
    assert tokenizer.name == "byte"
    assert tokenizer.bos_id == 256
    assert tokenizer.eos_ids == (257,)


def test_byte_tokenizer_rejects_special_ids_outside_vocab() -> None:
    with pytest.raises(ValueError):
        ByteTokenizer(vocab_size=200)
    with pytest.raises(ValueError):
        ByteTokenizer(vocab_size=258, eos_ids=(258,))


def test_byte_decoder_one_byte_at_a_time_emits_whole_characters() -> None:
    tokenizer = ByteTokenizer()
    chunks = decode_pieces(tokenizer.new_decoder(), [[b] for b in tokenizer.encode(MULTILINGUAL)])
    assert_whole_characters(chunks)
    assert "".join(chunks) == MULTILINGUAL


def test_byte_decoder_emits_character_with_its_last_byte() -> None:
    decoder = ByteTokenizer().new_decoder()
    emoji = list("🎉".encode())
    assert [decoder.push([b]) for b in emoji] == ["", "", "", "🎉"]


def test_byte_decoder_random_splits_concatenate_to_original() -> None:
    tokenizer = ByteTokenizer()
    rng = random.Random(1)
    for _ in range(NUM_RANDOM_TRIALS):
        text = random_text(rng, rng.randint(0, 40))
        chunks = decode_pieces(tokenizer.new_decoder(), random_pieces(tokenizer.encode(text), rng))
        assert_whole_characters(chunks)
        assert "".join(chunks) == text


def test_byte_decoder_special_ids_decode_to_nothing() -> None:
    decoder = ByteTokenizer(vocab_size=512).new_decoder()
    assert decoder.push([256, 0x68, 257, 0x69, 400]) == "hi"
    assert decoder.flush() == ""


def test_byte_decoder_invalid_bytes_become_replacement_without_stalling() -> None:
    decoder = ByteTokenizer().new_decoder()
    assert decoder.push([0x80]) == REPLACEMENT_CHAR
    assert decoder.push([0xE4, 0xBD]) == ""
    assert decoder.push([0x61]) == REPLACEMENT_CHAR + "a"
    assert decoder.push([0xED, 0xA0, 0x80]) == REPLACEMENT_CHAR * 3  # encoded surrogate
    assert decoder.push([0xF0, 0x9F]) == ""
    assert decoder.flush() == REPLACEMENT_CHAR


def test_byte_decoder_matches_one_shot_decode_on_arbitrary_bytes() -> None:
    tokenizer = ByteTokenizer()
    rng = random.Random(2)
    interesting = [0x00, 0x61, 0x80, 0xBF, 0xC3, 0xA9, 0xE4, 0xED, 0xF0, 0x9F, 0xFF]
    for _ in range(NUM_RANDOM_TRIALS):
        data = bytes(rng.choice(interesting) for _ in range(rng.randint(0, 30)))
        chunks = decode_pieces(tokenizer.new_decoder(), random_pieces(list(data), rng))
        assert all(is_well_formed(chunk) for chunk in chunks)
        assert "".join(chunks) == data.decode("utf-8", errors="replace")


# ---------------------------------------------------------------- HF tokenizer


def test_bpe_fixture_splits_characters_across_tokens(byte_level_bpe: HFTokenizer) -> None:
    ids = byte_level_bpe.encode(MULTILINGUAL)
    token_texts = [byte_level_bpe.decode([token]) for token in ids]
    partial_characters = [text for text in token_texts if REPLACEMENT_CHAR in text]
    assert len(partial_characters) >= 4
    # Some token holds a whole character as well as part of another.
    assert any(text.strip(REPLACEMENT_CHAR) for text in partial_characters)


def test_hf_encode_uses_post_processor_and_decode_skips_specials(
    byte_level_bpe: HFTokenizer,
) -> None:
    ids = byte_level_bpe.encode("hello world")
    assert byte_level_bpe.encode("") == ids[:1]  # the BOS added by the post-processor
    assert byte_level_bpe.decode(ids[:1]) == ""
    assert byte_level_bpe.decode(ids) == "hello world"
    decoder = byte_level_bpe.new_decoder()
    assert "".join(decode_pieces(decoder, [ids, ids[:1]])) == "hello world"


def test_hf_incremental_decode_equals_full_decode(any_hf_tokenizer: HFTokenizer) -> None:
    rng = random.Random(3)
    texts = ASCII_TRAINING_TEXT + [MULTILINGUAL] + [random_text(rng, rng.randint(0, 40)) for _ in range(60)]
    for text in texts:
        ids = any_hf_tokenizer.encode(text)
        expected = any_hf_tokenizer.decode(ids)
        for _ in range(5):
            decoder = any_hf_tokenizer.new_decoder()
            chunks = decode_pieces(decoder, random_pieces(ids, rng))
            assert_whole_characters(chunks)
            assert "".join(chunks) == expected


def test_hf_decoder_one_token_at_a_time_emits_whole_characters(
    byte_level_bpe: HFTokenizer,
) -> None:
    ids = byte_level_bpe.encode(MULTILINGUAL)
    chunks = decode_pieces(byte_level_bpe.new_decoder(), [[token] for token in ids])
    assert_whole_characters(chunks)
    assert "".join(chunks) == MULTILINGUAL
    assert chunks[-1] == ""  # nothing was held back until the end


def lone_continuation_byte_id(tokenizer: HFTokenizer) -> int:
    """The token of the second byte of a character the tokenizer never merged."""
    lead_byte, continuation_byte = tokenizer.encode("ж")[-2:]
    assert tokenizer.decode([lead_byte, continuation_byte]) == "ж"
    return continuation_byte


def test_hf_decoder_invalid_bytes_do_not_stall(byte_level_bpe: HFTokenizer) -> None:
    invalid = lone_continuation_byte_id(byte_level_bpe)
    hello = byte_level_bpe.encode("hello")[1:]
    decoder = byte_level_bpe.new_decoder()
    assert decoder.push([invalid]) == ""
    assert decoder.push(hello) == REPLACEMENT_CHAR + "hello"
    assert decoder.flush() == ""


def test_hf_decoder_long_invalid_run_is_emitted_before_the_end(
    byte_level_bpe: HFTokenizer,
) -> None:
    invalid = lone_continuation_byte_id(byte_level_bpe)
    decoder = byte_level_bpe.new_decoder()
    emitted = "".join(decoder.push([invalid]) for _ in range(50))
    held_back = 50 - len(emitted)
    assert set(emitted) == {REPLACEMENT_CHAR}
    assert held_back <= WindowedTokenDecoder.MAX_INCOMPLETE_IDS + 1
    assert decoder.flush() == REPLACEMENT_CHAR * held_back


class RecordingDecode:
    """Wraps a decode function and records the longest id list it was given."""

    def __init__(self, tokenizer: HFTokenizer) -> None:
        self._tokenizer = tokenizer
        self.longest_window = 0

    def __call__(self, token_ids: list[int]) -> str:
        self.longest_window = max(self.longest_window, len(token_ids))
        return self._tokenizer.decode(token_ids)


def repeated_ids(tokenizer: HFTokenizer, text: str, times: int) -> Iterator[int]:
    ids = tokenizer.encode(text)[1:]
    for _ in range(times):
        yield from ids


def test_hf_decoder_window_stays_bounded(byte_level_bpe: HFTokenizer) -> None:
    bos = byte_level_bpe.encode("")[0]
    for text in ["hello world ", MULTILINGUAL]:
        recording = RecordingDecode(byte_level_bpe)
        decoder = WindowedTokenDecoder(recording)
        output = [decoder.push([token]) for token in repeated_ids(byte_level_bpe, text, 200)]
        output += [decoder.push([bos]) for _ in range(100)]
        output += [decoder.push(byte_level_bpe.encode(text)), decoder.flush()]
        assert "".join(output) == text * 201
        assert recording.longest_window <= 64


# ---------------------------------------------------------------- one token's bytes


def test_byte_token_bytes_are_the_byte_and_nothing_for_special_ids() -> None:
    tokenizer = ByteTokenizer()
    assert [tokenizer.token_bytes(i) for i in range(256)] == [bytes((i,)) for i in range(256)]
    assert tokenizer.token_bytes(BYTE_BOS_ID) == tokenizer.token_bytes(BYTE_EOS_ID) == b""
    for token in range(0x80):  # a whole character: what the decoder makes of the id alone
        assert (
            tokenizer.token_bytes(token)
            == "".join(decode_pieces(tokenizer.new_decoder(), [[token]])).encode()
        )


def token_id(raw: HFRawTokenizer, piece: str) -> int:
    token = raw.token_to_id(piece)
    assert token is not None, piece
    return token


@pytest.fixture(scope="module")
def smollm2_tokenizer() -> tuple[HFTokenizer, HFRawTokenizer]:
    raw = tokenizer_from_gguf(smollm2_path())
    return HFTokenizer(raw.to_str().encode()), raw


def test_smollm2_token_bytes_are_its_decode_of_each_whole_character_token(
    smollm2_tokenizer: tuple[HFTokenizer, HFRawTokenizer],
) -> None:
    tokenizer, raw = smollm2_tokenizer
    whole = 0
    for token in range(raw.get_vocab_size(with_added_tokens=True)):
        text = raw.decode([token], skip_special_tokens=False)
        if REPLACEMENT_CHAR not in text:  # tokens holding part of a character are checked below
            assert tokenizer.token_bytes(token) == text.encode(), token
            whole += 1
    assert whole > 0.99 * raw.get_vocab_size()
    assert tokenizer.token_bytes(token_id(raw, "<|im_end|>")) == b"<|im_end|>"


def test_smollm2_token_bytes_join_to_the_text_across_split_characters(
    smollm2_tokenizer: tuple[HFTokenizer, HFRawTokenizer],
) -> None:
    tokenizer, _ = smollm2_tokenizer
    for text in [MULTILINGUAL, PARTLY_MERGED_TEXT, "Grüß dich, ты 🎉🎉"]:
        ids = tokenizer.encode(text)
        assert any(REPLACEMENT_CHAR in tokenizer.decode([i]) for i in ids)  # some split a character
        assert b"".join(tokenizer.token_bytes(i) for i in ids) == text.encode()


# Each decoder's per-token bytes, joined over a text: a word-start marker keeps its space.
TOKEN_BYTES_JOINED = {
    "byte_level_bpe": (byte_level_bpe_json, ""),
    "metaspace_byte_fallback": (metaspace_byte_fallback_json, " "),
    "wordpiece": (wordpiece_json, " "),
}


@pytest.mark.parametrize(("build", "lead"), TOKEN_BYTES_JOINED.values(), ids=TOKEN_BYTES_JOINED.keys())
def test_hf_token_bytes_join_to_the_decoded_text(build: Callable[[], bytes], lead: str) -> None:
    tokenizer = HFTokenizer(build())
    ids = tokenizer.encode(MULTILINGUAL, add_special_tokens=False)
    assert b"".join(tokenizer.token_bytes(i) for i in ids) == (lead + tokenizer.decode(ids)).encode()


def test_byte_fallback_pieces_are_their_byte() -> None:
    tokenizer = HFTokenizer(metaspace_byte_fallback_json())
    raw = HFRawTokenizer.from_str(metaspace_byte_fallback_json().decode())
    assert tokenizer.token_bytes(token_id(raw, "<0xC3>")) == b"\xc3"
    assert tokenizer.token_bytes(token_id(raw, "<unk>")) == b"<unk>"  # an added token: its content


def test_a_decoder_without_a_piece_rule_spells_a_token_as_its_own_decode() -> None:
    raw = HFRawTokenizer.from_str(byte_level_bpe_json().decode())
    raw.decoder = decoders.CTC()
    tokenizer = HFTokenizer(raw.to_str().encode())
    for token in range(raw.get_vocab_size()):
        assert tokenizer.token_bytes(token) == raw.decode([token], skip_special_tokens=False).encode()


def test_ids_beyond_the_tokenizer_s_vocabulary_have_no_bytes() -> None:
    tokenizer = HFTokenizer(byte_level_bpe_json(), vocab_size=400)
    assert tokenizer.token_bytes(399) == b""


# ---------------------------------------------------------------- load_tokenizer


def test_load_tokenizer_byte() -> None:
    tokenizer = load_tokenizer("byte", b"", 300, 256, [257, 258])
    assert isinstance(tokenizer, ByteTokenizer)
    assert tokenizer.vocab_size == 300
    assert tokenizer.eos_ids == (257, 258)


def test_load_tokenizer_hf_reports_model_vocab_size() -> None:
    tokenizer = load_tokenizer("hf", byte_level_bpe_json(), 320, 0, [1])
    assert isinstance(tokenizer, HFTokenizer)
    assert tokenizer.name == "hf"
    assert tokenizer.vocab_size == 320
    assert tokenizer.decode(tokenizer.encode("hello")) == "hello"


@pytest.mark.parametrize(("kind", "hf_json"), [("sentencepiece", b""), ("hf", b""), ("hf", b"{not json")])
def test_load_tokenizer_rejects_bad_input(kind: str, hf_json: bytes) -> None:
    with pytest.raises(ValueError):
        load_tokenizer(kind, hf_json, 258, None, [])


# ---------------------------------------------------------------- stop strings


def test_no_stops_passes_text_through() -> None:
    matcher = StopStringMatcher([])
    assert matcher.push("anything </s>") == ("anything </s>", False)
    assert matcher.push("") == ("", False)
    assert matcher.flush() == ""


def test_stop_inside_one_push() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.push("hello STOP world") == ("hello ", True)
    assert matcher.stopped


def test_stop_across_pushes() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.push("hello ST") == ("hello ", False)
    assert matcher.push("O") == ("", False)
    assert matcher.push("P and more") == ("", True)


def test_stop_at_the_very_start() -> None:
    assert StopStringMatcher(["STOP"]).push("STOP") == ("", True)
    matcher = StopStringMatcher(["STOP"])
    assert [matcher.push(char) for char in "STOP"] == [
        ("", False),
        ("", False),
        ("", False),
        ("", True),
    ]


def test_overlapping_stops_cut_at_the_shorter_one() -> None:
    matcher = StopStringMatcher(["abc", "ab"])
    assert matcher.push("xa") == ("x", False)
    assert matcher.push("bc") == ("", True)


def test_shared_prefix_that_completes_no_stop_is_emitted() -> None:
    matcher = StopStringMatcher(["abc", "abd"])
    assert matcher.push("ab") == ("", False)
    assert matcher.push("e") == ("abe", False)


def test_an_included_stop_string_ends_the_text() -> None:
    """vLLM's include_stop_str_in_output: the text up to the end of the stop string, whether it
    comes in one piece or a character at a time; of two starting together, the shorter."""
    assert StopStringMatcher(["STOP"], include=True).push("hello STOP world") == ("hello STOP", True)
    matcher = StopStringMatcher(["STOP"], include=True)
    pieces = [matcher.push(char) for char in "hi STOP!"]
    assert "".join(text for text, _ in pieces) == "hi STOP" and pieces[-2] == ("STOP", True)
    for text in ("xabc", "xab"):
        assert StopStringMatcher(["abc", "ab"], include=True).push(text) == ("xab", True)
    matcher = StopStringMatcher(["abc", "ab"], include=True)
    assert [matcher.push(char) for char in "xabc"] == [("x", False), ("", False), ("ab", True), ("", True)]
    assert StopStringMatcher(["world", "lo"], include=True).push("hello world") == ("hello", True)


def test_earliest_of_several_stops_wins() -> None:
    assert StopStringMatcher(["world", "lo"]).push("hello world") == ("hel", True)
    assert StopStringMatcher(["lo", "world"]).push("hello world") == ("hel", True)


def test_held_back_prefix_is_emitted_when_it_turns_out_not_to_stop() -> None:
    matcher = StopStringMatcher(["</end>"])
    assert matcher.push("a</e") == ("a", False)
    assert matcher.push("x") == ("</ex", False)
    assert matcher.push("b</en") == ("b", False)
    assert matcher.flush() == "</en"
    assert matcher.flush() == ""


def test_nothing_is_emitted_after_a_stop() -> None:
    matcher = StopStringMatcher(["</s>"])
    assert matcher.push("x</s>y") == ("x", True)
    assert matcher.push("more") == ("", True)
    assert matcher.flush() == ""


def test_empty_stop_strings_are_ignored() -> None:
    matcher = StopStringMatcher(["", "</s>"])
    assert matcher.push("ab") == ("ab", False)
    assert StopStringMatcher([""]).push("ab") == ("ab", False)


def text_before_first_stop(text: str, stops: Sequence[str]) -> str:
    """What streaming must produce: text cut where the first stop string completes."""
    for end in range(1, len(text) + 1):
        starts = [end - len(stop) for stop in stops if text[:end].endswith(stop)]
        if starts:
            return text[: min(starts)]
    return text


def test_stop_matcher_random_splits() -> None:
    # No stop occurs inside another except as a suffix, so the cut never
    # depends on how the text was split.
    stops = ["</s>", "ab", "cab", "bb<"]
    longest_stop = max(len(stop) for stop in stops)
    rng = random.Random(4)
    for _ in range(NUM_RANDOM_TRIALS * 5):
        text = "".join(rng.choice("abc</s> ") for _ in range(rng.randint(0, 30)))
        matcher = StopStringMatcher(stops)
        emitted = ""
        pushed = ""
        stopped = False
        for piece in random_pieces(text, rng):
            chunk = "".join(piece)
            pushed += chunk
            safe, stopped = matcher.push(chunk)
            emitted += safe
            if stopped:
                break
            assert len(pushed) - len(emitted) < longest_stop
        if not stopped:
            emitted += matcher.flush()
        assert emitted == text_before_first_stop(text, stops)
        assert stopped == any(stop in text for stop in stops)
