"""Chat templates rendered as transformers' apply_chat_template renders them: SmolLM2's template
against transformers' tokenizer of the same GGUF, and the sandbox's and error paths by hand."""

from __future__ import annotations

import json
from typing import Any

import pytest

from scheduler_svc.frontend.chat import ChatMessage, ChatTemplate, ChatTemplateError, tools_fallback
from scheduler_svc.frontend.tokenizer import HFTokenizer
from scheduler_svc.frontend.tools import Tool, ToolCall, render_call, tools_system_prompt
from worker_svc.gguf import GGUFModel

SYSTEM = ChatMessage("system", "You are a terse assistant.")
USER = ChatMessage("user", "What is the capital of France?")
ASSISTANT = ChatMessage("assistant", "Paris.")

CONVERSATIONS = {
    "user": [USER],
    "system_user": [SYSTEM, USER],
    "multi_turn": [SYSTEM, USER, ASSISTANT, ChatMessage("user", "And of Italy?")],
    "multi_turn_no_system": [
        USER,
        ASSISTANT,
        ChatMessage("user", "And of Italy?"),
        ChatMessage("assistant", "Rome."),
    ],
    "ends_with_assistant": [USER, ASSISTANT],
    "unicode": [
        ChatMessage("system", "Réponds en français, s'il te plaît.\n\n— merci"),
        ChatMessage(
            "user", "你好\uff0c世界\uff01 👨\u200d👩\u200d👧\u200d👦 🇫🇷\nline two\n\n\tindented   1 2  3"
        ),
    ],
    "template_syntax_in_content": [ChatMessage("user", "{{ 7 * 7 }} {% if true %}x{% endif %} <|im_end|>")],
    "empty_content": [ChatMessage("system", ""), ChatMessage("user", "")],
    "other_roles": [ChatMessage("tool", '{"temperature": 21}'), ChatMessage("user", "So?")],
}


def to_dicts(messages: list[ChatMessage]) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in messages]


def smollm2_template(smollm2: GGUFModel, reference: Any) -> ChatTemplate:
    assert smollm2.chat_template is not None
    return ChatTemplate(smollm2.chat_template, reference.special_tokens_map)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS.values(), ids=CONVERSATIONS.keys())
def test_smollm2_template_renders_and_encodes_as_transformers(
    smollm2: GGUFModel,
    smollm2_tokenizer: Any,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
) -> None:
    reference = smollm2_tokenizer
    rendered = smollm2_template(smollm2, smollm2_tokenizer).render(messages, add_generation_prompt)
    expected = reference.apply_chat_template(
        to_dicts(messages), tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert rendered == expected
    encoded = reference.apply_chat_template(
        to_dicts(messages), tokenize=True, add_generation_prompt=add_generation_prompt
    )
    assert HFTokenizer(smollm2.tokenizer_json).encode(rendered) == encoded["input_ids"]


@pytest.mark.parametrize(
    "final",
    ["Sure, the capital is", '{"city": "', "Paris is ", "  indented, and trailing  "],
)
def test_a_continued_final_message_renders_and_encodes_as_transformers(
    smollm2: GGUFModel, smollm2_tokenizer: Any, final: str
) -> None:
    """vLLM's assistant prefill: the prompt ends with the last message's content, its turn open."""
    messages = [SYSTEM, USER, ChatMessage("assistant", final)]
    rendered = smollm2_template(smollm2, smollm2_tokenizer).render(
        messages, add_generation_prompt=False, continue_final_message=True
    )
    options = {"add_generation_prompt": False, "continue_final_message": True}
    assert rendered == smollm2_tokenizer.apply_chat_template(to_dicts(messages), tokenize=False, **options)
    assert rendered.endswith(final) and not rendered.endswith("<|im_end|>\n")
    encoded = smollm2_tokenizer.apply_chat_template(to_dicts(messages), tokenize=True, **options)
    assert HFTokenizer(smollm2.tokenizer_json).encode(rendered) == encoded["input_ids"]


def test_a_stripping_template_s_final_message_is_found_stripped() -> None:
    template = ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</s>{% endfor %}", {})
    messages = [USER, ChatMessage("assistant", " Paris is  ")]
    assert (
        template.render(messages, False, continue_final_message=True)
        == f"<user>{USER.content}</s><assistant>Paris is"
    )
    with pytest.raises(ValueError, match="one or the other"):
        template.render(messages, True, continue_final_message=True)
    hidden = ChatTemplate("{% for m in messages %}{{ m.role }}{% endfor %}", {})
    with pytest.raises(ChatTemplateError, match="does not write the last message's content"):
        hidden.render(messages, False, continue_final_message=True)


def test_smollm2_template_injects_its_default_system_prompt(
    smollm2: GGUFModel, smollm2_tokenizer: Any
) -> None:
    rendered = smollm2_template(smollm2, smollm2_tokenizer).render([USER])
    assert rendered == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        f"<|im_start|>user\n{USER.content}<|im_end|>\n<|im_start|>assistant\n"
    )


