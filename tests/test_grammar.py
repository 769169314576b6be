"""The worker's grammar matchers (worker_svc/grammar.py), on their own: masks that keep a
sampler to JSON Schema, regex, choice and Lark constraints, for the byte-level tokenizer and
SmolLM2's, a finished matcher that takes no more tokens, a replay equal to the live matcher, and
bad constraints refused with a reason.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from stepahead.protocol import TokenizerSpec
from worker_svc.gguf import smollm2_path, tokenizer_from_gguf
from worker_svc.grammar import (
    Constraint,
    GrammarError,
    MatcherTable,
    apply_bitmask,
    compile_constraint,
    grammar_tokenizer,
    new_bitmask,
)

BYTE_VOCAB, BYTE_EOS = 258, 257
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def byte_table() -> MatcherTable:
    return MatcherTable(grammar_tokenizer(TokenizerSpec("byte"), BYTE_VOCAB, (BYTE_EOS,)), BYTE_VOCAB)


@pytest.fixture(scope="module")
def smollm2_table() -> tuple[MatcherTable, int]:
    hf = tokenizer_from_gguf(smollm2_path())
    vocab = hf.get_vocab_size(with_added_tokens=True)
    eos = hf.token_to_id("<|im_end|>")
    assert eos is not None
    spec = TokenizerSpec("hf", hf.to_str().encode())
    return MatcherTable(grammar_tokenizer(spec, vocab, (eos,)), vocab), eos


def constrained_sample(table: MatcherTable, slot: int, eos: int, seed: int, limit: int = 400) -> list[int]:
    """Draws from random logits under the slot's mask until the grammar finishes (then EOS)."""
    generator = torch.Generator().manual_seed(seed)
    bitmask = new_bitmask(1, table.vocab_size)
    tokens: list[int] = []
    for _ in range(limit):
        logits = torch.randn(1, table.vocab_size, generator=generator, dtype=torch.float32)
        table.fill_masks([slot], bitmask)
        apply_bitmask(logits, bitmask)
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        if token == eos:
            assert table.finished(slot) or table_accepts_eos(table, slot, eos)
            return tokens
        tokens.append(token)
        if table.advance(slot, token):
            return tokens
    raise AssertionError(f"no finish in {limit} tokens")


def table_accepts_eos(table: MatcherTable, slot: int, eos: int) -> bool:
    bitmask = new_bitmask(1, table.vocab_size)
    table.fill_masks([slot], bitmask)
    return bool((bitmask[0, eos // 32] >> (eos % 32)) & 1)


@pytest.mark.parametrize("seed", range(5))
def test_a_json_schema_keeps_a_random_sampler_to_valid_json(byte_table: MatcherTable, seed: int) -> None:
    byte_table.start(seed, Constraint("json", json.dumps(PERSON)))
    text = bytes(constrained_sample(byte_table, seed, BYTE_EOS, seed)).decode()
    jsonschema.validate(json.loads(text), PERSON)
    byte_table.release(seed)


@pytest.mark.parametrize("seed", range(3))
def test_a_json_schema_holds_with_smollm2s_tokenizer(
    smollm2_table: tuple[MatcherTable, int], seed: int
) -> None:
    table, eos = smollm2_table
    hf = tokenizer_from_gguf(smollm2_path())
    table.start(seed, Constraint("json", json.dumps(PERSON)))
    text = hf.decode(constrained_sample(table, seed, eos, seed))
    jsonschema.validate(json.loads(text), PERSON)
    table.release(seed)


def test_regex_and_choice(byte_table: MatcherTable) -> None:
    byte_table.start(100, Constraint("regex", r"[A-Z]{2}-\d{3}"))
    assert re.fullmatch(r"[A-Z]{2}-\d{3}", bytes(constrained_sample(byte_table, 100, BYTE_EOS, 7)).decode())
    choices = ["red", "green", "blue"]
    byte_table.start(101, Constraint("choice", json.dumps(choices)))
    assert bytes(constrained_sample(byte_table, 101, BYTE_EOS, 8)).decode() in choices


def test_a_finished_matcher_takes_no_more_tokens(byte_table: MatcherTable) -> None:
    byte_table.start(200, Constraint("choice", json.dumps(["yes"])))
    assert [byte_table.advance(200, t) for t in b"yes"] == [False, False, True]
    with pytest.raises(GrammarError, match="has finished"):
        byte_table.advance(200, ord("!"))


def test_a_token_outside_the_mask_is_refused(byte_table: MatcherTable) -> None:
    byte_table.start(201, Constraint("regex", r"\d+"))
    with pytest.raises(GrammarError, match="outside its grammar"):
        byte_table.advance(201, ord("x"))


def test_a_replayed_matcher_masks_as_the_live_one(byte_table: MatcherTable) -> None:
    """A recomputed request starts a fresh matcher with the tokens it has: same state."""
    byte_table.start(300, Constraint("json", json.dumps(PERSON)))
    prefix = list(b'{"name": "ab", "age": 4')
    for token in prefix:
        byte_table.advance(300, token)
    byte_table.start(301, Constraint("json", json.dumps(PERSON)), prefix)
    masks = new_bitmask(2, BYTE_VOCAB)
    byte_table.fill_masks([300, 301], masks)
    assert torch.equal(masks[0], masks[1]) and not torch.equal(masks[0], new_bitmask(1, BYTE_VOCAB)[0])


def test_released_matchers_are_gone(byte_table: MatcherTable) -> None:
    live = len(byte_table)
    byte_table.start(400, Constraint("regex", "a+"))
    assert len(byte_table) == live + 1 and 400 in byte_table
    byte_table.release(400)
    assert len(byte_table) == live and 400 not in byte_table


@pytest.mark.parametrize(
    ("constraint", "says"),
    [
        (Constraint("json", "{not json"), "Expecting property name"),
        (Constraint("json", json.dumps({"type": "nonsense"})), "nonsense"),
        (Constraint("json", "[1, 2]"), "a JSON Schema is an object"),
        (Constraint("regex", "a(b"), "unclosed group"),
        (Constraint("choice", "[]"), "non-empty"),
        (Constraint("grammar", "start: undefined_rule"), "undefined_rule"),
    ],
)
def test_bad_constraints_are_refused_with_a_reason(
    byte_table: MatcherTable, constraint: Constraint, says: str
) -> None:
    with pytest.raises(GrammarError, match=says):
        compile_constraint(constraint)
        byte_table.start(500, constraint)
