"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) through the official
`anthropic` client: over a frontend whose core is scripted (tests/test_openai_sampling.py), what
reaches the core (the same prompt, tool grammar and output constraint as the chat endpoint's for
the same conversation) and what the client gets back (content blocks, stop reasons, usage, the
stream's events reassembling into the whole message, tool calls and a conversation carrying their
results), the key in `x-api-key`, and each field it does not serve refused with Anthropic's error
body naming it while the frontend serves on; then live, a worker and a scheduler serving the
tiny model, whose greedy answer is the chat endpoint's."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx2
import jsonschema
import openai
import pytest

from scheduler_svc.contract import FinishReason
from scheduler_svc.frontend.api_config import ClientApiConfig
from scheduler_svc.frontend.openai.routes import build_app
from stepahead.processes import Service
from stepahead.protocol import TokenizerSpec
from tests.live import CALL_TIMEOUT_S
from tests.test_openai_sampling import (  # noqa: F401 (`scripted`: a fixture)
    EOS,
    LIVE_TEMPLATE,
    SCRIPTED_INFO,
    TINY,
    Scripted,
    scripted,
    steps_of,
)
from tests.test_responses_api import (  # noqa: F401 (`tiny`: a fixture)
    QUESTION,
    called_history,
    chat,
    played,
    tiny,
)
from tests.test_tools_api import PARIS, SCHEMAS, SUM_CALL, TOOLS, calls_text, served_call, tokens

pytestmark = pytest.mark.anyio

# The tools as the Messages API defines them: name, description, input_schema.
ANTHROPIC_TOOLS: list[dict[str, Any]] = [
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS
]


@pytest.fixture
async def s(scripted: Scripted) -> AsyncIterator[tuple[Scripted, anthropic.AsyncAnthropic]]:  # noqa: F811
    """The scripted frontend (with room for the tools' system turn) and an Anthropic client of it."""
    scripted.frontend.worker_state(dataclasses.replace(SCRIPTED_INFO, max_context_len=4096), True)
    transport = httpx2.ASGITransport(app=build_app(scripted.frontend))
    async with (
        httpx2.AsyncClient(transport=transport, base_url="http://scripted") as http,
        anthropic.AsyncAnthropic(
            base_url="http://scripted", api_key="-", max_retries=0, http_client=http
        ) as client,
    ):
        yield scripted, client


Ctx = tuple[Scripted, anthropic.AsyncAnthropic]


def ask(**more: Any) -> dict[str, Any]:
    return {
        "model": "scripted",
        "max_tokens": 200,
        "messages": [{"role": "user", "content": QUESTION}],
        **more,
    }


async def streamed(
    ctx: Ctx, reply: list[int], finish: FinishReason = FinishReason.STOP, **body: Any
) -> tuple[list[Any], Any]:
    """The raw events of a streamed message for `reply`, and the client's final message."""
    s, client = ctx

    async def read() -> tuple[list[Any], Any]:
        async with client.messages.stream(**body) as stream:
            events = [event async for event in stream if not event.type.islower() or "_" in event.type]
            return events, await stream.get_final_message()

    done: tuple[list[Any], Any] = await played(s, read(), reply, finish)
    return done


def text_of(message: Any) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


# ---- text ---------------------------------------------------------------------------------------------


async def test_a_text_answer_is_a_text_block_with_usage_and_the_chat_prompt(s: Ctx) -> None:
    sc, client = s
    done = await played(sc, client.messages.create(**ask(system="Be brief.")), [*tokens("Sunny."), EOS])
    assert done.type == "message" and done.role == "assistant" and done.id.startswith("msg_")
    assert [b.type for b in done.content] == ["text"] and text_of(done) == "Sunny."
    assert (done.stop_reason, done.stop_sequence, done.model) == ("end_turn", None, "scripted")
    prompt = sc.core.specs[-1].prompt_ids
    assert bytes(prompt).decode() == "Be brief." + QUESTION  # the system prompt is the system turn
    assert (done.usage.input_tokens, done.usage.output_tokens) == (len(prompt), len("Sunny.") + 1)
    assert done.usage.cache_read_input_tokens == 0
    # The chat endpoint, asked the same, sends the core the same prompt and settings.
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    await served_call(sc, sc.client.chat.completions.create(**chat(messages=messages)), "x")
    assert sc.core.specs[-1].prompt_ids == prompt
    ours, chats = (dataclasses.replace(spec.params, seed=0) for spec in sc.core.specs[-2:])
    assert ours == chats  # but for the seed each request is given


