"""The Responses API (`POST /v1/responses`) through the official `openai` client: over a frontend
whose core is scripted (tests/test_openai_sampling.py), what reaches the core (the same prompt,
tool grammar and output constraint as the chat endpoint's for the same conversation) and what
the client gets back (output items, usage, `incomplete` at the length limit, log-probabilities,
function calls, a conversation that carries calls and their outputs), the stream's typed events
reassembling into the whole response, and each field it does not serve refused with a 400 naming
it while the frontend serves on; then live, a worker and a scheduler serving the tiny model,
whose greedy answer is the chat endpoint's."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx2
import jsonschema
import openai
import pydantic
import pytest

from scheduler_svc.contract import FinishReason
from scheduler_svc.frontend.openai.routes import build_app
from stepahead.processes import Service, serving_pair
from tests.live import CALL_TIMEOUT_S, unused_port
from tests.test_openai_api import assert_names, error_of
from tests.test_openai_sampling import (  # noqa: F401 (`scripted`: a fixture)
    EOS,
    LIVE_TEMPLATE,
    SCRIPTED_INFO,
    TINY,
    Scripted,
    scripted,
    steps_of,
)
from tests.test_tools_api import (
    PARIS,
    SCHEMAS,
    SUM_CALL,
    TOOLS,
    calls_text,
    served_call,
    tokens,
)

pytestmark = pytest.mark.anyio

# The tools as the Responses API defines them: flat, not under `function`.
FLAT_TOOLS: list[dict[str, Any]] = [{"type": "function", **tool["function"]} for tool in TOOLS]
QUESTION = "Weather in Paris?"


@pytest.fixture
def s(scripted: Scripted) -> Scripted:  # noqa: F811 (the imported fixture)
    """The scripted frontend with room for the tools' system turn (tests/test_tools_api.py)."""
    scripted.frontend.worker_state(dataclasses.replace(SCRIPTED_INFO, max_context_len=4096), True)
    return scripted


def respond(**more: Any) -> dict[str, Any]:
    return {"model": "scripted", "input": QUESTION, "max_output_tokens": 200, **more}


def chat(**more: Any) -> dict[str, Any]:
    return {
        "model": "scripted",
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 200,
        **more,
    }


async def played(s: Scripted, create: Any, reply: list[int], finish: FinishReason = FinishReason.STOP) -> Any:
    """`create`'s result once its completion generated `reply` (its last token finishing it)."""
    call = asyncio.ensure_future(create)
    await s.play(call, 1, steps_of(reply, finish))
    return await call


async def streamed(
    s: Scripted, reply: list[int], finish: FinishReason = FinishReason.STOP, **body: Any
) -> tuple[list[Any], Any]:
    """The events of `responses.stream` for `reply`, and the response its last event carries
    (the stream's final response when it completed)."""

    async def read() -> tuple[list[Any], Any]:
        async with s.client.responses.stream(**body) as stream:
            events: list[Any] = [event async for event in stream]
            last = events[-1].response
            if events[-1].type != "response.completed":  # the client's final response is a completed one
                return events, last
            final = await stream.get_final_response()
            assert final.model_dump() == last.model_dump()
            return events, final

    done: tuple[list[Any], Any] = await played(s, read(), reply, finish)
    return done


def output_text(response: Any) -> str:
    return "".join(part.text for item in response.output if item.type == "message" for part in item.content)


# ---- text --------------------------------------------------------------------------------------------


async def test_a_text_answer_is_one_message_with_usage_and_the_chat_prompt(s: Scripted) -> None:
    create = s.client.responses.create(**respond(instructions="Be brief."))
    done = await played(s, create, [*tokens("Sunny."), EOS])
    assert done.object == "response" and done.id.startswith("resp_") and done.status == "completed"
    assert [item.type for item in done.output] == ["message"] and done.output_text == "Sunny."
    message = done.output[0]
    assert message.role == "assistant" and message.status == "completed" and message.id.startswith("msg_")
    prompt = s.core.specs[-1].prompt_ids
    assert bytes(prompt).decode() == "Be brief." + QUESTION  # the instructions are the system turn
    assert (done.usage.input_tokens, done.usage.output_tokens) == (len(prompt), len("Sunny.") + 1)
    assert done.usage.total_tokens == done.usage.input_tokens + done.usage.output_tokens
    assert done.incomplete_details is None and done.error is None and done.store is False
    # The chat endpoint, asked the same, sends the core the same prompt and settings.
    await served_call(s, s.client.chat.completions.create(**chat()), "x")
    assert s.core.specs[-1].params.max_new_tokens == s.core.specs[-2].params.max_new_tokens == 200