# The environment's extras: trimmed blocks, loop controls, transformers' tojson, special tokens.
FEATURES = """
{{ bos_token }}
{% for message in messages %}
    {% if message.role == 'skip' %}{% continue %}{% endif %}
    {% if message.role == 'stop' %}{% break %}{% endif %}
    {{ message.role }}: {{ message | tojson }} {{ message | tojson(indent=2, sort_keys=true) }}
{% endfor %}
{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}
{{ eos_token }}{{ unk_token }}{{ pad_token }}{{ tools is none }}{{ documents is none }}
"""


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_environment_extras_render_as_transformers(
    smollm2_tokenizer: Any, add_generation_prompt: bool
) -> None:
    reference = smollm2_tokenizer
    messages = [
        ChatMessage("user", 'é "quoted" <b>&</b> 😀\n'),
        ChatMessage("skip", "hidden"),
        ChatMessage("assistant", "ok"),
        ChatMessage("stop", "end"),
        ChatMessage("user", "never"),
    ]
    rendered = ChatTemplate(FEATURES, reference.special_tokens_map).render(messages, add_generation_prompt)
    expected = reference.apply_chat_template(
        to_dicts(messages),
        chat_template=FEATURES,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
    )
    assert rendered == expected
    assert "hidden" not in rendered and "never" not in rendered and "<b>&</b>" in rendered


def test_strftime_now_formats_the_current_time() -> None:
    template = ChatTemplate("{{ strftime_now('%d %B %Y') }}", {})
    rendered = template.render([USER])
    assert len(rendered.split()) == 3 and rendered.split()[2].isdigit()


def test_only_the_given_special_tokens_are_defined() -> None:
    template = ChatTemplate("{{ bos_token }}|{{ eos_token is defined }}", {"bos_token": "<s>"})
    assert template.render([USER]) == "<s>|False"


MUST_START_WITH_USER = (
    "{% if messages[0]['role'] != 'user' %}"
    "{{ raise_exception('Conversations must start with a user message, got ' + messages[0]['role']) }}"
    "{% endif %}{{ messages[0]['content'] }}"
)


def test_raise_exception_raises_chat_template_error_with_its_message() -> None:
    template = ChatTemplate(MUST_START_WITH_USER, {})
    assert template.render([USER]) == USER.content
    with pytest.raises(ChatTemplateError) as raised:
        template.render([SYSTEM, USER])
    assert str(raised.value) == "Conversations must start with a user message, got system"


@pytest.mark.parametrize(
    "source",
    ["{% for m in messages %}{{ m.content }}", "{{ messages[0] ", "{% if %}x{% endif %}", "{% unknown %}"],
)
def test_a_template_that_does_not_compile_is_rejected(source: str) -> None:
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate(source, {})


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ messages[0].content.__class__.__base__.__subclasses__() }}",
        "{{ raise_exception.__globals__.keys() }}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ messages.append({'role': 'user', 'content': 'injected'}) }}",
        "{% set m = messages[0] %}{{ m.update({'content': 'x'}) }}",
        "{{ range(10 ** 9) | length }}",
    ],
)
def test_the_sandbox_refuses_unsafe_access(source: str) -> None:
    messages = [USER]
    with pytest.raises(ChatTemplateError):
        ChatTemplate(source, {}).render(messages)
    assert messages == [USER]


