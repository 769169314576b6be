"""Tool calling through the running services: chat requests with tools over the gRPC API, served
by `tiny` (float64) with a chat template that reads tools and writes its calls as Hermes and Qwen
do. The serial loop with the frontend in the core's process, and the overlap loop with 0 and 2
frontend processes, give every completion the same tokens, content, calls and finish reason;
every call names a tool its request allows, and its arguments validate against that tool's
schema; a named tool without parallel calls ends its reply after one call (`tool_calls`)."""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import pytest

from stepahead.processes import serving_pair
from stepahead.v1 import generation_pb2 as pb
from stepahead.v1 import generation_pb2_grpc
from tests.live import CALL_TIMEOUT_S, channels_by_frontend, frontend_flags, wait_all_free
from tests.test_structured import TOOL_SCHEMAS, TOOLS

# A Qwen-like template: the tools in its system turn, calls as <tool_call>\n{...}\n</tool_call>.
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
For each call, return a JSON object within <tool_call></tool_call> tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content if m.content }}
{%- for c in m.tool_calls or [] %}
<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
TINY64 = ["--model", "tiny", "--dtype", "float64", "--check-invariants", "--kv-slots", "8000"]
CHOICES = [
    pb.ToolChoice(mode="required"),
    pb.ToolChoice(function="add"),
    pb.ToolChoice(mode="auto"),
    pb.ToolChoice(function="get_weather"),
]


@dataclass
class Completion:
    token_ids: list[int] = field(default_factory=list)
    content: str = ""
    calls: dict[int, dict[str, str]] = field(default_factory=dict)
    finish: int = 0


def requests(count: int) -> list[pb.GenerateRequest]:
    rng = random.Random(5)
    tools = [pb.Tool(name=t.name, description="does it", parameters=t.parameters) for t in TOOLS]
    out = []
    for i in range(count):
        history = [pb.ChatMessage(role="user", content=f"Question {i}: {'x' * rng.randrange(1, 40)}?")]
        if i % 3 == 2:  # a turn after a call and its result
            call = pb.ToolCall(id=f"call_{i}", name="add", arguments='{"a": 1, "b": true}')
            history += [
                pb.ChatMessage(role="assistant", tool_calls=[call]),
                pb.ChatMessage(role="tool", tool_call_id=f"call_{i}", content="2"),
            ]
        chat = pb.ChatMessages(messages=history, tools=tools, tool_choice=CHOICES[i % len(CHOICES)])
        if i % 4 == 1:
            chat.parallel_tool_calls = False
        sampling = pb.SamplingParams(
            max_new_tokens=150, temperature=0.8 * (i // 4 % 2), seed=i, n=1 + (i % 5 == 0)
        )
        out.append(pb.GenerateRequest(request_id=f"t{i}", messages=chat, sampling=sampling))
    return out


async def call(channel: grpc.aio.Channel, request: pb.GenerateRequest) -> dict[str, Completion]:
    n = request.sampling.n or 1
    got = [Completion() for _ in range(n)]
    stub = generation_pb2_grpc.GenerationStub(channel)
    async for r in stub.Generate(request, timeout=CALL_TIMEOUT_S):
        c = got[r.index]
        c.token_ids += r.token_ids
        c.content += r.text
        c.finish = r.finish_reason or c.finish
        for d in r.tool_calls:
            if d.name:
                assert d.index not in c.calls and d.id.startswith("call_")
                c.calls[d.index] = {"name": d.name, "arguments": ""}
            c.calls[d.index]["arguments"] += d.arguments
    return {f"{request.request_id}/{i}": c for i, c in enumerate(got)}


def serve(mode: str, frontends: int, template: Path) -> dict[str, Completion]:
    scheduler_args = ["--mode", mode, "--chat-template", str(template), *frontend_flags(frontends)]
    with serving_pair(TINY64, scheduler_args) as (_, scheduler):

        async def run() -> dict[str, Completion]:
            groups = await channels_by_frontend(scheduler.address, frontends, per_frontend=1)
            channels = [c for group in groups.values() for c in group]
            try:
                batches = [call(channels[i % len(channels)], r) for i, r in enumerate(requests(16))]
                results: dict[str, Completion] = {}
                for got in await asyncio.gather(*batches):
                    results.update(got)
            finally:
                for channel in channels:
                    await channel.close()
            await wait_all_free(scheduler.address)
            return results

        return asyncio.run(run())


def check_calls(results: dict[str, Completion]) -> None:
    ended_on_calls = 0
    by_rid = {r.request_id: r for r in requests(16)}
    for key, c in results.items():
        request = by_rid[key.split("/")[0]]
        choice = request.messages.tool_choice
        if choice.WhichOneof("choice") == "function" or choice.mode == "required":
            assert c.content == "" and c.calls, (key, c)
        if not request.messages.parallel_tool_calls and request.messages.HasField("parallel_tool_calls"):
            assert len(c.calls) <= 1, key
        for index, made in c.calls.items():
            assert index < len(c.calls)
            if choice.WhichOneof("choice") == "function":
                assert made["name"] == choice.function
            if c.finish == pb.FINISH_REASON_TOOL_CALLS:
                schema: dict[str, Any] = TOOL_SCHEMAS[made["name"]]
                jsonschema.validate(json.loads(made["arguments"]), schema)
        if c.finish == pb.FINISH_REASON_TOOL_CALLS:
            ended_on_calls += 1
            assert c.calls
        assert "<tool_call>" not in c.content
    assert ended_on_calls >= 2, "named tools without parallel calls end after one call"


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tools") / "hermes.jinja"
    path.write_text(HERMES_TEMPLATE)
    return path


def test_tool_calls_are_the_same_serial_and_overlap_whatever_the_frontends(template: Path) -> None:
    serial = serve("serial", 0, template)
    check_calls(serial)
    for frontends in (0, 2):
        overlap = serve("overlap", frontends, template)
        assert overlap.keys() == serial.keys()
        for key in serial:
            assert overlap[key] == serial[key], (frontends, key)