@pytest.mark.parametrize(
    ("reply", "finish", "stop_reason", "stop_sequence", "text"),
    [
        ("Clear", FinishReason.LENGTH, "max_tokens", None, "Clear"),
        ("Sunny", FinishReason.STOP, "stop_sequence", "ny", "Sun"),  # the frontend ends it at "ny"
        ("Rain", FinishReason.STOP, "end_turn", None, "Rain"),  # its last token EOS
    ],
)
async def test_stop_reasons_say_why_it_ended(
    s: Ctx, reply: str, finish: FinishReason, stop_reason: str, stop_sequence: str | None, text: str
) -> None:
    sc, client = s
    body = ask(max_tokens=5, stop_sequences=["ny"])
    ids = tokens(reply) + ([EOS] if stop_reason == "end_turn" else [])
    done = await played(sc, client.messages.create(**body), ids, finish)
    assert sc.core.specs[-1].params.max_new_tokens == 5
    assert sc.core.specs[-1].params.stop == ("ny",)
    assert (done.stop_reason, done.stop_sequence, text_of(done)) == (stop_reason, stop_sequence, text)


async def test_max_tokens_is_a_cap_at_the_context_s_room(s: Ctx) -> None:
    """As Anthropic's: a `max_tokens` past what the context leaves is served with the room there
    is (a 400 on the chat route), and an answer ended by the full context says so."""
    sc, client = s
    body = ask(max_tokens=8192)  # twice the scripted context, as agents ask of a small model
    done = await played(sc, client.messages.create(**body), tokens("Long"), FinishReason.LENGTH)
    prompt = len(sc.core.specs[-1].prompt_ids)
    assert sc.core.specs[-1].params.max_new_tokens == 4096 - prompt  # the scripted context
    assert done.stop_reason == "model_context_window_exceeded" and text_of(done) == "Long"
    events, final = await streamed(s, tokens("Long"), FinishReason.LENGTH, **body)
    assert final.stop_reason == "model_context_window_exceeded"
    assert [e.delta.stop_reason for e in events if e.type == "message_delta"] == [final.stop_reason]


async def test_the_stream_s_events_reassemble_into_the_whole_message(s: Ctx) -> None:
    """Anthropic's sequence: message_start (usage with the input), a text block started, a
    delta per piece of text, the block stopped, message_delta with the stop reason and usage,
    message_stop."""
    sc, client = s
    reply = [*tokens("It is sunny"), 0xC3, 0xA9, *tokens("."), EOS]  # "é" in two tokens
    whole = await played(sc, client.messages.create(**ask()), reply)
    events, final = await streamed(s, reply, **ask())
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start"
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == "It is sunnyé."
    assert final.model_dump(exclude={"id"}) == whole.model_dump(exclude={"id"})


async def test_a_last_assistant_turn_is_continued(s: Ctx) -> None:
    """Anthropic's prefill: the answer continues the last assistant turn, as chat's
    continue_final_message does."""
    sc, client = s
    marked = TokenizerSpec("byte", chat_template=LIVE_TEMPLATE)  # each turn closed by "|"
    sc.frontend.worker_state(dataclasses.replace(SCRIPTED_INFO, max_context_len=4096, tokenizer=marked), True)
    turns = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "It is"}]
    done = await played(sc, client.messages.create(**ask(messages=turns)), [*tokens(" sunny."), EOS])
    assert text_of(done) == " sunny."
    assert bytes(sc.core.specs[-1].prompt_ids).decode() == f"[user] {QUESTION}|[assistant] It is"
    body = chat(messages=turns, extra_body={"add_generation_prompt": False, "continue_final_message": True})
    await served_call(sc, sc.client.chat.completions.create(**body), "x")
    assert sc.core.specs[-1].prompt_ids == sc.core.specs[-2].prompt_ids


