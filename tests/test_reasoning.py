"""A reasoning model's thinking apart from its answer (scheduler_svc/frontend/reasoning.py): the
split itself, however the text is cut into pieces; and through a frontend whose core is scripted
(tests/test_openai_sampling.py), what the official `openai` client gets: `reasoning_content` (and
vLLM's newer `reasoning`) beside `content`, whole and streamed, with tool calls after the
thinking, a structured answer after it, and where the split does not apply
(`separate_reasoning: false`, --reasoning-parser none, a template that does not think); the
Responses API's reasoning items and the Messages API's thinking blocks, given back in the next
turn. gRPC clients get `reasoning_text`. The grammar that lets a reply think before a held answer
is walked on the matcher, and served over the services with the sim's checked masks."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anthropic
import httpx2
import openai
import pytest
import torch
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFRawTokenizer

from scheduler_svc.contract import FinishReason, StepOutputs
from scheduler_svc.frontend.api_config import ClientApiConfig
from scheduler_svc.frontend.frontend import Frontend, FrontendConfig
from scheduler_svc.frontend.grpc_api import _response
from scheduler_svc.frontend.openai.routes import build_app
from scheduler_svc.frontend.reasoning import ReasoningSplit, starts_inside, tag_tokens, thinks
from scheduler_svc.frontend.tokenizer import ByteTokenizer, HFTokenizer
from scheduler_svc.frontend.tools import Tool, ToolChoice, tool_constraint
from scheduler_svc.process.cli import parse_args
from stepahead.grammars import GrammarError, answer_kind, compile_constraint, thinking_constraint
from stepahead.processes import Service, serving_pair
from stepahead.protocol import Constraint, TokenizerSpec
from stepahead.v1 import generation_pb2 as pb
from tests.live import CALL_TIMEOUT_S, unused_port
from tests.test_openai_sampling import EOS, SCRIPTED_INFO, Scripted, ScriptedCore, steps_of
from tests.test_tokenizer import byte_level_bpe_json
from tests.test_tools_api import PARIS, TOOLS, calls_text, check_call
from worker_svc.backends import SIM_EOS_EVERY, _mix32
from worker_svc.grammar import MatcherTable, allowed, grammar_tokenizer, new_bitmask

pytestmark = pytest.mark.anyio

# Qwen3's way: the reply opens its own <think>; a history turn's thinking is shown when given.
THINKS = (
    "{% for m in messages %}[{{ m.role }}] "
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}|"
    "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
)
# DeepSeek-R1's way: the prompt opens the reasoning, the reply closes it.
OPENS = THINKS + "{% if add_generation_prompt %}<think>\n{% endif %}"
PLAIN = "{% for m in messages %}{{ m.content }}{% endfor %}"
DEFAULT_API = ClientApiConfig()

SCHEMA: dict[str, Any] = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
REPLY = "<think>\nThe user greets me.\nBe kind.\n</think>\n\nHello there!"
THOUGHT, ANSWER = "The user greets me.\nBe kind.", "Hello there!"
THINKING_BYTES = len(REPLY) - len("<think>") + 1 - len("\n\nHello there!")


# ---- the split ------------------------------------------------------------------------------


def split(text: str, inside: bool, cuts: list[int]) -> tuple[list[str], list[str]]:
    """The pieces `ReasoningSplit` gives for `text` pushed in the pieces `cuts` make, then finished."""
    parts = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    splitter, thoughts, contents = ReasoningSplit(inside), [], []
    for part in [*parts, None]:
        thought, content = splitter.push(part) if part is not None else splitter.finish()
        thoughts.append(thought)
        contents.append(content)
    return thoughts, contents


CASES = [
    (REPLY, False, THOUGHT, ANSWER),
    ("  <think>a</think>b", False, "a", "b"),
    ("\nThe user greets me.\n</think>\n\nHello there!", True, "The user greets me.", "Hello there!"),
    ("<think>\nstill thinking when cut", False, "still thinking when cut", ""),
    ("no thinking <think> here</think> at all", False, "", "no thinking <think> here</think> at all"),
    ("  plain, leading spaces kept", False, "", "  plain, leading spaces kept"),
    ("<thi", False, "", "<thi"),  # only the start of a tag, at the end
    ("<think></think>", False, "", ""),
    ("<think>a </thinker> b</think>c </think> d", False, "a </thinker> b", "c </think> d"),
    ("a < b </think", True, "a < b </think", ""),  # inside, cut mid-tag
    ("", True, "", ""),
]


@pytest.mark.parametrize(("text", "inside", "thought", "answer"), CASES)
def test_the_split_is_the_same_however_the_text_is_cut(
    text: str, inside: bool, thought: str, answer: str
) -> None:
    whole = split(text, inside, [])
    assert ("".join(whole[0]), "".join(whole[1])) == (thought, answer)
    rng = random.Random(len(text))
    for cuts in [[i] for i in range(1, len(text))] + [
        sorted(rng.sample(range(1, len(text)), k=len(text) // 3))
    ]:
        thoughts, contents = split(text, inside, cuts)
        assert ("".join(thoughts), "".join(contents)) == (thought, answer), cuts


def test_text_is_held_only_while_it_may_be_a_tag_or_the_reasoning_s_last_whitespace() -> None:
    splitter = ReasoningSplit(False)
    assert splitter.push("<th") == ("", "")
    assert splitter.push("ink>\nStep one") == ("Step one", "")
    assert splitter.push(".\n\n") == (".", "")  # the newlines may be the reasoning's end
    assert splitter.push("Step two</th") == ("\n\nStep two", "")
    assert splitter.push("ink>\n\nDone") == ("", "Done") and not splitter.thinking


def test_which_templates_think_and_where_a_reply_starts() -> None:
    tokenizer = ByteTokenizer()
    assert thinks(THINKS, tokenizer) and thinks(OPENS, tokenizer) and not thinks(PLAIN, tokenizer)
    assert starts_inside("[user] hi|[assistant] <think>\n")
    assert not starts_inside("[user] hi|[assistant] <think>\n\n</think>\n\n")  # thinking disabled
    assert not starts_inside("[assistant] <think>a</think>b|[user] hi|[assistant] ")


class DropsTags(ByteTokenizer):
    """A tokenizer whose text drops the tags (as special tokens skipped)."""

    def new_decoder(self, skip_special_tokens: bool = True) -> Any:
        inner = super().new_decoder(skip_special_tokens)

        class Decoder:
            def push(self, ids: Any) -> str:
                return str(inner.push(ids)).replace("<think>", "").replace("</think>", "")

            def flush(self) -> str:
                return str(inner.flush())

        return Decoder()


def test_a_tokenizer_that_drops_the_tags_does_not_think() -> None:
    assert not thinks(THINKS, DropsTags())


@pytest.mark.parametrize("special", [False, True])
def test_a_tokenizer_s_added_tags_think_unless_special(special: bool) -> None:
    """Qwen3's tags are added tokens that are not special: its replies' text keeps them. Special
    ones are skipped from the text, which then has no tag to split on."""
    raw = HFRawTokenizer.from_str(byte_level_bpe_json().decode())
    tags = [AddedToken("<think>", special=special), AddedToken("</think>", special=special)]
    (raw.add_special_tokens if special else raw.add_tokens)(tags)
    tokenizer = HFTokenizer(raw.to_str().encode())
    assert len(tokenizer.encode("<think>a</think>", add_special_tokens=False)) == 3
    assert thinks(THINKS, tokenizer) is not special


def test_the_grammar_takes_a_tokenizer_s_added_tags_as_one_token_each() -> None:
    """Qwen3's tags are tokens added to the vocabulary, which the grammar engine takes as special
    (never text of a lexeme): the grammar names them by id (`tag_tokens`), so the reply may open
    the thinking with its `<think>` token and leave it with `</think>`, as the model writes them."""
    raw = HFRawTokenizer.from_str(byte_level_bpe_json().decode())
    raw.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    tags = tag_tokens(HFTokenizer(raw.to_str().encode()))
    assert tags is not None and tag_tokens(ByteTokenizer()) is None
    opening, closing = tags
    vocab = raw.get_vocab_size()
    table = MatcherTable(
        grammar_tokenizer(TokenizerSpec("hf", hf_json=raw.to_str().encode()), vocab, (0,)), vocab
    )

    def free(slot: int) -> set[int]:
        mask = new_bitmask(1, vocab)
        table.fill_mask(slot, mask, 0)
        return {i for i in range(vocab) if allowed(mask, vocab)[0, i]}

    digits = Constraint("regex", "[0-9]+")
    table.start(0, digits)
    answer_start = free(0)
    for slot, inside in ((1, False), (2, True)):
        table.start(slot, thinking_constraint(digits, inside, tags))
        if not inside:
            assert free(slot) == answer_start | {opening}
            table.advance(slot, opening)
        assert closing in free(slot) and opening not in free(slot)
        for token in raw.encode("I think 4 < 5, so: </thi", add_special_tokens=False).ids:
            table.advance(slot, token)
        table.advance(slot, closing)
        assert free(slot) - answer_start == set(raw.encode("\n", add_special_tokens=False).ids)
        for token in raw.encode("\n\n42", add_special_tokens=False).ids:
            table.advance(slot, token)
    # as text, the tags would not match the added tokens: the reply could not think
    table.start(3, thinking_constraint(digits, False))
    assert opening not in free(3)


# ---- the grammar: the thinking free, the answer held -----------------------------------------

TABLE = MatcherTable(grammar_tokenizer(TokenizerSpec("byte"), 258, (EOS,)), 258)
REQUIRED_CALL = tool_constraint([Tool("add", parameters=json.dumps(SCHEMA))], ToolChoice("required"))
assert REQUIRED_CALL is not None
ANSWERS = [
    (Constraint("json", json.dumps(SCHEMA)), '{"a": 12}'),
    (Constraint("regex", "[0-9]{2}"), "42"),
    (Constraint("choice", '["yes", "no"]'), "no"),
    (REQUIRED_CALL, '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'),
]


def allowed_bytes(slot: int) -> set[int]:
    mask = new_bitmask(1, 258)
    TABLE.fill_mask(slot, mask, 0)
    bits = allowed(mask, 258)[0]
    return {i for i in range(256) if bits[i]}


def walk(slot: int, text: str) -> bool:
    """Whether the grammar takes `text` (a byte a token); True: it finished with its last."""
    done = False
    for byte in text.encode():
        assert byte in allowed_bytes(slot), (text, chr(byte))
        done = TABLE.advance(slot, byte)
    return done


@pytest.mark.parametrize(("answer", "text"), ANSWERS, ids=lambda a: getattr(a, "kind", ""))
def test_the_thinking_is_free_and_the_answer_held(answer: Constraint, text: str) -> None:
    TABLE.start(0, answer)
    plain_start = allowed_bytes(0)
    TABLE.start(1, thinking_constraint(answer, inside=False))
    assert allowed_bytes(1) == plain_start | {ord("<")}  # think first, or answer at once
    walk(1, "<think>")
    assert allowed_bytes(1) >= set(range(32, 127))  # free: any printable byte
    walk(1, "It needs { and } and a <tool_call> or two.\n</think>\n\n")
    assert allowed_bytes(1) == plain_start  # the answer, held from its start
    assert walk(1, text) == walk(0, text)  # finishes where the plain answer does
    TABLE.start(2, thinking_constraint(answer, inside=False))
    walk(2, text)  # no thinking at all
    TABLE.start(3, thinking_constraint(answer, inside=True))
    assert allowed_bytes(3) >= set(range(32, 127))  # the prompt opened it: free from the start
    walk(3, text + "</think>\n\n")
    assert allowed_bytes(3) == plain_start
    for slot in range(4):
        TABLE.release(slot)


def test_a_thinking_constraint_is_checked_as_its_answer() -> None:
    with pytest.raises(GrammarError):
        compile_constraint(thinking_constraint(Constraint("regex", "(unclosed"), inside=False))
    assert answer_kind(thinking_constraint(Constraint("choice", '["a"]'), inside=True)) == "choice"


# ---- through the client API -------------------------------------------------------------------


@pytest.fixture
async def s() -> AsyncIterator[Scripted]:
    """A scripted frontend serving a template that thinks."""
    async with scripted_with(THINKS) as served:
        yield served


class scripted_with:
    """A scripted frontend whose model has the chat template `template`, with the API `config`."""

    def __init__(self, template: str, config: ClientApiConfig = DEFAULT_API) -> None:
        core = ScriptedCore()
        self.frontend = Frontend(FrontendConfig())
        self.frontend.core = core
        spec = TokenizerSpec("byte", chat_template=template)
        self.frontend.worker_state(
            dataclasses.replace(SCRIPTED_INFO, max_context_len=4096, tokenizer=spec), True
        )
        self.http = httpx2.AsyncClient(
            transport=httpx2.ASGITransport(app=build_app(self.frontend, config)), base_url="http://scripted"
        )
        self.client = openai.AsyncOpenAI(
            base_url="http://scripted/v1", api_key="unchecked", max_retries=0, http_client=self.http
        )
        self.core = core

    async def __aenter__(self) -> Scripted:
        return Scripted(self.frontend, self.core, self.client)

    async def __aexit__(self, *exc: object) -> None:
        await self.client.close()
        await self.http.aclose()


async def served(s: Scripted, create: Any, reply: str, finish: FinishReason = FinishReason.STOP) -> Any:
    """`create`'s result once its completion generated `reply` (a byte a token) then EOS."""
    call = asyncio.ensure_future(create)
    ids = list(reply.encode()) + ([EOS] if finish == FinishReason.STOP else [])
    await s.play(call, 1, steps_of(ids, finish))
    return await call