@pytest.mark.parametrize(
    "source",
    [
        "{{ 1 // (messages | length - 1) }}",
        "{{ messages[0]['content'] + 1 }}",
        "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
        "{{ messages[0]['content'].split('') }}",
    ],
)
def test_a_template_failing_on_the_messages_raises_chat_template_error(source: str) -> None:
    with pytest.raises(ChatTemplateError, match="chat template failed"):
        ChatTemplate(source, {}).render([USER])


def test_an_unsafe_attribute_alone_renders_empty_as_in_transformers(
    smollm2_tokenizer: Any,
) -> None:
    source = "[{{ ''.__class__ }}{{ messages[0].__class__ }}]"
    expected = smollm2_tokenizer.apply_chat_template(to_dicts([USER]), chat_template=source, tokenize=False)
    assert ChatTemplate(source, {}).render([USER]) == expected == "[]"


# ---- tools ----------------------------------------------------------------------------------

# A template that knows tools, in the shape the open chat models' templates have (tools listed
# in the system turn, calls and tool results as turns of their own).
TOOL_TEMPLATE = """{%- if tools %}<|im_start|>system
{{ messages[0].content if messages[0].role == 'system' else '' }}
# Tools
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and tools %}{% continue %}{% endif %}
{%- if message.tool_calls %}<|im_start|>assistant
{{ message.content or '' }}{% for call in message.tool_calls -%}
{% set written = {'name': call.function.name, 'arguments': call.function.arguments} -%}
<tool_call>{{ written | tojson }}</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>tool ({{ message.tool_call_id }})
{{ message.content }}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
WEATHER_TOOL = Tool(
    "get_weather",
    "The weather in a city",
    '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}',
)
CALL = ToolCall("get_weather", '{"city": "Paris"}', "call_1")
WITH_CALLS = [
    SYSTEM,
    ChatMessage("user", "Weather in Paris?"),
    ChatMessage("assistant", "", (CALL,)),
    ChatMessage("tool", '{"celsius": 21}', tool_call_id="call_1"),
]


# WITH_CALLS as an OpenAI client sends it, and transformers takes it (arguments as an object).
WITH_CALLS_AS_SENT: list[dict[str, Any]] = [
    {"role": "system", "content": SYSTEM.content},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    {"role": "tool", "content": '{"celsius": 21}', "tool_call_id": "call_1"},
]


def test_a_template_that_knows_tools_gets_them_as_transformers_passes_them(smollm2_tokenizer: Any) -> None:
    template = ChatTemplate(TOOL_TEMPLATE, smollm2_tokenizer.special_tokens_map)
    assert template.knows_tools
    rendered = template.render(WITH_CALLS, tools=[WEATHER_TOOL])
    tools = [
        {
            "type": "function",
            "function": {
                "name": WEATHER_TOOL.name,
                "description": WEATHER_TOOL.description,
                "parameters": json.loads(WEATHER_TOOL.parameters),
            },
        }
    ]
    expected = smollm2_tokenizer.apply_chat_template(
        WITH_CALLS_AS_SENT,
        tools=tools,
        chat_template=TOOL_TEMPLATE,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert rendered == expected
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in rendered


def test_a_template_that_knows_no_tools_gets_them_in_the_system_turn(
    smollm2: GGUFModel, smollm2_tokenizer: Any
) -> None:
    template = smollm2_template(smollm2, smollm2_tokenizer)
    assert not template.knows_tools
    rendered = template.render(WITH_CALLS, tools=[WEATHER_TOOL])
    fallback = tools_fallback(WITH_CALLS, [WEATHER_TOOL])
    assert rendered == smollm2_tokenizer.apply_chat_template(
        to_dicts(fallback), tokenize=False, add_generation_prompt=True
    )
    system = fallback[0]
    assert system.role == "system" and system.content.startswith(SYSTEM.content)
    assert tools_system_prompt([WEATHER_TOOL]) in system.content
    assert fallback[2].content == render_call(CALL)  # the history's call, written as the model writes calls
    no_system = tools_fallback(WITH_CALLS[1:], [WEATHER_TOOL])
    assert no_system[0] == ChatMessage("system", tools_system_prompt([WEATHER_TOOL]))
