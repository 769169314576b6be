"""Structured-output constraints compiled to llguidance grammars: by the frontends, to refuse a
bad one before admission with a reason naming it, and by the worker, whose matchers run them.

A constraint is JSON Schema, a regex, a choice among strings, or a Lark grammar (llguidance's
dialect); its compiled form is cached by content, as clients repeat their schemas.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llguidance

from stepahead.protocol import Constraint

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

__all__ = [
    "GRAMMAR_CACHE_SIZE",
    "JSON_LAYOUT",
    "CompileStats",
    "GrammarError",
    "compile_constraint",
    "is_cached",
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


def _compile(constraint: Constraint) -> str:
    kind, text = constraint.kind, constraint.text
    try:
        if kind == "json":
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