def chat(**more: Any) -> dict[str, Any]:
    return {"model": "scripted", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 200, **more}


async def test_the_thinking_is_reasoning_content_and_the_answer_content(s: Scripted) -> None:
    done = await served(s, s.client.chat.completions.create(**chat()), REPLY)
    message = done.choices[0].message
    assert message.content == ANSWER and done.choices[0].finish_reason == "stop"
    extra = message.model_extra or {}
    assert extra["reasoning_content"] == THOUGHT and extra["reasoning"] == THOUGHT
    assert done.usage is not None and done.usage.completion_tokens == len(REPLY.encode()) + 1
    # a byte a token: the thinking's, from the opening tag's last to the closing tag's
    assert done.usage.completion_tokens_details is not None
    assert done.usage.completion_tokens_details.reasoning_tokens == THINKING_BYTES


async def test_streamed_pieces_join_into_the_whole_reply(s: Scripted) -> None:
    stream = await served(s, s.client.chat.completions.create(**chat(stream=True)), REPLY)
    deltas = [chunk.choices[0].delta async for chunk in stream if chunk.choices]
    thoughts = [(d.model_extra or {}).get("reasoning_content") for d in deltas]
    assert "".join(t for t in thoughts if t) == THOUGHT
    assert "".join(d.content or "" for d in deltas) == ANSWER
    # the thinking streams as it comes, before any of the answer
    first_answer = next(i for i, d in enumerate(deltas) if d.content)
    assert sum(1 for t in thoughts[:first_answer] if t) > 3 and not any(thoughts[first_answer:])


