"""Structured-output constraints compiled to llguidance grammars: by the frontends, to refuse a
bad one before admission with a reason naming it, and by the worker, whose matchers run them.

A constraint is JSON Schema, a regex, a choice among strings, or a Lark grammar (llguidance's
dialect); its compiled form is cached by content, as clients repeat their schemas.

A reasoning model's reply thinks first, free, and only its answer is held to the constraint
(`thinking_constraint`): the grammar itself allows a `<think>` ... `</think>` block before the
answer (or, where the prompt opened it, requires the rest of one), so whether a row's next token
is free or masked follows from its tokens so far inside the matcher, on the worker beside the
sampler, like any other state of a grammar the scheduler has not seen yet.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import llguidance

from stepahead.protocol import Constraint, ConstraintKind

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

__all__ = [
    "GRAMMAR_CACHE_SIZE",
    "JSON_LAYOUT",
    "CompileStats",
    "GrammarError",
    "answer_kind",
    "compile_constraint",
    "is_cached",
    "thinking_constraint",
]

GRAMMAR_CACHE_SIZE = 256  # compiled constraints kept, by content
# JSON as `json.dumps` writes it: free whitespace would let a sampler emit whitespace without end
# (a vocabulary has thousands of whitespace tokens). A schema's `x-guidance` may say otherwise.
JSON_LAYOUT: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
ANY_JSON_OBJECT = '{"type": "object"}'  # OpenAI's response_format json_object
# The thinking before an answer (`@answer`, the constraint's own grammar): one block, then up to
# two newlines. A reply may open it, or answer at once; one whose prompt opened it is inside it
# from its first token. Written as text (free text up to the first `</think>`: a lazy lexeme),
# or, where the tags are tokens added to the vocabulary (Qwen3's), as those tokens, which the
# grammar engine takes as special: named by id, and never part of a text lexeme.
THOUGHT_AS_TEXT = {
    False: r"thought[lazy]: /<think>(.|\n)*<\/think>/",
    True: r"thought[lazy]: /(.|\n)*<\/think>/",
}
THOUGHT_AS_TOKENS = {False: "thought: <[{open}]> THOUGHT? <[{close}]>", True: "thought: THOUGHT? <[{close}]>"}
THOUGHT_RULES = r"""THOUGHT: /(.|\n)+/
GAP: /\n\n?/
"""


class GrammarError(ValueError):
    """A constraint that does not compile; the message says why."""


@dataclass
class CompileStats:
    """Compilations done (`seconds` in all) and requests the cache answered."""

    compiled: int = 0
    seconds: float = 0.0
    cache_hits: int = 0


_STATS = CompileStats()
_LOCK = threading.Lock()
_CACHE: OrderedDict[Constraint, str] = OrderedDict()  # least recently used first


def compile_stats() -> CompileStats:
    with _LOCK:
        return CompileStats(_STATS.compiled, _STATS.seconds, _STATS.cache_hits)


def is_cached(constraint: Constraint) -> bool:
    """Whether compiling `constraint` now would be a cache lookup: a hint (for whether to compile it
    off an event loop), as another thread may evict it meanwhile."""
    with _LOCK:
        return constraint in _CACHE


def compile_constraint(constraint: Constraint) -> str:
    """llguidance's grammar for `constraint`, checked; raises GrammarError naming what is wrong.
    Cached by content, the GRAMMAR_CACHE_SIZE most recently used (a failure is not cached: it is
    cheap to find again). Two threads may compile the same constraint at once; both get it."""
    with _LOCK:
        grammar = _CACHE.get(constraint)
        if grammar is not None:
            _CACHE.move_to_end(constraint)
            _STATS.cache_hits += 1
            return grammar
    start = time.perf_counter()
    grammar = _compile(constraint)
    seconds = time.perf_counter() - start
    with _LOCK:
        _STATS.compiled += 1
        _STATS.seconds += seconds
        _CACHE[constraint] = grammar
        if len(_CACHE) > GRAMMAR_CACHE_SIZE:
            _CACHE.popitem(last=False)
    return grammar


def thinking_constraint(answer: Constraint, inside: bool, tags: tuple[int, int] | None = None) -> Constraint:
    """`answer` held after a reasoning model's thinking: a reply that may open a `<think>` block
    first, or (`inside`: its prompt opened one) is in one from its first token. `tags`: the ids
    of `<think>` and `</think>` where they are tokens added to the vocabulary (None: text)."""
    opening, closing = tags or (-1, -1)
    return Constraint("thinking", f"{int(inside)} {answer.kind} {opening} {closing}\n{answer.text}")


def answer_kind(constraint: Constraint) -> ConstraintKind:
    """The client's kind of constraint: a thinking constraint's answer's."""
    if constraint.kind != "thinking":
        return constraint.kind
    return cast(ConstraintKind, constraint.text.partition("\n")[0].split(" ")[1])


def _thinking(text: str) -> str:
    """The grammar of a `thinking_constraint`: its answer's grammar, named, after the thought."""
    header, _, body = text.partition("\n")
    inside_flag, kind, opening, closing = header.split(" ")
    if kind not in ("json", "regex", "choice", "grammar"):
        raise ValueError(f"a thinking constraint's answer is json, regex, choice or grammar, not {kind!r}")
    answer = compile_constraint(Constraint(cast(ConstraintKind, kind), body))
    entry = {"lark_grammar": answer} if kind == "grammar" else json.loads(answer)["grammars"][0]
    inside = inside_flag == "1"
    if int(closing) >= 0:
        thought = THOUGHT_AS_TOKENS[inside].format(open=int(opening), close=int(closing))
    else:
        thought = THOUGHT_AS_TEXT[inside]
    start = "start: thought @answer | thought GAP @answer" + ("" if inside else " | @answer")
    wrapper = f"{start}\n{thought}\n{THOUGHT_RULES}"
    return json.dumps({"grammars": [{"lark_grammar": wrapper}, {**entry, "name": "answer"}]})


def _compile(constraint: Constraint) -> str:
    kind, text = constraint.kind, constraint.text
    try:
        if kind == "thinking":
            grammar = _thinking(text)
        elif kind == "json":
            schema = json.loads(text)
            if isinstance(schema, bool):  # true: any JSON value, false: none (refused below)
                schema = {} if schema else {"not": {}}
            if not isinstance(schema, dict):
                raise ValueError("a JSON Schema is an object (or true/false)")
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(text)
        elif kind == "choice":
            grammar = llguidance.LLMatcher.grammar_from_regex(_choice_regex(text))
        else:
            grammar = llguidance.LLMatcher.grammar_from_lark(text)
    except (ValueError, TypeError, RecursionError) as exc:  # json.loads, or the schema compiler
        raise GrammarError(str(exc)) from exc
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem and not problem.startswith("WARNING"):
        raise GrammarError(problem)
    return grammar


def _choice_regex(text: str) -> str:
    choices = json.loads(text)
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError("the choices must be a non-empty list of strings")
    return "|".join(f"({re.escape(choice)})" for choice in choices)