async def test_a_system_turn_among_the_messages_is_chat_s_system_message(s: Ctx) -> None:
    sc, client = s
    turns = [
        {"role": "user", "content": "Hi."},
        {"role": "assistant", "content": "Hello."},
        {"role": "system", "content": [{"type": "text", "text": "Answer in French."}]},
        {"role": "user", "content": QUESTION},
    ]
    await played(sc, client.messages.create(**ask(messages=turns)), [*tokens("Beau."), EOS])
    chat_turns = [*turns[:2], {"role": "system", "content": "Answer in French."}, turns[3]]
    await served_call(sc, sc.client.chat.completions.create(**chat(messages=chat_turns)), "x")
    assert sc.core.specs[-1].prompt_ids == sc.core.specs[-2].prompt_ids
    assert bytes(sc.core.specs[-1].prompt_ids).decode() == "Hi.Hello.Answer in French." + QUESTION


async def test_count_tokens_is_the_prompt_s(s: Ctx) -> None:
    sc, client = s
    counted = await client.messages.count_tokens(
        model="scripted", system="Be brief.", messages=[{"role": "user", "content": QUESTION}]
    )
    done = await played(sc, client.messages.create(**ask(system="Be brief.")), [*tokens("ok"), EOS])
    assert counted.input_tokens == done.usage.input_tokens == len("Be brief." + QUESTION)


# ---- tools -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("choice", "chat_choice"),
    [
        ({"type": "any"}, "required"),
        ({"type": "tool", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}),
    ],
    ids=["any", "named"],
)
async def test_a_call_is_a_tool_use_block_under_the_chat_grammar(
    s: Ctx, choice: Any, chat_choice: Any
) -> None:
    sc, client = s
    create = client.messages.create(**ask(tools=ANTHROPIC_TOOLS, tool_choice=choice))
    done = await played(sc, create, tokens(calls_text(PARIS)))
    await served_call(sc, sc.client.chat.completions.create(**chat(tools=TOOLS, tool_choice=chat_choice)), "")
    assert sc.core.specs[-2].params.constraint == sc.core.specs[-1].params.constraint is not None
    assert sc.core.specs[-2].prompt_ids == sc.core.specs[-1].prompt_ids
    (call,) = done.content
    assert call.type == "tool_use" and call.name == PARIS.name and call.input == json.loads(PARIS.arguments)
    assert done.stop_reason == "tool_use"


@pytest.mark.parametrize("content", ["", "Checking. "])
async def test_text_then_parallel_calls_stream_as_blocks_in_order(s: Ctx, content: str) -> None:
    sc, client = s
    reply = tokens(content + calls_text(PARIS, SUM_CALL))
    whole = await played(sc, client.messages.create(**ask(tools=ANTHROPIC_TOOLS)), reply)
    events, final = await streamed(s, reply, **ask(tools=ANTHROPIC_TOOLS))
    for message in (whole, final):
        assert [b.type for b in message.content] == ["text"] * bool(content) + ["tool_use", "tool_use"]
        calls = [b for b in message.content if b.type == "tool_use"]
        assert [(c.name, c.input) for c in calls] == [
            (PARIS.name, json.loads(PARIS.arguments)),
            (SUM_CALL.name, json.loads(SUM_CALL.arguments)),
        ]
        assert text_of(message) == content and calls[0].id != calls[1].id
        for call in calls:
            jsonschema.validate(call.input, SCHEMAS[call.name])
    started = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert started == [b.type for b in final.content]
    pieces: dict[int, str] = {}
    for event in events:
        if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
            pieces[event.index] = pieces.get(event.index, "") + event.delta.partial_json
    assert list(pieces.values()) == [PARIS.arguments, SUM_CALL.arguments]