async def test_a_reply_cut_while_thinking_has_no_content() -> None:
    async with scripted_with(OPENS) as s:  # the prompt opened the thinking
        create = s.client.chat.completions.create(**chat())
        done = await served(s, create, "Let me see: 2 + 2", FinishReason.LENGTH)
        prompt = s.core.specs[-1].prompt_ids
    assert bytes(prompt).decode().endswith("[assistant] <think>\n")
    message = done.choices[0].message
    assert message.content is None and (message.model_extra or {})["reasoning_content"] == "Let me see: 2 + 2"
    assert done.choices[0].finish_reason == "length"
    assert done.usage is not None and done.usage.completion_tokens_details is not None
    assert done.usage.completion_tokens_details.reasoning_tokens == done.usage.completion_tokens  # all of it


async def test_text_held_at_the_end_is_not_lost(s: Scripted) -> None:
    """Held as the possible start of a tag, it is the reply's at its finish."""
    done = await served(s, s.client.chat.completions.create(**chat()), "<thin")
    assert done.choices[0].message.content == "<thin"
    async with scripted_with(OPENS) as opened:
        done = await served(
            opened, opened.client.chat.completions.create(**chat()), "a </thi", FinishReason.LENGTH
        )
    assert (done.choices[0].message.model_extra or {})["reasoning_content"] == "a </thi"