async def test_the_length_limit_makes_the_response_incomplete(s: Scripted) -> None:
    create = s.client.responses.create(**respond(max_output_tokens=3))
    done = await played(s, create, tokens("abc"), FinishReason.LENGTH)
    assert s.core.specs[-1].params.max_new_tokens == 3
    assert done.status == "incomplete" and done.incomplete_details.reason == "max_output_tokens"
    assert done.output_text == "abc" and done.output[0].status == "incomplete"
    events, final = await streamed(s, tokens("abc"), FinishReason.LENGTH, **respond(max_output_tokens=3))
    assert events[-1].type == "response.incomplete" and final.output_text == "abc"


async def test_the_stream_s_events_reassemble_into_the_whole_response(s: Scripted) -> None:
    """OpenAI's sequence: created, in_progress, the message item and its text part added, a delta
    per piece of text, then each done with the whole text, and completed with the response."""
    reply = [*tokens("It is sunny"), 0xC3, 0xA9, *tokens("."), EOS]  # "é" in two tokens
    whole = await played(s, s.client.responses.create(**respond()), reply)
    events, final = await streamed(s, reply, **respond())
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert len(deltas) == len(reply) - 2  # one a token; the first byte of "é" has no text alone
    assert "".join(deltas) == final.output_text == whole.output_text == "It is sunny\u00e9."
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert final.usage == whole.usage and final.status == "completed"


async def test_log_probabilities_are_chat_s_entries(s: Scripted) -> None:
    include = ["message.output_text.logprobs"]
    body = respond(include=include, top_logprobs=2)
    done = await played(s, s.client.responses.create(**body), [*tokens("ab"), EOS])
    spec = s.core.specs[-1].params
    assert spec.logprobs and spec.top_logprobs == 2
    chat_done = await served_call(
        s, s.client.chat.completions.create(**chat(logprobs=True, top_logprobs=2)), "ab"
    )
    ours = [entry.model_dump() for entry in done.output[0].content[0].logprobs]
    theirs = [entry.model_dump(exclude={"bytes"}) for entry in chat_done.choices[0].logprobs.content]
    assert [{k: v for k, v in entry.items() if k != "bytes"} for entry in ours] == theirs
    assert [entry["token"] for entry in ours] == ["a", "b", ""] and len(ours[0]["top_logprobs"]) == 2
    events, final = await streamed(s, [*tokens("ab"), EOS], **body)
    assert [len(e.logprobs) for e in events if e.type == "response.output_text.delta"] == [1, 1]
    assert final.output[0].content[0].logprobs == done.output[0].content[0].logprobs  # EOS's too
    plain = await played(s, s.client.responses.create(**respond()), [*tokens("ab"), EOS])
    assert plain.output[0].content[0].logprobs == [] and not s.core.specs[-1].params.logprobs


# ---- function calls --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("choice", "parallel", "chat_choice"),
    [
        ("required", None, "required"),
        (
            {"type": "function", "name": "get_weather"},
            False,
            {"type": "function", "function": {"name": "get_weather"}},
        ),
    ],
    ids=["required", "named-one-call"],
)
async def test_a_call_is_a_function_call_item_under_the_chat_grammar(
    s: Scripted, choice: Any, parallel: bool | None, chat_choice: Any
) -> None:
    more: dict[str, Any] = {} if parallel is None else {"parallel_tool_calls": parallel}
    create = s.client.responses.create(**respond(tools=FLAT_TOOLS, tool_choice=choice, **more))
    done = await played(s, create, tokens(calls_text(PARIS)))
    await served_call(
        s, s.client.chat.completions.create(**chat(tools=TOOLS, tool_choice=chat_choice, **more)), ""
    )
    assert s.core.specs[-2].params.constraint == s.core.specs[-1].params.constraint is not None
    assert s.core.specs[-2].prompt_ids == s.core.specs[-1].prompt_ids
    (call,) = done.output
    assert call.type == "function_call" and call.status == "completed" and call.id.startswith("fc_")
    assert call.call_id.startswith("call_") and (call.name, call.arguments) == (PARIS.name, PARIS.arguments)
    assert done.output_text == "" and done.status == "completed"
    assert (done.tool_choice if isinstance(choice, str) else done.tool_choice.model_dump()) == choice
    assert done.parallel_tool_calls is (parallel is not False)


async def test_a_call_cut_by_the_length_limit_is_incomplete_with_its_arguments_so_far(s: Scripted) -> None:
    cut = tokens(calls_text(PARIS))[:-20]
    body = respond(tools=FLAT_TOOLS, tool_choice="required", max_output_tokens=len(cut))
    whole = await played(s, s.client.responses.create(**body), cut, FinishReason.LENGTH)
    events, streamed_end = await streamed(s, cut, FinishReason.LENGTH, **body)
    assert events[-1].type == "response.incomplete"
    for response in (whole, streamed_end):
        (call,) = response.output
        assert response.status == call.status == "incomplete" and call.name == PARIS.name
        assert PARIS.arguments.startswith(call.arguments) and call.arguments != PARIS.arguments


