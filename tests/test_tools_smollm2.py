"""Tool calling with SmolLM2-135M-Instruct through the running services (overlap), with the
official `openai` client: `tool_choice` `required`, a named function, `none` and `auto`,
`parallel_tool_calls` false, a streamed reply reassembled equal to the whole one, and a turn
after a tool's result. Every call the model makes names a tool it may call and its arguments
validate against that tool's schema (jsonschema), though the model, unconstrained, cannot write
a well-formed call; no call text ever reaches `content`. A bad definition is a 400 naming its
field, and the server serves on. README's agent loop runs as written."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from stepahead.processes import Service, serving_pair
from tests.live import CALL_TIMEOUT_S, unused_port

MAX_TOKENS = 120
WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD: dict[str, Any] = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
        "b": {"type": "integer", "minimum": -1000, "maximum": 1000},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": WEATHER,
        },
    },
    {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}},
]
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]
SUM_QUESTION = [{"role": "user", "content": "What is 17 plus 25?"}]


@pytest.fixture(scope="module")
def scheduler() -> Iterator[Service]:
    worker_args = ["--model", "smollm2", "--kv-slots", "8192", "--request-slots", "16", "--check-invariants"]
    flags = ["--http-port", str(unused_port()), "--worker-step-timeout", str(CALL_TIMEOUT_S)]
    with serving_pair(worker_args, flags) as (_, service):
        yield service


@pytest.fixture(scope="module")
def client(scheduler: Service) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=scheduler.http_url + "/v1", api_key="unused", max_retries=0, timeout=CALL_TIMEOUT_S
    )


def chat(client: openai.OpenAI, **request: Any) -> Any:
    request.setdefault("max_tokens", MAX_TOKENS)
    request.setdefault("temperature", 0)
    return client.chat.completions.create(model="smollm2", tools=TOOLS, **request)


def check_calls(choice: Any, names: frozenset[str] = frozenset(SCHEMAS)) -> list[Any]:
    """The choice's calls, each checked: a tool it may call, arguments its schema validates, an
    id of its own; none of their text in the content."""
    calls = choice.message.tool_calls or []
    for call in calls:
        assert call.type == "function" and re.fullmatch(r"call_[0-9a-f]{24}", call.id)
        assert call.function.name in names, call
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert len({c.id for c in calls}) == len(calls)
    assert "<tool_call>" not in (choice.message.content or "")
    return calls


def test_required_makes_valid_calls(client: openai.OpenAI) -> None:
    done = chat(client, messages=WEATHER_QUESTION, tool_choice="required")
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None and check_calls(choice)


def test_a_named_function_is_the_one_called(client: openai.OpenAI) -> None:
    """Named even where the question asks for the other tool."""
    named = {"type": "function", "function": {"name": "add"}}
    for messages in (SUM_QUESTION, WEATHER_QUESTION):
        done = chat(client, messages=messages, tool_choice=named)
        assert done.choices[0].finish_reason == "tool_calls"
        assert check_calls(done.choices[0], frozenset({"add"}))


def test_parallel_tool_calls_false_makes_one_call(client: openai.OpenAI) -> None:
    for temperature, seed in [(0, 0), (1.0, 1), (1.0, 2)]:
        done = chat(
            client,
            messages=WEATHER_QUESTION,
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=temperature,
            seed=seed,
        )
        assert done.choices[0].finish_reason == "tool_calls"
        assert len(check_calls(done.choices[0])) == 1


def test_none_answers_in_text(client: openai.OpenAI) -> None:
    done = chat(client, messages=WEATHER_QUESTION, tool_choice="none")
    choice = done.choices[0]
    assert choice.message.tool_calls is None and choice.message.content
    assert choice.finish_reason in ("stop", "length")


def test_auto_answers_in_text_or_in_valid_calls(client: openai.OpenAI) -> None:
    """The model chooses; whatever it chooses, seeded or greedy, a call it begins is whole and
    valid, and `finish_reason` says which it chose."""
    for seed in range(4):
        done = chat(client, messages=WEATHER_QUESTION, temperature=0.9 * bool(seed), seed=seed, n=2)
        for choice in done.choices:
            calls = check_calls(choice)
            if choice.finish_reason == "tool_calls":
                assert calls
            else:
                assert not calls and choice.message.content, choice


def test_a_streamed_reply_reassembles_into_the_whole_one(client: openai.OpenAI) -> None:
    for request in (
        {"messages": SUM_QUESTION, "tool_choice": "required"},
        {"messages": WEATHER_QUESTION, "tool_choice": "auto", "temperature": 1.0, "seed": 3},
    ):
        whole = chat(client, **request).choices[0]
        content, calls, finish, pieces = "", dict[int, dict[str, str]](), None, 0
        for chunk in chat(client, stream=True, **request):
            if not chunk.choices:
                continue
            delta, finish = chunk.choices[0].delta, chunk.choices[0].finish_reason or finish
            content += delta.content or ""
            for d in delta.tool_calls or []:
                if d.id is not None:
                    calls[d.index] = {"name": d.function.name, "arguments": ""}
                calls[d.index]["arguments"] += d.function.arguments or ""
                pieces += 1
        assert finish == whole.finish_reason
        assert content == (whole.message.content or "")
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [
            (c.function.name, c.function.arguments) for c in check_calls(whole)
        ]
        if calls:  # the arguments came in pieces, as they were generated
            assert pieces > len(calls)


def test_a_turn_after_a_tool_result(client: openai.OpenAI) -> None:
    first = chat(client, messages=SUM_QUESTION, tool_choice={"type": "function", "function": {"name": "add"}})
    call = check_calls(first.choices[0])[0]
    arguments = json.loads(call.function.arguments)
    history = [
        *SUM_QUESTION,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": str(arguments["a"] + arguments["b"])},
    ]
    done = chat(client, messages=history, tool_choice="none")
    assert done.choices[0].message.content and done.choices[0].message.tool_calls is None
    assert done.usage.prompt_tokens > first.usage.prompt_tokens


BAD_SCHEMA = {"type": "object", "properties": {"x": {"type": "nonsense"}}}


@pytest.mark.parametrize(
    ("request_fields", "param"),
    [
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
        ({"tools": [], "tool_choice": "required"}, "tool_choice"),
    ],
)
def test_a_bad_definition_is_a_400_naming_its_field_and_serving_goes_on(
    client: openai.OpenAI, request_fields: dict[str, Any], param: str
) -> None:
    request = {"messages": SUM_QUESTION, "tools": TOOLS, "max_tokens": 8, **request_fields}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="smollm2", **request)
    error = refused.value.body
    assert isinstance(error, dict) and error["param"] == param, error
    done = chat(client, messages=SUM_QUESTION, tool_choice="required", parallel_tool_calls=False)
    assert check_calls(done.choices[0])


def test_the_readme_agent_loop_runs_as_written(
    scheduler: Service, capsys: pytest.CaptureFixture[str]
) -> None:
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    loop = next(b for b in blocks if "tool_calls" in b)
    assert len(loop.strip().splitlines()) <= 24
    code = loop.replace("http://127.0.0.1:8000/v1", scheduler.http_url + "/v1")
    exec(compile(code, "<README.md agent loop>", "exec"), {})
    out = capsys.readouterr().out
    assert "add(" in out, out  # the loop printed the call it ran
