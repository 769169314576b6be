"""Chat messages to prompt text, through the model's Jinja chat template, rendered as transformers'
`apply_chat_template` renders it."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import NoReturn

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template cannot render these messages (its raise_exception, or a template error)."""


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


# Errors a template's own expressions raise on some input (`{{ 1 // 0 }}`, `{{ 'a' + 1 }}`, a macro
# calling itself forever): the template cannot render those messages.
_RENDER_ERRORS = (jinja2.TemplateError, ArithmeticError, LookupError, TypeError, ValueError, RecursionError)


class ChatTemplate:
    def __init__(self, source: str, special_tokens: Mapping[str, str]) -> None:
        """Compiles `source` once (raises ChatTemplateError when it does not compile). `special_tokens`
        are the template variables transformers passes: bos_token, eos_token, unk_token, pad_token
        (only the ones the tokenizer has)."""
        self._special_tokens = dict(special_tokens)
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"chat template does not compile: {error}") from error

    def render(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> str:
        # NOTE: transformers defines `tools` and `documents` (as None) for every template.
        variables = {
            **self._special_tokens,
            "messages": [{"role": m.role, "content": m.content} for m in messages],
            "add_generation_prompt": add_generation_prompt,
            "tools": None,
            "documents": None,
        }
        try:
            return self._template.render(variables)
        except ChatTemplateError:
            raise
        except _RENDER_ERRORS as error:
            raise ChatTemplateError(f"chat template failed: {error}") from error


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(message)


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' `tojson`: plain json.dumps, so no HTML escaping, and non-ASCII kept as is."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)