@pytest.mark.parametrize("content", ["", "Checking. "])
async def test_text_then_parallel_calls_stream_as_items_in_order(s: Scripted, content: str) -> None:
    reply = tokens(content + calls_text(PARIS, SUM_CALL))
    whole = await played(s, s.client.responses.create(**respond(tools=FLAT_TOOLS)), reply)
    events, final = await streamed(s, reply, **respond(tools=FLAT_TOOLS))
    for response in (whole, final):
        kinds = [item.type for item in response.output]
        assert kinds == ["message"] * bool(content) + ["function_call", "function_call"]
        calls = [item for item in response.output if item.type == "function_call"]
        assert [(c.name, c.arguments) for c in calls] == [
            (PARIS.name, PARIS.arguments),
            (SUM_CALL.name, SUM_CALL.arguments),
        ]
        assert response.output_text == content and calls[0].call_id != calls[1].call_id
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == [item.type for item in final.output]
    arguments = {e.output_index: "" for e in events if e.type == "response.function_call_arguments.done"}
    for event in events:
        if event.type == "response.function_call_arguments.delta":
            arguments[event.output_index] += event.delta
    assert list(arguments.values()) == [PARIS.arguments, SUM_CALL.arguments]


async def test_a_conversation_with_a_call_and_its_output_is_chat_s_prompt(s: Scripted) -> None:
    """The client sends back the items a response gave (its function call) and the call's output;
    the core gets the prompt the chat endpoint makes of the same turns."""
    first = await played(
        s,
        s.client.responses.create(**respond(tools=FLAT_TOOLS, tool_choice="required")),
        tokens(calls_text(PARIS)),
    )
    call = first.output[0]
    items = [
        {"role": "user", "content": QUESTION},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, clear"},
    ]
    done = await played(
        s, s.client.responses.create(**respond(input=items, tools=FLAT_TOOLS)), [*tokens("18 C."), EOS]
    )
    assert done.output_text == "18 C."
    history = called_history(call.call_id, call.name, call.arguments, "18 C, clear")
    await served_call(s, s.client.chat.completions.create(**chat(messages=history, tools=TOOLS)), "x")
    assert s.core.specs[-2].prompt_ids == s.core.specs[-1].prompt_ids
    assert bytes(s.core.specs[-1].prompt_ids).decode().endswith(QUESTION + calls_text(PARIS) + "18 C, clear")


def called_history(call_id: str, name: str, arguments: str, output: str) -> list[dict[str, Any]]:
    """The chat messages of QUESTION, an assistant turn of one call and the call's output."""
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    return [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": output},
    ]


# ---- structured output ----------------------------------------------------------------------------------


class City(pydantic.BaseModel):
    name: str
    country: str


async def test_text_format_is_chat_s_response_format_and_parse_reads_it(s: Scripted) -> None:
    answer = json.dumps({"name": "Kyoto", "country": "Japan"})
    create = s.client.responses.parse(**respond(), text_format=City)
    parsed = await played(s, create, [*tokens(answer), EOS])
    assert parsed.output_parsed == City(name="Kyoto", country="Japan")
    ours = s.core.specs[-1].params.constraint
    assert ours is not None and ours.kind == "json"
    schema = json.loads(ours.text)  # the client's strict form of City's schema
    assert set(schema["properties"]) == set(schema["required"]) == {"name", "country"}
    fmt = {"type": "json_schema", "json_schema": {"name": "City", "schema": schema}}
    await served_call(s, s.client.chat.completions.create(**chat(response_format=fmt)), "{}")
    assert s.core.specs[-1].params.constraint == ours
    json_object = respond(text={"format": {"type": "json_object"}})
    await played(s, s.client.responses.create(**json_object), [*tokens("{}"), EOS])
    await served_call(
        s, s.client.chat.completions.create(**chat(response_format={"type": "json_object"})), "{}"
    )
    assert s.core.specs[-2].params.constraint == s.core.specs[-1].params.constraint is not None


# ---- refusals -------------------------------------------------------------------------------------------