async def test_a_call_after_the_thinking_is_a_tool_call(s: Scripted) -> None:
    reply = "<think>The weather tool answers this.</think>\n" + calls_text(PARIS)
    done = await served(s, s.client.chat.completions.create(**chat(tools=TOOLS)), reply)
    message = done.choices[0].message
    assert (message.model_extra or {})["reasoning_content"] == "The weather tool answers this."
    assert (
        message.content is None
        and message.tool_calls is not None
        and done.choices[0].finish_reason == "tool_calls"
    )
    check_call(message.tool_calls[0], PARIS)


async def test_where_the_split_does_not_apply_the_text_is_whole(s: Scripted) -> None:
    for more in (
        {"extra_body": {"separate_reasoning": False}},
        {"extra_body": {"separate_reasoning": False}, "response_format": {"type": "json_object"}},
    ):
        done = await served(s, s.client.chat.completions.create(**chat(**more)), REPLY)
        message = done.choices[0].message
        assert message.content == REPLY and "reasoning_content" not in (message.model_extra or {}), more
        constraint = s.core.specs[-1].params.constraint
        assert constraint is None or constraint.kind == "json"  # held from the first token
    for template, config in ((PLAIN, DEFAULT_API), (THINKS, ClientApiConfig(separate_reasoning=False))):
        async with scripted_with(template, config) as other:
            done = await served(other, other.client.chat.completions.create(**chat()), REPLY)
        assert done.choices[0].message.content == REPLY and not done.choices[0].message.model_extra