async def test_a_conversation_with_a_call_and_its_result_is_chat_s_prompt(s: Ctx) -> None:
    """The client sends back the tool_use block it got and a tool_result; the core gets the
    prompt the chat endpoint makes of the same turns."""
    sc, client = s
    first = await played(
        sc,
        client.messages.create(**ask(tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"})),
        tokens(calls_text(PARIS)),
    )
    call = first.content[0]
    turns = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": "18 C"}]}
            ],
        },
    ]
    done = await played(
        sc,
        client.messages.create(**ask(messages=turns, tools=ANTHROPIC_TOOLS)),
        [*tokens("18 C."), EOS],
    )
    assert text_of(done) == "18 C."
    history = called_history(call.id, call.name, PARIS.arguments, "18 C")
    await served_call(sc, sc.client.chat.completions.create(**chat(messages=history, tools=TOOLS)), "x")
    assert sc.core.specs[-2].prompt_ids == sc.core.specs[-1].prompt_ids


async def test_output_config_s_format_is_chat_s_json_schema(s: Ctx) -> None:
    sc, client = s
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    body = ask(extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}})
    done = await played(sc, client.messages.create(**body), [*tokens('{"city": "Paris"}'), EOS])
    assert json.loads(text_of(done)) == {"city": "Paris"}
    fmt = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    await served_call(sc, sc.client.chat.completions.create(**chat(response_format=fmt)), "{}")
    assert sc.core.specs[-1].params.constraint == sc.core.specs[-2].params.constraint is not None


# ---- refusals, hints and the key -----------------------------------------------------------------------

IMAGE = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
BAD: list[tuple[dict[str, Any], int, str]] = [
    ({"messages": [{"role": "user", "content": [IMAGE]}]}, 400, "messages[0].content[0].type"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "system", "content": [IMAGE]}]}, 400, "messages[0].content[0].type"),
    (
        {
            "messages": [
                {"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}
            ]
        },
        400,
        "messages[0].content[0].type",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
        400,
        "messages[0].content[0].tool_use_id",
    ),
    ({"system": [{"type": "image"}]}, 400, "system[0].type"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "tools[0].type"),
    ({"tools": [{"name": "f"}]}, 400, "tools[0].input_schema"),
    (
        {"tools": [{"name": "f", "input_schema": {"type": "object", "properties": 1}}]},
        400,
        "tools[0].input_schema",
    ),
    ({"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, 400, "tool_choice.name"),
    ({"tool_choice": {"type": "sometimes"}}, 400, "tool_choice.type"),
    ({"thinking": {"type": "always"}}, 400, "thinking.type"),
    ({"output_config": {"effort": "high"}}, 400, "output_config.effort"),
    (
        {"output_config": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}},
        400,
        "output_config.format.schema",
    ),
    ({"mcp_servers": [{"type": "url", "url": "x", "name": "m"}]}, 400, "mcp_servers"),
    ({"container": "c"}, 400, "container"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"max_tokens": "5"}, 400, "max_tokens"),
    ({"temperature": 1.5}, 400, "temperature"),
    ({"stop_sequences": "x"}, 400, "stop_sequences"),
    ({"model": "claude-sonnet"}, 404, "model"),
]


@pytest.fixture
async def http(s: Ctx) -> AsyncIterator[httpx2.AsyncClient]:
    transport = httpx2.ASGITransport(app=build_app(s[0].frontend))
    async with httpx2.AsyncClient(transport=transport, base_url="http://scripted") as client:
        yield client


def anthropic_error(response: httpx2.Response, status: int) -> str:
    """The message of Anthropic's error body in `response`, checked for its shape."""
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    expected = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}[status]
    assert body["error"]["type"] == expected
    message: str = body["error"]["message"]
    return message


