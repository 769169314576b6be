"""Structured outputs from SmolLM2-135M-Instruct through the running services (overlap), with
the official `openai` client: JSON Schemas with enums, integer ranges, bounded arrays, nested
objects and patterns give JSON that the schema validates (jsonschema), on both endpoints,
greedy, seeded, with `n` > 1 and streamed; vLLM's `structured_outputs` regex, choice and
json_object work; a bad schema is a 400 naming its field, and the server keeps serving."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from stepahead.processes import Service, serving_pair
from tests.live import CALL_TIMEOUT_S, unused_port

MAX_TOKENS = 200

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,11}$"},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["engineer", "doctor", "teacher"]},
        "skills": {
            "type": "array",
            "items": {"type": "string", "maxLength": 16},
            "minItems": 1,
            "maxItems": 3,
        },
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "skills", "address"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "celsius": {"type": "integer", "minimum": -50, "maximum": 60},
        "sky": {"enum": ["sunny", "cloudy", "rainy", "snowy"]},
    },
    "required": ["city", "celsius", "sky"],
    "additionalProperties": False,
}
PERSON_PROMPT = [{"role": "user", "content": "Describe a fictional person as JSON."}]


@pytest.fixture(scope="module")
def scheduler() -> Iterator[Service]:
    worker_args = ["--model", "smollm2", "--kv-slots", "4096", "--request-slots", "16", "--check-invariants"]
    flags = ["--http-port", str(unused_port()), "--worker-step-timeout", str(CALL_TIMEOUT_S)]
    with serving_pair(worker_args, flags) as (_, service):
        yield service


@pytest.fixture(scope="module")
def client(scheduler: Service) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=scheduler.http_url + "/v1", api_key="unused", max_retries=0, timeout=CALL_TIMEOUT_S
    )


def chat(client: openai.OpenAI, **request: Any) -> Any:
    """A chat completion (`request` as the client takes it; typed loosely: the fields are the test's)."""
    return client.chat.completions.create(model="smollm2", **request)


def complete(client: openai.OpenAI, **request: Any) -> Any:
    return client.completions.create(model="smollm2", **request)


def schema_format(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def valid(text: str | None, schema: dict[str, Any]) -> Any:
    assert text is not None
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "seeded"])
def test_chat_json_schema_gives_valid_json(client: openai.OpenAI, temperature: float) -> None:
    reply = chat(
        client,
        messages=PERSON_PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=temperature,
        seed=7,
        response_format=schema_format("person", PERSON),
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    valid(choice.message.content, PERSON)


def test_completions_json_schema_with_n_completions_each_valid(client: openai.OpenAI) -> None:
    reply = complete(
        client,
        prompt="The weather report for Paris, as JSON: ",
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=11,
        n=3,
        extra_body={"response_format": schema_format("weather", WEATHER)},
    )
    assert len(reply.choices) == 3
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        valid(choice.text, WEATHER)


def test_a_streamed_json_schema_reply_is_valid_once_joined(client: openai.OpenAI) -> None:
    chunks = list(
        chat(
            client,
            messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            response_format=schema_format("weather", WEATHER),
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    valid(text, WEATHER)


def test_structured_outputs_regex_choice_and_json_object(client: openai.OpenAI) -> None:
    date = chat(
        client,
        messages=[{"role": "user", "content": "When did the first person walk on the Moon?"}],
        max_tokens=40,
        temperature=0,
        extra_body={"structured_outputs": {"regex": r"(19|20)[0-9]{2}-[01][0-9]-[0-3][0-9]"}},
    )
    assert re.fullmatch(r"(19|20)[0-9]{2}-[01][0-9]-[0-3][0-9]", date.choices[0].message.content or "")
    assert date.choices[0].finish_reason == "stop"
    answer = complete(
        client,
        prompt="Is the sea salty? Answer: ",
        max_tokens=10,
        temperature=0,
        extra_body={"structured_outputs": {"choice": ["yes", "no", "it depends"]}},
    )
    assert answer.choices[0].text in ("yes", "no", "it depends")
    anything = chat(
        client,
        messages=[{"role": "user", "content": "Give a JSON object with a name and a colour."}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert anything.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(anything.choices[0].message.content or ""), dict)


def test_a_bad_schema_is_a_400_naming_its_field_and_the_server_keeps_serving(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        chat(
            client,
            messages=PERSON_PROMPT,
            max_tokens=8,
            response_format=schema_format(
                "bad", {"type": "object", "properties": {"a": {"type": "nonsense"}}}
            ),
        )
    assert refused.value.body is not None
    assert "response_format.json_schema" in str(refused.value.body)
    with pytest.raises(openai.BadRequestError) as bad_regex:
        complete(
            client,
            prompt="x",
            max_tokens=4,
            extra_body={"structured_outputs": {"regex": "a(b"}},
        )
    assert "structured_outputs.regex" in str(bad_regex.value.body)
    reply = chat(
        client,
        messages=[{"role": "user", "content": "What is the weather in Rome?"}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        response_format=schema_format("weather", WEATHER),
    )
    valid(reply.choices[0].message.content, WEATHER)