@pytest.mark.parametrize("template", [THINKS, OPENS])
async def test_a_structured_answer_after_the_thinking(template: str) -> None:
    """The reply's grammar lets it think first (or, where the prompt opened the thinking, think
    on), then holds its answer: the core gets the thinking constraint around the schema."""
    response_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    reply = ("<think>" if template == THINKS else "") + "\nOne field, a.\n</think>\n\n" + '{"a": 7}'
    async with scripted_with(template) as s:
        create = s.client.chat.completions.create(**chat(response_format=response_format))
        done = await served(s, create, reply)
        constraint = s.core.specs[-1].params.constraint
    inside = template == OPENS
    assert constraint == thinking_constraint(Constraint("json", json.dumps(SCHEMA)), inside)
    message = done.choices[0].message
    assert (message.model_extra or {})["reasoning_content"] == "One field, a." and json.loads(
        message.content
    ) == {"a": 7}


async def test_the_responses_api_gives_a_reasoning_item_before_the_answer(s: Scripted) -> None:
    create = s.client.responses.create(model="scripted", input="Hi", max_output_tokens=200)
    done = await served(s, create, REPLY)
    assert [item.type for item in done.output] == ["reasoning", "message"] and done.output_text == ANSWER
    assert done.usage is not None and done.usage.output_tokens_details.reasoning_tokens == THINKING_BYTES
    reasoning = done.output[0]
    assert reasoning.type == "reasoning" and reasoning.content is not None
    assert [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", THOUGHT)]
    stream = await served(s, s.client.responses.create(model="scripted", input="Hi", stream=True), REPLY)
    events = [event async for event in stream]
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == THOUGHT and len(deltas) > 3
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    final = events[-1]
    assert final.type == "response.completed"
    assert [i.model_dump(exclude={"id"}) for i in final.response.output] == [
        i.model_dump(exclude={"id"}) for i in done.output
    ]
    # the output given back as the next input: its thinking reaches the template with its answer
    history = [{"role": "user", "content": "Hi"}, *[i.model_dump(exclude_none=True) for i in done.output]]
    history.append({"role": "user", "content": "Bye"})
    await served(s, s.client.responses.create(model="scripted", input=history), "Bye!")
    prompt = bytes(s.core.specs[-1].prompt_ids).decode()
    assert prompt == f"[user] Hi|[assistant] <think>{THOUGHT}</think>{ANSWER}|[user] Bye|[assistant] "


async def test_a_responses_reply_cut_while_thinking_is_an_incomplete_reasoning_item(s: Scripted) -> None:
    create = s.client.responses.create(model="scripted", input="Hi", max_output_tokens=200)
    done = await served(s, create, "<think>Still", FinishReason.LENGTH)
    assert done.status == "incomplete" and [i.type for i in done.output] == ["reasoning"]
    assert done.output[0].status == "incomplete" and done.output_text == ""


def claude_of(s: Scripted) -> anthropic.AsyncAnthropic:
    """An Anthropic client of the scripted frontend."""
    http = httpx2.AsyncClient(
        transport=httpx2.ASGITransport(app=build_app(s.frontend)), base_url="http://scripted"
    )
    return anthropic.AsyncAnthropic(base_url="http://scripted", api_key="-", max_retries=0, http_client=http)


async def test_the_messages_api_gives_a_thinking_block_before_the_answer(s: Scripted) -> None:
    async with claude_of(s) as claude:
        ask: dict[str, Any] = {
            "model": "scripted",
            "max_tokens": 200,
            "messages": [{"role": "user", "content": "Hi"}],
        }
        done = await served(s, claude.messages.create(**ask), REPLY)
        assert [b.type for b in done.content] == ["thinking", "text"]
        thinking, text = done.content
        assert thinking.type == "thinking" and thinking.thinking == THOUGHT and thinking.signature == ""
        assert text.type == "text" and text.text == ANSWER and done.stop_reason == "end_turn"

        async def read() -> tuple[list[Any], Any]:
            async with claude.messages.stream(**ask) as stream:
                return [event async for event in stream], await stream.get_final_message()

        events, final = await served(s, read(), REPLY)
        deltas = [e.delta for e in events if e.type == "content_block_delta"]
        assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == THOUGHT
        assert [d.type for d in deltas].count("signature_delta") == 1
        assert final.model_dump(exclude={"id"}) == done.model_dump(exclude={"id"})
        # the thinking given back reaches the template; `thinking` reaches it as enable_thinking
        turns = [*ask["messages"], {"role": "assistant", "content": [b.model_dump() for b in done.content]}]
        turns.append({"role": "user", "content": "Bye"})
        later = {**ask, "messages": turns, "thinking": {"type": "enabled", "budget_tokens": 1024}}
        await served(s, claude.messages.create(**later), "Bye!")
        prompt = bytes(s.core.specs[-1].prompt_ids).decode()
        assert prompt == f"[user] Hi|[assistant] <think>{THOUGHT}</think>{ANSWER}|[user] Bye|[assistant] "


async def test_the_messages_api_s_thinking_reaches_the_template_as_enable_thinking() -> None:
    template = THINKS + "{% if enable_thinking is defined %}{{ enable_thinking }}{% endif %}"
    async with (
        scripted_with(template) as s,
        anthropic.AsyncAnthropic(
            base_url="http://scripted", api_key="-", max_retries=0, http_client=s.client._client
        ) as claude,
    ):
        for thinking, shown in (
            ({"type": "enabled", "budget_tokens": 1024}, "True"),
            ({"type": "disabled"}, "False"),
            ({"type": "adaptive"}, ""),
        ):
            ask: dict[str, Any] = {"model": "scripted", "max_tokens": 200, "thinking": thinking}
            await served(s, claude.messages.create(**ask, messages=[{"role": "user", "content": "Hi"}]), "ok")
            assert bytes(s.core.specs[-1].prompt_ids).decode() == "[user] Hi|[assistant] " + shown


async def test_a_turn_s_reasoning_content_reaches_the_template(s: Scripted) -> None:
    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
        {"role": "user", "content": "Bye"},
    ]
    await served(s, s.client.chat.completions.create(**chat(messages=history)), "Bye!")
    prompt = bytes(s.core.specs[-1].prompt_ids).decode()
    assert prompt == "[user] Hi|[assistant] <think>Greet back.</think>Hello!|[user] Bye|[assistant] "


