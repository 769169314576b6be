"""SmolLM2-135M-Instruct through the running services, in both loops, against transformers.

One worker process serves both loops: the overlap scheduler, then the serial one. Requests go
one at a time, so every step is the batch-1 computation the reference makes too.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import grpc
import openai
import pytest

from stepahead.processes import Service, spawn_scheduler, spawn_worker, wait_serving
from stepahead.v1 import generation_pb2 as pb
from stepahead.v1 import generation_pb2_grpc
from tests.live import CALL_TIMEOUT_S, server_info, unused_port
from tests.smollm2 import Transformers

NEW_TOKENS = 32
EOS = 2
CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": "Nice to meet you, Ada!"},
        {"role": "user", "content": "What is my name?"},
    ],
    [{"role": "user", "content": "Traduis en français : « the cat sleeps » 🐈"}],
]


@pytest.fixture(scope="module")
def worker() -> Iterator[Service]:
    service = spawn_worker(["--model", "smollm2", "--kv-slots", "2048", "--request-slots", "8"])
    try:
        wait_serving(service.address)
        yield service
    finally:
        service.stop()


@pytest.fixture(scope="module", params=["overlap", "serial"])
def scheduler(request: pytest.FixtureRequest, worker: Service) -> Iterator[Service]:
    # A step of the model on a slow CPU takes up to a second or so: the watchdog's limit is a hang
    # guard's, so that no step is taken for a hung worker (and recomputed) there.
    flags = ["--mode", request.param, "--http-port", str(unused_port())]
    service = spawn_scheduler(worker.address, [*flags, "--worker-step-timeout", str(CALL_TIMEOUT_S)])
    try:
        wait_serving(service.address)
        yield service
    finally:
        service.stop()


def reference_tokens(reference: Transformers, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """The prompt transformers renders and its greedy continuation (past EOS)."""
    import torch

    prompt: list[int] = reference.tokenizer.apply_chat_template(messages, add_generation_prompt=True)[
        "input_ids"
    ]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = reference.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False
        )
    return prompt, out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def references(smollm2_transformers: Transformers) -> list[tuple[list[int], list[int]]]:
    return [reference_tokens(smollm2_transformers, m) for m in CONVERSATIONS]


def chat_request(messages: list[dict[str, str]]) -> pb.GenerateRequest:
    turns = [pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages]
    sampling = pb.SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return pb.GenerateRequest(messages=pb.ChatMessages(messages=turns), sampling=sampling)


async def generate(address: str, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        return [r async for r in stub.Generate(request, timeout=CALL_TIMEOUT_S)]


def api(scheduler: Service) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=scheduler.http_url + "/v1", api_key="unused", max_retries=0, timeout=CALL_TIMEOUT_S
    )


def test_chat_over_grpc_gives_transformers_greedy_tokens(
    scheduler: Service, references: list[tuple[list[int], list[int]]]
) -> None:
    for messages, (prompt, expected) in zip(CONVERSATIONS, references, strict=True):
        stream = asyncio.run(generate(scheduler.address, chat_request(messages)))
        assert [t for r in stream for t in r.token_ids] == expected, messages
        assert stream[-1].prompt_tokens == len(prompt)


def test_chat_over_http_gives_transformers_greedy_text(
    scheduler: Service, references: list[tuple[list[int], list[int]]], smollm2_transformers: Transformers
) -> None:
    client = api(scheduler)
    for messages, (prompt, expected) in list(zip(CONVERSATIONS, references, strict=True))[:2]:
        reply = client.chat.completions.create(
            model="smollm2",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=NEW_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        text = smollm2_transformers.tokenizer.decode(expected, skip_special_tokens=True)
        assert reply.choices[0].message.content == text
        assert reply.usage is not None and reply.usage.prompt_tokens == len(prompt)


def test_skip_special_tokens_false_spells_them_as_transformers_does(
    scheduler: Service, references: list[tuple[list[int], list[int]]], smollm2_transformers: Transformers
) -> None:
    """Past EOS (ignore_eos), the greedy reply holds special tokens (an end of turn, a new one):
    left out by default, spelled with skip_special_tokens false, each as transformers decodes."""
    (messages, (_, expected)) = next(iter(zip(CONVERSATIONS, references, strict=True)))
    tokenizer = smollm2_transformers.tokenizer
    assert tokenizer.decode(expected, skip_special_tokens=False) != tokenizer.decode(
        expected, skip_special_tokens=True
    )
    for skip in (False, True):
        reply = api(scheduler).chat.completions.create(
            model="smollm2",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=NEW_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True, "skip_special_tokens": skip},
        )
        assert reply.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=skip), skip


def test_the_capital_of_france_is_paris_and_the_answer_ends_at_eos(scheduler: Service) -> None:
    client = api(scheduler)
    chunks: list[Any] = list(
        client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0,
            stream=True,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text and "<|im_end|>" not in text, text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_the_cli_client_chats_with_smollm2(scheduler: Service) -> None:
    argv = [sys.executable, "-m", "stepahead_client", "--server", scheduler.address]
    out = subprocess.run(
        [*argv, "--chat", "What is the capital of France?"],
        capture_output=True,
        text=True,
        timeout=CALL_TIMEOUT_S,
    )
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout and "FINISH_REASON_STOP" in out.stderr


def test_server_info_names_the_model_and_its_template(scheduler: Service) -> None:
    info = asyncio.run(server_info(scheduler.address))
    assert (info.model, info.tokenizer, info.vocab_size, list(info.eos_token_ids)) == (
        "smollm2",
        "hf",
        49152,
        [EOS],
    )
    assert info.chat_template
