"""Chat over gRPC: the `messages` input, rendered by the chat template in the frontend."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from scheduler_svc.frontend.chat import ChatMessage, ChatTemplate
from scheduler_svc.frontend.validation import MAX_CHAT_MESSAGES
from stepahead.processes import Service, serving_pair
from stepahead.v1 import generation_pb2 as pb
from stepahead.v1 import generation_pb2_grpc
from tests.live import CALL_TIMEOUT_S, FRONTEND_COUNTS, frontend_flags, server_info, wait_all_free
from worker_svc.backends import sim_continuation

pytestmark = pytest.mark.anyio
SIM = ["--model", "sim", "--sim-step-ms", "1", "--kv-slots", "8192"]
MAX_TEXT_BYTES = 4096
TEMPLATE = (
    "{% if messages[-1]['role'] == 'assistant' %}{{ raise_exception('the last turn must not be the "
    "assistant') }}{% endif %}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def template_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("chat") / "template.jinja"
    path.write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module", params=FRONTEND_COUNTS, ids=lambda n: f"frontends={n}")
def chat_pair(request: pytest.FixtureRequest, template_file: Path) -> Iterator[Service]:
    flags = ["--chat-template", str(template_file), "--max-text-bytes", str(MAX_TEXT_BYTES)]
    with serving_pair(SIM, [*flags, *frontend_flags(request.param)]) as (_, scheduler):
        yield scheduler


@pytest.fixture(scope="module")
def plain_pair() -> Iterator[Service]:
    with serving_pair(SIM, frontend_flags(0)) as (_, scheduler):
        yield scheduler


def chat(turns: list[tuple[str, str]], max_new_tokens: int = 8) -> pb.GenerateRequest:
    messages = [pb.ChatMessage(role=role, content=content) for role, content in turns]
    return pb.GenerateRequest(
        messages=pb.ChatMessages(messages=messages),
        sampling=pb.SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True),
    )


async def generate(address: str, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        return [r async for r in stub.Generate(request, timeout=CALL_TIMEOUT_S)]


async def status_of(address: str, request: pb.GenerateRequest) -> tuple[grpc.StatusCode, str]:
    try:
        await generate(address, request)
    except grpc.aio.AioRpcError as exc:
        return exc.code(), str(exc.details())
    return grpc.StatusCode.OK, ""


def rendered(turns: list[tuple[str, str]]) -> str:
    return ChatTemplate(TEMPLATE, {}).render([ChatMessage(role, content) for role, content in turns])


CONVERSATION = [("system", "Be brief."), ("user", "Hi 👋"), ("assistant", "Hello!"), ("user", "And you?")]


async def test_a_conversation_is_served_as_its_rendered_prompt(chat_pair: Service) -> None:
    stream = await generate(chat_pair.address, chat(CONVERSATION, 12))
    prompt = rendered(CONVERSATION).encode()
    assert [t for r in stream for t in r.token_ids] == sim_continuation(prompt, 12)
    assert stream[-1].prompt_tokens == len(prompt)  # byte tokens, no BOS added to a template's text
    assert (await server_info(chat_pair.address)).chat_template


@pytest.mark.parametrize(
    ("turns", "field"),
    [
        ([], "input.messages.messages"),
        ([("user", "hi"), ("wizard", "abracadabra")], "input.messages.messages[1].role"),
        ([("", "no role")], "input.messages.messages[0].role"),
        ([("user", "x")] * (MAX_CHAT_MESSAGES + 1), "input.messages.messages"),
        ([("user", "a" * MAX_TEXT_BYTES), ("user", "b")], "input.messages.messages"),
        ([("user", "hi"), ("assistant", "the template refuses to end here")], "input.messages"),
    ],
    ids=["empty", "bad role", "no role", "too many", "too long", "template refuses"],
)
async def test_bad_messages_are_invalid_argument_naming_the_field(
    chat_pair: Service, turns: list[tuple[str, str]], field: str
) -> None:
    code, details = await status_of(chat_pair.address, chat(turns))
    assert code == INVALID and details.startswith(f"{field}:"), details
    stream = await generate(chat_pair.address, chat([("user", "still serving")], 3))
    assert stream[-1].completion_tokens == 3
    await wait_all_free(chat_pair.address)


async def test_the_template_message_reaches_the_client(chat_pair: Service) -> None:
    _, details = await status_of(chat_pair.address, chat([("user", "a"), ("assistant", "b")]))
    assert "the last turn must not be the assistant" in details


async def test_a_model_without_a_chat_template_answers_failed_precondition(plain_pair: Service) -> None:
    code, details = await status_of(plain_pair.address, chat([("user", "hi")]))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and details.startswith("input.messages:"), details
    assert "--chat-template FILE" in details  # what to do about it
    assert not (await server_info(plain_pair.address)).chat_template


def run_client(address: str, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "stepahead_client", "--server", address, *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=CALL_TIMEOUT_S)


def test_the_cli_client_chats(chat_pair: Service) -> None:
    out = run_client(chat_pair.address, "--chat", "--system", "Be brief.", "Hi", "--max-new-tokens", "6")
    prompt = rendered([("system", "Be brief."), ("user", "Hi")]).encode()
    assert out.returncode == 0, out.stderr
    expected = bytes(t for t in sim_continuation(prompt, 6) if t < 256).decode(errors="replace")
    assert out.stdout.strip() == expected.strip()
    assert f"{len(prompt)} prompt + " in out.stderr


def test_the_cli_client_names_the_stop_string_that_ended_the_text(chat_pair: Service) -> None:
    free = run_client(chat_pair.address, "--chat", "Hi", "--max-new-tokens", "64")
    text = free.stdout.strip()
    # A character of the text, not at its start, first seen there (the sim's bytes: not all text).
    stop = next(c for i, c in enumerate(text) if i and text.find(c) == i and c.isalnum() and c.isascii())
    out = run_client(chat_pair.address, "--chat", "Hi", "--max-new-tokens", "64", "--stop", stop)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == text[: text.index(stop)].strip()
    assert f"[FINISH_REASON_STOP at {json.dumps(stop, ensure_ascii=False)};" in out.stderr, out.stderr


def test_the_cli_client_reports_a_model_without_a_template(plain_pair: Service) -> None:
    out = run_client(plain_pair.address, "--chat", "Hi")
    assert out.returncode == 1 and "FAILED_PRECONDITION" in out.stderr