async def test_grpc_clients_get_reasoning_text(s: Scripted) -> None:
    chat_input = pb.ChatMessages(
        messages=[pb.ChatMessage(role="user", content="Hi")], separate_reasoning=True
    )
    completions = await s.frontend.admit(
        pb.GenerateRequest(messages=chat_input, sampling=pb.SamplingParams(max_new_tokens=200))
    )
    handle = s.core.specs[-1].handle
    for step in steps_of([*REPLY.encode(), EOS]):
        outputs = StepOutputs()
        for _, token, finish in step:
            outputs.add(handle, token, finish)
        s.frontend.send(outputs)
    responses = []
    async with asyncio.timeout(CALL_TIMEOUT_S):
        while not completions.done:
            await completions.ready.wait()
            responses += [_response(completions, i, chunk) for i, chunk in completions.take()]
    assert "".join(r.reasoning_text for r in responses) == THOUGHT
    assert responses[-1].reasoning_tokens == THINKING_BYTES
    assert "".join(r.text for r in responses) == ANSWER


def test_the_reasoning_parser_flag() -> None:
    assert parse_args([]).api.separate_reasoning
    assert parse_args(["--reasoning-parser", "qwen3"]).api.separate_reasoning
    assert not parse_args(["--reasoning-parser", "none"]).api.separate_reasoning


