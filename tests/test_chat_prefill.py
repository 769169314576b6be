"""An assistant turn prefilled by the client (vLLM's `add_generation_prompt: false` with
`continue_final_message: true`): over a frontend whose core is scripted (tests/test_openai_sampling.py)
and whose template marks each turn's end, the core gets the conversation ending with the last
message's content, its turn left open, on the chat route, /tokenize and the gRPC API alike; the
reply is only its continuation; both fields at their defaults change nothing, and a continued
message with the generation prompt still asked for is a 400 naming the field. The rendering
itself is checked against transformers in tests/test_chat_template.py."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import httpx2
import pytest

from scheduler_svc.frontend.frontend import ApiError
from scheduler_svc.frontend.openai.routes import build_app
from stepahead.protocol import TokenizerSpec
from stepahead.v1 import generation_pb2 as pb
from tests.live import CALL_TIMEOUT_S
from tests.test_openai_api import assert_names, error_of
from tests.test_openai_sampling import SCRIPTED_INFO, Scripted, scripted  # noqa: F401 (a fixture)
from tests.test_tools_api import served_call

pytestmark = pytest.mark.anyio

TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}</turn>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
QUESTION = {"role": "user", "content": "Name a city as JSON."}
PREFILL = {"role": "assistant", "content": '{"city": "'}
CONTINUED = f"<user>{QUESTION['content']}</turn><assistant>{PREFILL['content']}"


@pytest.fixture
def s(scripted: Scripted) -> Scripted:  # noqa: F811 (the imported fixture)
    tokenizer = TokenizerSpec("byte", chat_template=TEMPLATE)
    scripted.frontend.worker_state(dataclasses.replace(SCRIPTED_INFO, tokenizer=tokenizer), True)
    return scripted


@pytest.fixture
async def http(s: Scripted) -> AsyncIterator[httpx2.AsyncClient]:
    transport = httpx2.ASGITransport(app=build_app(s.frontend))
    async with httpx2.AsyncClient(transport=transport, base_url="http://scripted") as client:
        yield client


def chat(messages: list[dict[str, str]], **more: Any) -> dict[str, Any]:
    """A body; `more` are vLLM's fields (the `openai` client sends them as `extra_body`)."""
    return {"model": "scripted", "messages": messages, "max_tokens": 50, **more}


def create(s: Scripted, messages: list[dict[str, str]], **more: Any) -> Any:
    return s.client.chat.completions.create(**chat(messages), extra_body=more)


def prompt(s: Scripted) -> str:
    return bytes(s.core.specs[-1].prompt_ids).decode()


async def test_a_prefilled_assistant_turn_is_continued(s: Scripted) -> None:
    more = {"add_generation_prompt": False, "continue_final_message": True}
    done = await served_call(s, create(s, [QUESTION, PREFILL], **more), 'Kyoto"}')
    assert prompt(s) == CONTINUED
    assert done.choices[0].message.content == 'Kyoto"}'  # the continuation alone, as vLLM answers


@pytest.mark.parametrize(
    ("more", "expected"),
    [
        ({}, f"<user>{QUESTION['content']}</turn><assistant>"),
        ({"add_generation_prompt": False}, f"<user>{QUESTION['content']}</turn>"),
    ],
    ids=["defaults", "no-generation-prompt"],
)
async def test_the_generation_prompt_is_asked_for_or_not(
    s: Scripted, more: dict[str, Any], expected: str
) -> None:
    await served_call(s, create(s, [QUESTION], **more), "x")
    assert prompt(s) == expected


async def test_tokenize_renders_the_prefill_as_the_chat_route_does(
    s: Scripted, http: httpx2.AsyncClient
) -> None:
    body = {"messages": [QUESTION, PREFILL], "add_generation_prompt": False, "continue_final_message": True}
    response = await http.post("/tokenize", json=body, timeout=CALL_TIMEOUT_S)
    assert response.status_code == 200, response.text
    assert bytes(response.json()["tokens"]) == CONTINUED.encode()


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/tokenize"])
async def test_a_continued_message_with_the_generation_prompt_is_a_400(
    s: Scripted, http: httpx2.AsyncClient, route: str
) -> None:
    body = chat([QUESTION, PREFILL], continue_final_message=True)  # add_generation_prompt: true, the default
    response = await http.post(route, json=body, timeout=CALL_TIMEOUT_S)
    assert_names(error_of(response, 400), "continue_final_message")
    assert s.core.specs == []
    await served_call(s, create(s, [QUESTION]), "still serving")


async def test_grpc_takes_the_same_two_fields(s: Scripted) -> None:
    messages = [pb.ChatMessage(role=m["role"], content=m["content"]) for m in (QUESTION, PREFILL)]
    chat_input = pb.ChatMessages(messages=messages, add_generation_prompt=False, continue_final_message=True)
    sampling = pb.SamplingParams(max_new_tokens=4)
    await s.frontend.admit(pb.GenerateRequest(messages=chat_input, sampling=sampling))
    assert prompt(s) == CONTINUED
    chat_input.ClearField("add_generation_prompt")  # unset: true, so nothing is left to continue
    with pytest.raises(ApiError) as refused:
        await s.frontend.admit(pb.GenerateRequest(messages=chat_input, sampling=sampling))
    assert refused.value.field == "input.messages.continue_final_message"