BAD: list[tuple[dict[str, Any], int, str]] = [
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input[0].type"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        400,
        "input[0].content[0]",
    ),
    ({"input": [{"role": "robot", "content": "x"}]}, 400, "input[0].role"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, 400, "input[0].arguments"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, 400, "input[0].call_id"),
    ({"input": 3}, 400, "input"),
    ({"tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "f", "parameters": 3}]}, 400, "tools[0].parameters"),
    (
        {"tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": 1}}]},
        400,
        "tools[0].parameters",
    ),
    ({"tools": FLAT_TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice.name"),
    ({"previous_response_id": "resp_1"}, 400, "previous_response_id"),
    ({"conversation": "conv_1"}, 400, "conversation"),
    ({"background": True}, 400, "background"),
    ({"max_tool_calls": 2}, 400, "max_tool_calls"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, 400, "text.format.name"),
    (
        {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
        400,
        "text.format.schema",
    ),
    ({"max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"max_output_tokens": 10**6}, 400, "max_output_tokens"),
    ({"top_logprobs": 21}, 400, "top_logprobs"),
    ({"include": ["file_search_call.results"]}, 400, "include[0]"),
    ({"reasoning": {"effort": "high"}}, 400, "reasoning.effort"),
    ({"truncation": "auto"}, 400, "truncation"),
    ({"temperature": -1}, 400, "temperature"),
    ({"instructions": 3}, 400, "instructions"),
    ({"seed": "x"}, 400, "seed"),
    ({"model": "gpt-4o"}, 404, "model"),
]


@pytest.fixture
async def http(s: Scripted) -> AsyncIterator[httpx2.AsyncClient]:
    transport = httpx2.ASGITransport(app=build_app(s.frontend))
    async with httpx2.AsyncClient(transport=transport, base_url="http://scripted") as client:
        yield client


@pytest.mark.parametrize(("body", "status", "param"), BAD, ids=[p + json.dumps(b)[:32] for b, _, p in BAD])
async def test_each_unserved_field_gets_its_status_naming_it_and_serving_goes_on(
    s: Scripted, http: httpx2.AsyncClient, body: dict[str, Any], status: int, param: str
) -> None:
    response = await http.post("/v1/responses", json=respond(**body), timeout=CALL_TIMEOUT_S)
    error = error_of(response, status)
    assert_names(error, param)
    assert "max_completion_tokens" not in error["message"]  # the chat body's name, never this one's
    assert s.core.specs == [] and s.frontend.clients == {}
    done = await played(s, s.client.responses.create(**respond()), [*tokens("ok"), EOS])
    assert done.output_text == "ok"


async def test_a_stored_response_is_not_found_and_store_is_answered_false(
    s: Scripted, http: httpx2.AsyncClient
) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        await s.client.responses.retrieve("resp_abc")
    assert missing.value.body["param"] == "response_id"  # type: ignore[index]
    assert (await http.delete("/v1/responses/resp_abc")).status_code == 404
    done = await played(
        s, s.client.responses.create(**respond(store=True, metadata={"k": "v"})), [*tokens("ok"), EOS]
    )
    assert done.store is False and done.metadata == {"k": "v"}


# ---- live ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    template: Path = tmp_path_factory.mktemp("chat") / "template.jinja"
    template.write_text(LIVE_TEMPLATE)
    flags = ["--http-port", str(unused_port()), "--chat-template", str(template)]
    with serving_pair(TINY, flags) as (_, scheduler):
        yield scheduler


async def test_live_a_response_is_the_chat_endpoint_s_greedy_answer(tiny: Service) -> None:
    """A worker and a scheduler serving the tiny model: the greedy answer, whole and streamed, is
    what the chat endpoint answers to the same instructions and message."""
    async with openai.AsyncOpenAI(
        base_url=f"{tiny.http_url}/v1", api_key="unused", max_retries=0, timeout=CALL_TIMEOUT_S
    ) as client:
        settings: dict[str, Any] = {"model": "tiny", "temperature": 0, "extra_body": {"ignore_eos": True}}
        messages = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Once upon a time"},
        ]
        expected = await client.chat.completions.create(messages=messages, max_tokens=12, **settings)  # type: ignore[arg-type]
        done = await client.responses.create(
            instructions="Be brief.", input="Once upon a time", max_output_tokens=12, **settings
        )
        assert done.output_text == expected.choices[0].message.content and done.status == "incomplete"
        assert done.usage is not None and expected.usage is not None
        assert (done.usage.input_tokens, done.usage.output_tokens) == (expected.usage.prompt_tokens, 12)
        events = await client.responses.create(
            instructions="Be brief.", input="Once upon a time", max_output_tokens=12, stream=True, **settings
        )
        seen = [event async for event in events]
        deltas = [e.delta for e in seen if e.type == "response.output_text.delta"]
        final = seen[-1].response
        assert seen[-1].type == "response.incomplete" and final.usage == done.usage
        assert "".join(deltas) == final.output_text == done.output_text
