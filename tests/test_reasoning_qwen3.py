"""A Qwen3-like checkpoint served as a user serves one: a tiny random Qwen3 from transformers,
with a tokenizer whose `<think>`, `</think>`, `<tool_call>` and `</tool_call>` are tokens added to
its vocabulary (not special, as Qwen3's are) and a chat template of Qwen3's shape (Hermes calls,
`enable_thinking`). Through the `openai` client: a required call opens and closes with the tokens
the model writes, an answer held to a schema comes after the thinking the grammar lets the reply
do, and with thinking disabled the reply is all answer. The model is random: what each reply
says is the grammar's doing, not the model's, so each is checked for what the grammar
guarantees."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import torch
from tokenizers import AddedToken

from stepahead.processes import Service, serving_pair
from tests.live import CALL_TIMEOUT_S, unused_port
from tests.test_architectures import COMMON, FAMILY, transformers
from tests.test_tokenizer import trained_byte_level_bpe

SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2: bos 1, eos 2 (COMMON's)
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
TRAINING = ['{"name": "temperature", "arguments": {"unit": "C"}}', "What unit? Celsius or Fahrenheit."]
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>\n"
    "{%- for t in tools %}{{ t | tojson }}\n{%- endfor %}"
    '</tools>\nCall a function as:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call><|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{%- endif %}"
    "{%- endif %}"
)
UNIT: dict[str, Any] = {
    "type": "object",
    "properties": {"unit": {"enum": ["C", "F"]}},
    "required": ["unit"],
    "additionalProperties": False,
}
TOOLS: Any = [{"type": "function", "function": {"name": "temperature", "parameters": UNIT}}]


def write_checkpoint(directory: pathlib.Path) -> None:
    """A byte-level BPE tokenizer (as Qwen's), its tags added, and a random Qwen3 of its size."""
    tokenizer = trained_byte_level_bpe(SPECIALS, TRAINING)
    tokenizer.add_tokens([AddedToken(t, special=False) for t in ADDED])
    assert [tokenizer.token_to_id(t) for t in SPECIALS] == [0, 1, 2]
    qwen3_ids.update({t: tokenizer.token_to_id(t) or 0 for t in ADDED})
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "chat_template.jinja").write_text(TEMPLATE)
    config_class, extra = FAMILY["qwen3"]
    sizes = {"vocab_size": tokenizer.get_vocab_size(), "max_position_embeddings": 1024}
    config = getattr(transformers, config_class)(**{**COMMON, **sizes}, **extra)
    torch.manual_seed(5)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)


qwen3_ids: dict[str, int] = {}  # the added tags' ids, once written


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    directory = tmp_path_factory.mktemp("qwen3-like")
    write_checkpoint(directory)
    worker = ["--model", str(directory), "--check-invariants"]
    flags = ["--http-port", str(unused_port()), "--served-model-name", "m"]
    with serving_pair(worker, flags) as (_, scheduler):
        yield scheduler


def client(service: Service) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{service.http_url}/v1", api_key="unused", max_retries=0)


def ask(service: Service, **more: Any) -> Any:
    body: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": "What unit?"}],
        "max_tokens": 120,
        "temperature": 0,
        "timeout": CALL_TIMEOUT_S,
        **more,
    }
    return client(service).chat.completions.create(**body)


def test_a_required_call_is_written_with_the_vocabulary_s_tags(qwen3: Service) -> None:
    for seed in range(3):
        reply = ask(
            qwen3, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, seed=seed, temperature=1.0
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls or []
        assert call.function.name == "temperature" and json.loads(call.function.arguments)["unit"] in (
            "C",
            "F",
        )


def test_under_tool_choice_auto_the_reply_may_think_then_call(qwen3: Service) -> None:
    """The `<think>` token is no text, so `auto`'s free text alone would not allow it: the
    thinking grammar goes before `auto`'s as before any other (forced by logit_bias)."""
    weights = {"<think>": 100, "</think>": 100, "<tool_call>": 50}  # think first, then call
    bias = {str(qwen3_ids[tag]): weight for tag, weight in weights.items()}
    reply = ask(qwen3, tools=TOOLS, parallel_tool_calls=False, logit_bias=bias, logprobs=True)
    choice = reply.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert [t.token for t in choice.logprobs.content[:3]] == ["<think>", "</think>", "<tool_call>"]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert json.loads(call.function.arguments)["unit"] in ("C", "F")


def test_a_structured_answer_comes_after_the_thinking(qwen3: Service) -> None:
    """Forced by logit_bias (the grammar masks first, so only the tokens it allows can win): the
    reply opens its thinking with the `<think>` token; with `</think>` biased too it closes it at
    once and answers as the schema says; with only `<think>` biased it thinks on (no `<think>` can
    come inside a thought) until max_tokens."""
    response_format: Any = {"type": "json_schema", "json_schema": {"name": "unit", "schema": UNIT}}
    opening, closing = (str(qwen3_ids[t]) for t in ("<think>", "</think>"))
    closed = ask(
        qwen3, response_format=response_format, logit_bias={opening: 100, closing: 100}, logprobs=True
    )
    choice = closed.choices[0]
    assert choice.finish_reason == "stop" and json.loads(choice.message.content or "")["unit"] in ("C", "F")
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert [t.token for t in choice.logprobs.content[:2]] == ["<think>", "</think>"]  # one token each
    assert closed.usage is not None and closed.usage.completion_tokens_details is not None
    assert closed.usage.completion_tokens_details.reasoning_tokens == 2  # the tags, an empty thought
    thinking = ask(qwen3, response_format=response_format, logit_bias={opening: 100}, max_tokens=40)
    choice, extra = thinking.choices[0], thinking.choices[0].message.model_extra or {}
    assert choice.finish_reason == "length" and choice.message.content is None and extra["reasoning_content"]
    for seed in range(4):  # unforced: either way, what the grammar allows
        reply = ask(qwen3, response_format=response_format, seed=seed, temperature=1.0)
        choice, extra = reply.choices[0], reply.choices[0].message.model_extra or {}
        if choice.finish_reason == "stop":
            assert json.loads(choice.message.content or "")["unit"] in ("C", "F")
        else:
            assert (
                choice.finish_reason == "length"
                and choice.message.content is None
                and extra["reasoning_content"]
            )


def test_with_thinking_disabled_the_reply_is_all_answer(qwen3: Service) -> None:
    response_format: Any = {"type": "json_schema", "json_schema": {"name": "unit", "schema": UNIT}}
    for seed in range(3):
        reply = ask(
            qwen3,
            response_format=response_format,
            seed=seed,
            temperature=1.0,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "stop" and json.loads(choice.message.content or "")["unit"] in (
            "C",
            "F",
        )
        assert "reasoning_content" not in (choice.message.model_extra or {})