# ---- over the services: the worker's matcher holds the answer, not the thinking ---------------

SIM = ["--model", "sim", "--sim-step-ms", "1", "--kv-slots", "4096", "--check-invariants"]
YES_NO: dict[str, Any] = {"enum": ["yes", "no"]}


@pytest.fixture(scope="module")
def thinking_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    template = tmp_path_factory.mktemp("chat") / "thinks.jinja"
    template.write_text(THINKS)
    with serving_pair(SIM, ["--http-port", str(unused_port()), "--chat-template", str(template)]) as (
        _,
        scheduler,
    ):
        yield scheduler


def sim_first_token(prompt: bytes, allowed_ids: list[int]) -> int:
    """The sim's first token after `prompt` under a mask allowing `allowed_ids` (its draw:
    worker_svc/backends.py, `SimDraw`)."""
    h = sim_hash(prompt[-1], len(prompt))
    free = EOS if h % SIM_EOS_EVERY == 0 else 32 + h % 95
    return free if free in allowed_ids else sorted(allowed_ids)[h % len(allowed_ids)]


def sim_hash(last: int, position: int) -> int:
    return int(_mix32(torch.tensor([last * 65536 + position]))[0])


def test_over_the_services_a_reply_thinks_or_answers_as_its_grammar_allows(thinking_sim: Service) -> None:
    """The sim draws its own token where the row's mask allows it, else one the mask allows: at
    its first token that is the thinking's `<` or the answer's `"`, and which one it is follows
    from the prompt. Either way the worker (checking every draw against its mask) serves it: an
    answer held to the schema, or thinking, free, until max_tokens."""
    answer = Constraint("json", json.dumps(YES_NO))
    TABLE.start(0, thinking_constraint(answer, inside=False))
    start = sorted(allowed_bytes(0))
    TABLE.release(0)
    assert start == [ord('"'), ord("<")]
    client = openai.OpenAI(base_url=f"{thinking_sim.http_url}/v1", api_key="unused", max_retries=0)
    response_format: Any = {"type": "json_schema", "json_schema": {"name": "yes_no", "schema": YES_NO}}
    seen = set()
    for k in range(1, 12):
        content = "a" * k
        first = sim_first_token(f"[user] {content}|[assistant] ".encode(), start)
        reply = client.chat.completions.create(
            model="sim",
            messages=[{"role": "user", "content": content}],
            max_tokens=24,
            response_format=response_format,
            timeout=CALL_TIMEOUT_S,
        )
        choice, extra = reply.choices[0], reply.choices[0].message.model_extra or {}
        if first == ord("<"):
            assert choice.finish_reason == "length" and choice.message.content is None
            assert extra["reasoning_content"] and "</think>" not in extra["reasoning_content"]
        else:
            assert (
                choice.finish_reason == "stop" and json.loads(choice.message.content or "") in YES_NO["enum"]
            )
            assert "reasoning_content" not in extra
        seen.add(first)
    assert seen == set(start)  # both ways were taken