@pytest.mark.parametrize(("body", "status", "param"), BAD, ids=[p + json.dumps(b)[:32] for b, _, p in BAD])
async def test_each_unserved_field_gets_anthropic_s_error_naming_it_and_serving_goes_on(
    s: Ctx, http: httpx2.AsyncClient, body: dict[str, Any], status: int, param: str
) -> None:
    sc, client = s
    response = await http.post("/v1/messages", json=ask(**body), timeout=CALL_TIMEOUT_S)
    message = anthropic_error(response, status)
    assert message.startswith(f"{param}:") or (status == 404 and param in message), message
    assert "max_completion_tokens" not in message and "response_format" not in message  # chat's names
    assert sc.core.specs == [] and sc.frontend.clients == {}
    done = await played(sc, client.messages.create(**ask()), [*tokens("ok"), EOS])
    assert text_of(done) == "ok"


async def test_hints_that_change_no_output_are_accepted(s: Ctx) -> None:
    sc, client = s
    cached = {"type": "ephemeral"}
    body = ask(
        system=[{"type": "text", "text": "Be brief.", "cache_control": cached}],
        messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION, "cache_control": cached}]}],
        metadata={"user_id": "u-1"},
        service_tier="standard_only",
        thinking={"type": "adaptive"},
        cache_control=cached,
        speed="standard",
    )
    done = await played(sc, client.messages.create(**body), [*tokens("ok"), EOS])
    assert text_of(done) == "ok"
    assert bytes(sc.core.specs[-1].prompt_ids).decode() == "Be brief." + QUESTION


async def test_the_key_may_come_as_x_api_key(scripted: Scripted) -> None:  # noqa: F811
    transport = httpx2.ASGITransport(app=build_app(scripted.frontend, ClientApiConfig(api_key="sesame")))
    async with httpx2.AsyncClient(transport=transport, base_url="http://scripted") as http:
        refused = await http.post("/v1/messages", json=ask(), headers={"x-api-key": "wrong"})
        assert "x-api-key" in anthropic_error(refused, 401)
        models = await http.get("/v1/models", headers={"x-api-key": "sesame"})  # any route takes it
        assert models.status_code == 200
        async with anthropic.AsyncAnthropic(
            base_url="http://scripted", api_key="sesame", max_retries=0, http_client=http
        ) as client:
            done = await played(scripted, client.messages.create(**ask()), [*tokens("ok"), EOS])
            assert text_of(done) == "ok"


# ---- live ---------------------------------------------------------------------------------------------


async def test_live_a_message_is_the_chat_endpoint_s_greedy_answer(tiny: Service) -> None:  # noqa: F811
    """A worker and a scheduler serving the tiny model: the greedy answer, whole and streamed, is
    what the chat endpoint answers to the same system prompt and message."""
    settings: dict[str, Any] = {"model": "tiny", "extra_body": {"ignore_eos": True, "temperature": 0}}
    async with (
        openai.AsyncOpenAI(
            base_url=f"{tiny.http_url}/v1", api_key="-", max_retries=0, timeout=CALL_TIMEOUT_S
        ) as oai,
        anthropic.AsyncAnthropic(
            base_url=tiny.http_url, api_key="-", max_retries=0, timeout=CALL_TIMEOUT_S
        ) as client,
    ):
        messages = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Once upon a time"},
        ]
        expected = await oai.chat.completions.create(messages=messages, max_tokens=12, **settings)  # type: ignore[arg-type]
        turns: Any = [{"role": "user", "content": "Once upon a time"}]
        done = await client.messages.create(system="Be brief.", messages=turns, max_tokens=12, **settings)
        assert text_of(done) == expected.choices[0].message.content and done.stop_reason == "max_tokens"
        assert expected.usage is not None
        assert (
            done.usage.input_tokens + (done.usage.cache_read_input_tokens or 0)
            == expected.usage.prompt_tokens
        )
        assert done.usage.output_tokens == 12
        async with client.messages.stream(
            system="Be brief.", messages=turns, max_tokens=12, **settings
        ) as stream:
            final = await stream.get_final_message()
        assert text_of(final) == text_of(done) and final.stop_reason == "max_tokens"
