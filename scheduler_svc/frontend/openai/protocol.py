"""The OpenAI-compatible HTTP API's bodies: requests as pydantic models, mapped onto a
GenerateRequest so that one set of checks serves both APIs; responses and errors as dicts.

Fields OpenAI defines and Stepahead does not implement are refused with 400 naming them,
never silently ignored. `top_k`, `ignore_eos`, `stop_token_ids`, `repetition_penalty`,
`min_tokens`, `include_stop_str_in_output` and (chat) `add_generation_prompt` with
`continue_final_message` are accepted as the extra fields vLLM takes; every choice carries vLLM's
`stop_reason`.

Structured output, on both endpoints: OpenAI's `response_format` (`json_object`, or `json_schema`,
whose output is held to the schema whatever `strict` says), vLLM's `structured_outputs` (`json`,
`regex`, `choice`, `grammar`, `json_object`) and its older `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar`: one constraint per request, mapped onto the GenerateRequest's
`structured` oneof, whose checks (sizes, the compile) name the HTTP field that sent it.
"""

from __future__ import annotations

import codecs
import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from scheduler_svc.contract import (
    MAX_COMPLETIONS,
    MAX_LOGIT_BIAS,
    MIN_TEMPERATURE,
    FinishReason,
    TokenLogprob,
)
from scheduler_svc.frontend.tools import CallDelta, ToolCall, merge_deltas
from scheduler_svc.frontend.validation import STRUCTURED_FIELD, constraint_field
from stepahead.v1 import generation_pb2 as pb

UINT32 = 1 << 32
UINT64 = 1 << 64
MAX_OPENAI_STOPS = 4  # OpenAI's own bound on `stop`
UTF8_CONTINUATION = (0x80, 0xBF)  # the bytes that continue a character
MIN_LOGPROB = -9999.0  # what a log-probability of -inf (or NaN) is sent as: JSON has neither

FINISH_REASONS = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
    FinishReason.TOOL_CALLS: "tool_calls",
}
# The GenerateRequest fields the checks name, as the HTTP API names them.
HTTP_FIELDS = {
    "input.text": "prompt",
    "input.input_ids.ids": "prompt",
    "input.messages.messages": "messages",
    "input.messages": "messages",
    "input": "prompt",
    "sampling.max_new_tokens": "max_tokens",
    "sampling.stop_token_ids": "stop_token_ids",
    "sampling.stop": "stop",
    "sampling.presence_penalty": "presence_penalty",
    "sampling.frequency_penalty": "frequency_penalty",
    "sampling.repetition_penalty": "repetition_penalty",
    "sampling.min_tokens": "min_tokens",
    "sampling.min_p": "min_p",
    "sampling.logit_bias": "logit_bias",
    "sampling.top_logprobs": "top_logprobs",  # completions: `logprobs`
    "sampling.logprobs": "logprobs",
    "sampling.n": "n",
    "sampling": "",
}
# The tools' fields, where OpenAI nests them under `function`.
TOOL_FIELDS = [
    (re.compile(r"input\.messages\.tools\[(\d+)\]\.(\w+)"), r"tools[\1].function.\2"),
    (re.compile(r"input\.messages\.tool_choice\.function"), "tool_choice.function.name"),
    (re.compile(r"input\.messages\.tool_choice(\.mode)?"), "tool_choice"),
    (
        re.compile(
            r"input\.messages\.(tools|parallel_tool_calls|add_generation_prompt|continue_final_message)"
        ),
        r"\1",
    ),
    (re.compile(r"input\.messages\.template_kwargs"), "chat_template_kwargs"),
    (
        re.compile(r"input\.messages\.messages\[(\d+)\]\.tool_calls\[(\d+)\]\.(name|arguments)"),
        r"messages[\1].tool_calls[\2].function.\3",
    ),
]
TokenId = Annotated[int, Field(ge=0, lt=UINT32)]
JSON_SCHEMA_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for response_format.json_schema.name
ANY_JSON = "{}"  # the schema of a json_schema response_format that gives none: any JSON (as vLLM)


class FieldError(ValueError):
    """A field whose value cannot be served: out of range, or asking for what is not implemented."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


# NOTE: strict: a boolean is a JSON boolean and an integer a JSON integer (`"stream": "yes"` or
# `"max_tokens": true` is a 400 naming the field, not coerced); a float field takes integers.
STRICT = ConfigDict(strict=True, extra="ignore")


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, usage in every chunk


# ---- structured output ---------------------------------------------------------------------------

Structured = Literal["json_schema", "json_object", "regex", "choice", "grammar"]  # the proto's oneof
JsonSchema = dict[str, Any] | str  # vLLM's `json`: a schema, or the schema's JSON text


class JsonSchemaFormat(BaseModel):
    model_config = STRICT

    name: str = Field(pattern=JSON_SCHEMA_NAME)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # accepted either way: the output is always held to the schema


class ResponseFormat(BaseModel):
    model_config = STRICT

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`; its options Stepahead does not implement (`structural_tag`,
    `whitespace_pattern`, ...) are refused, as unknown keys."""

    model_config = ConfigDict(strict=True, extra="forbid")

    json_: JsonSchema | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


@dataclass(frozen=True)
class HttpConstraint:
    """A constraint as the HTTP field `param` sends it, and the `structured` member it becomes."""

    param: str
    member: Structured
    value: JsonSchema | list[str] | bool

    def set_on(self, sampling: pb.SamplingParams) -> None:
        value = self.value
        if isinstance(value, bool):
            sampling.json_object = value
        elif isinstance(value, list):
            sampling.choice.choices.extend(value)
        elif isinstance(value, dict):
            sampling.json_schema = json.dumps(value)
        elif self.member == "json_schema":
            sampling.json_schema = value
        elif self.member == "regex":
            sampling.regex = value
        else:
            sampling.grammar = value

    def http_field(self, field: str) -> str:
        """A check's field path under this constraint's member, as the HTTP API names it."""
        return self.param + field.removeprefix(constraint_field(self.member))


def _response_format(fmt: ResponseFormat) -> list[HttpConstraint]:
    if fmt.type == "json_object":
        return [HttpConstraint("response_format", "json_object", True)]
    if fmt.type == "text":
        return []
    if fmt.json_schema is None:
        raise FieldError("response_format.json_schema", "required when type is 'json_schema'")
    schema = fmt.json_schema.schema_
    value = ANY_JSON if schema is None else schema
    return [HttpConstraint("response_format.json_schema.schema", "json_schema", value)]


def _structured_outputs(so: StructuredOutputs) -> list[HttpConstraint]:
    found = _present(
        [
            ("structured_outputs.json", "json_schema", so.json_),
            ("structured_outputs.regex", "regex", so.regex),
            ("structured_outputs.choice", "choice", so.choice),
            ("structured_outputs.grammar", "grammar", so.grammar),
            ("structured_outputs.json_object", "json_object", so.json_object or None),  # false: none
        ]
    )
    if not found:
        raise FieldError("structured_outputs", "set one of json, regex, choice, grammar or json_object")
    return found


Candidate = tuple[str, Structured, JsonSchema | list[str] | bool | None]  # (param, member, value)


def _present(candidates: list[Candidate]) -> list[HttpConstraint]:
    """The candidates the body sets."""
    return [HttpConstraint(param, member, value) for param, member, value in candidates if value is not None]


# Fields OpenAI's or vLLM's API documents that this server does not serve, with the value it
# does serve (what it does when the field is absent): a body that asks for another value gets a
# 400 naming the field. A field no API documents is ignored, with a warning in the log (as vLLM).
UNSERVED: dict[str, object] = {
    # OpenAI
    "audio": None,
    "modalities": None,
    "prediction": None,
    "web_search_options": None,
    "reasoning_effort": None,
    "verbosity": None,
    "store": False,
    "metadata": None,
    "service_tier": None,
    # vLLM's sampling and request extras (best_of: chat's; completions have the field)
    "best_of": None,
    "use_beam_search": False,
    "length_penalty": 1.0,
    "spaces_between_special_tokens": True,
    "truncate_prompt_tokens": None,
    "prompt_logprobs": None,
    "allowed_token_ids": None,
    "bad_words": None,
    "add_special_tokens": False,
    "documents": None,
    "chat_template": None,
    "mm_processor_kwargs": None,
    "media_io_kwargs": None,
    "guided_decoding_backend": None,
    "guided_whitespace_pattern": None,
    "structural_tag": None,
    "priority": 0,
    "logits_processors": None,
    "return_tokens_as_token_ids": False,
    "return_token_ids": False,
    "cache_salt": None,
    "kv_transfer_params": None,
    "vllm_xargs": None,
    "request_id": None,
    "echo": False,  # chat (completions serve it)
}
# Other spellings of what is served, which OpenAI documents as the field's default: a client that
# sends the default explicitly asks for what this server does.
ALSO_SERVED: dict[str, tuple[object, ...]] = {
    "modalities": (["text"],),
    "service_tier": ("auto", "default"),
}
MAX_NAMES_LOGGED = 8
MAX_PROMPTS = 128  # a /v1/completions list of prompts (each with its n completions)


class SamplingFields(BaseModel):
    """What both endpoints share. Fields a body has beyond these are checked by `check_fields`."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    min_p: float | None = None  # vLLM's
    seed: int | None = Field(default=None, ge=-(1 << 63), lt=UINT64)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    top_k: int = Field(default=0, ge=0, lt=UINT32)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    repetition_penalty: float | None = None
    min_tokens: int = Field(default=0, ge=0, lt=UINT32)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # vLLM's: a stop string that ends the text is in it
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: JsonSchema | None = None  # vLLM's older names of structured_outputs' members
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def check_fields(self) -> list[str]:
        """FieldError naming a documented field asked for a value this server does not serve;
        the names of the fields no API documents (ignored)."""
        unknown = []
        for name, value in (self.model_extra or {}).items():
            if name not in UNSERVED:
                unknown.append(name)
                continue
            served_values = (UNSERVED[name], *ALSO_SERVED.get(name, ()))
            if value is not None and value not in served_values:
                served = " or ".join(json.dumps(v) for v in served_values)
                raise FieldError(
                    name, f"not served: only {served} (the default) is, got {json.dumps(value)[:64]}"
                )
        return unknown

    def check_supported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "only allowed when stream is true")

    def constraints(self) -> list[HttpConstraint]:
        """Every constraint the body asks for, in the order of its fields (one may be served)."""
        found = [] if self.response_format is None else _response_format(self.response_format)
        if self.structured_outputs is not None:
            found += _structured_outputs(self.structured_outputs)
        found += _present(
            [
                ("guided_json", "json_schema", self.guided_json),
                ("guided_regex", "regex", self.guided_regex),
                ("guided_choice", "choice", self.guided_choice),
                ("guided_grammar", "grammar", self.guided_grammar),
            ]
        )
        return found

    def constraint(self) -> HttpConstraint | None:
        """The one constraint the body asks for; FieldError naming the second when it asks for more."""
        found = self.constraints()
        if len(found) > 1:
            names = ", ".join(c.param for c in found)
            raise FieldError(found[1].param, f"one structured-output constraint per request, got {names}")
        return found[0] if found else None

    def logprob_params(self) -> tuple[bool, int]:
        """(whether log-probabilities are asked for, how many alternatives per token)."""
        return False, 0

    def new_logprobs(self, spell: TokenBytes) -> ChoiceLogprobs | None:
        """The log-probabilities of one choice in the endpoint's format; None when not asked."""
        return None

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def sampling(self, max_tokens: int | None, field: str) -> pb.SamplingParams:
        """`max_tokens` None is sent as 0: open-ended, the rest of the context (see `validate_request`)."""
        if max_tokens is not None and max_tokens < 1:
            raise FieldError(field, f"must be at least 1, got {max_tokens}")
        sampling = pb.SamplingParams(
            max_new_tokens=0 if max_tokens is None else min(max_tokens, 0xFFFFFFFF),
            temperature=1.0 if self.temperature is None else _positive_stays(self.temperature),
            top_k=self.top_k,
            stop=self.stops(),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
        )
        sampling.stop_token_ids.extend(self.stop_token_ids)
        if not self.skip_special_tokens:
            sampling.skip_special_tokens = False
        sampling.include_stop_str_in_output = self.include_stop_str_in_output
        if self.top_p is not None:
            sampling.top_p = self.top_p
        if self.min_p is not None:
            sampling.min_p = self.min_p
        if self.seed is not None:
            sampling.seed = self.seed % UINT64
        self._penalties(sampling)
        sampling.logprobs, sampling.top_logprobs = self.logprob_params()
        if self.n is not None:
            sampling.n = _completions(self.n)
        if (constraint := self.constraint()) is not None:
            constraint.set_on(sampling)
        return sampling

    def _penalties(self, sampling: pb.SamplingParams) -> None:
        """Unset fields keep the proto's defaults: penalties 0, repetition_penalty 1 (off)."""
        if self.presence_penalty is not None:
            sampling.presence_penalty = self.presence_penalty
        if self.frequency_penalty is not None:
            sampling.frequency_penalty = self.frequency_penalty
        if self.repetition_penalty is not None:
            sampling.repetition_penalty = self.repetition_penalty
        if self.logit_bias:
            sampling.logit_bias.update(_logit_bias(self.logit_bias))

    @property
    def max_tokens_field(self) -> str:
        """The field the request bounded its answer with (chat has two names for it)."""
        return "max_tokens"

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Every chunk carries the usage so far (vLLM's `continuous_usage_stats`)."""
        return (
            self.include_usage
            and self.stream_options is not None
            and self.stream_options.continuous_usage_stats
        )


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, lt=UINT32)  # alternatives per token
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of not in (None, self.n or 1):
            raise FieldError("best_of", f"only n ({self.n or 1}) is supported, got {self.best_of}")
        if self.suffix:
            raise FieldError("suffix", "not supported")

    def logprob_params(self) -> tuple[bool, int]:
        return self.logprobs is not None, self.logprobs or 0

    @property
    def prompt_only(self) -> bool:
        """max_tokens 0 with echo: the prompt alone comes back (scored, with logprobs), as OpenAI's
        legacy completions did; one token is generated and left out."""
        return self.echo and self.max_tokens == 0

    @property
    def scores_prompt(self) -> bool:
        """echo with logprobs: the prompt's tokens come in `logprobs` too, each (but the first)
        with its log-probability given those before it, as OpenAI's legacy completions did."""
        return self.echo and self.logprobs is not None

    def new_logprobs(self, spell: TokenBytes) -> ChoiceLogprobs | None:
        return None if self.logprobs is None else CompletionLogprobs(spell)

    def to_proto(self) -> pb.GenerateRequest:
        """The request of a body with one prompt (FieldError for a list of several)."""
        requests = self.to_protos()
        if len(requests) != 1:
            raise FieldError("prompt", f"one prompt is served here, got {len(requests)}")
        return requests[0]

    def to_protos(self) -> list[pb.GenerateRequest]:
        """One request a prompt (a list of prompts is several), the same sampling for each."""
        self.check_supported()
        if self.max_tokens == 0 and not self.echo:
            raise FieldError("max_tokens", "must be at least 1 (0 only with echo), got 0")
        sampling = self.sampling(1 if self.prompt_only else self.max_tokens, "max_tokens")
        if self.scores_prompt:
            sampling.prompt_logprobs = self.logprobs or 0
        requests = []
        for prompt in self.prompts():
            request = pb.GenerateRequest(sampling=sampling)
            if isinstance(prompt, str):
                request.text = prompt
            else:
                request.input_ids.ids.extend(_token_ids(prompt))
            requests.append(request)
        return requests

    def echoed(self, decode: Callable[[list[int]], str]) -> list[str]:
        """The text `echo` puts before each choice's, a prompt each (`decode` spells a prompt of ids)."""
        if not self.echo:
            return ["" for _ in self.prompts()]
        return [prompt if isinstance(prompt, str) else decode(prompt) for prompt in self.prompts()]

    def prompts(self) -> list[str | list[int]]:
        """`prompt` as a list of prompts: a string or a list of ids is one."""
        prompt = self.prompt
        if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
            return [prompt]  # type: ignore[list-item]
        if len(prompt) > MAX_PROMPTS:
            raise FieldError("prompt", f"at most {MAX_PROMPTS} prompts a request, got {len(prompt)}")
        return list(prompt)


class TextPart(BaseModel):
    model_config = STRICT

    type: str
    text: str | None = None


class FunctionCallIn(BaseModel):
    model_config = STRICT

    name: str
    arguments: str  # a JSON object's text


class ToolCallIn(BaseModel):
    """A call of an assistant turn of the history, as a response gave it."""

    model_config = STRICT

    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessageIn(BaseModel):
    model_config = STRICT

    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    # An assistant turn's thinking as a response gave it (vLLM's newer name: `reasoning`)
    reasoning_content: str | None = None
    reasoning: str | None = None


class FunctionDef(BaseModel):
    model_config = STRICT

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = STRICT

    name: str


class NamedToolChoice(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessageIn]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, lt=UINT32)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # Accepted, as the Responses API accepts them: an end user's id (what `user` was), and a
    # caching hint, which the prefix cache, keyed by the prompt itself, does not need.
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: more variables for the template
    # vLLM's: false and true, the last (assistant) message is continued, its turn left open
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # SGLang's: false leaves a reasoning model's thinking in the content (tags and all)
    separate_reasoning: bool = True
    functions: list[Any] | None = None  # OpenAI's deprecated forms of tools: refused
    function_call: Any = None

    @property
    def max_tokens_field(self) -> str:
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"

    def logprob_params(self) -> tuple[bool, int]:
        return bool(self.logprobs), self.top_logprobs or 0

    def new_logprobs(self, spell: TokenBytes) -> ChoiceLogprobs | None:
        return ChatLogprobs(spell) if self.logprobs else None

    def check_supported(self) -> None:
        super().check_supported()
        for legacy in ("functions", "function_call"):
            if getattr(self, legacy) is not None:
                raise FieldError(legacy, "deprecated by OpenAI and not served: use tools and tool_choice")

    def to_proto(self) -> pb.GenerateRequest:
        self.check_supported()
        if self.max_completion_tokens is not None:
            sampling = self.sampling(self.max_completion_tokens, "max_completion_tokens")
        else:
            sampling = self.sampling(self.max_tokens, "max_tokens")
        request = pb.GenerateRequest(sampling=sampling)
        chat = request.messages
        chat_input(chat, self.messages, self.tools, self.chat_template_kwargs)
        prefill(chat, self.add_generation_prompt, self.continue_final_message)
        chat.separate_reasoning = self.separate_reasoning
        if isinstance(self.tool_choice, NamedToolChoice):
            chat.tool_choice.function = self.tool_choice.function.name
        elif self.tool_choice is not None:
            chat.tool_choice.mode = self.tool_choice
        if self.parallel_tool_calls is not None:
            chat.parallel_tool_calls = self.parallel_tool_calls
        return request


def chat_input(
    chat: pb.ChatMessages,
    messages: list[ChatMessageIn],
    tools: list[ToolDef] | None,
    template_kwargs: dict[str, Any] | None = None,
) -> None:
    """The messages, tools and template variables of a chat body, on a request's `messages` input."""
    chat.messages.extend(_message(m, i) for i, m in enumerate(messages))
    chat.tools.extend(_tool(t) for t in tools or [])
    if template_kwargs:
        chat.template_kwargs = json.dumps(template_kwargs)


def prefill(chat: pb.ChatMessages, add_generation_prompt: bool, continue_final_message: bool) -> None:
    """vLLM's two fields on a request's messages, where they are not the defaults."""
    if not add_generation_prompt:
        chat.add_generation_prompt = False
    chat.continue_final_message = continue_final_message


def _message(m: ChatMessageIn, index: int) -> pb.ChatMessage:
    calls = [
        pb.ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments) for c in m.tool_calls or []
    ]
    return pb.ChatMessage(
        role=_role(m.role),
        content=_content(m, index),
        tool_calls=calls,
        tool_call_id=m.tool_call_id or "",
        reasoning_content=m.reasoning_content or m.reasoning or "",
    )


def _tool(t: ToolDef) -> pb.Tool:
    f = t.function
    tool = pb.Tool(name=f.name, description=f.description or "")
    if f.parameters is not None:
        tool.parameters = json.dumps(f.parameters)
    if f.strict is not None:
        tool.strict = f.strict
    return tool


def _role(role: str) -> str:
    return "system" if role == "developer" else role  # OpenAI's newer name for system


def _content(message: ChatMessageIn, index: int) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    texts = []
    for j, part in enumerate(message.content):
        if part.type != "text" or part.text is None:
            raise FieldError(
                f"messages[{index}].content[{j}]", f"only text parts are served, got {part.type!r}"
            )
        texts.append(part.text)
    return "".join(texts)


def _positive_stays(temperature: float) -> float:
    """A positive temperature stays positive on the wire (float32 rounds 1e-50 to 0, greedy)."""
    return max(temperature, MIN_TEMPERATURE) if temperature > 0 else temperature


def _completions(n: int) -> int:
    """`n` as the proto holds it; the checks bound it further."""
    if not 0 <= n < UINT32:
        raise FieldError("n", f"must be in 1..{MAX_COMPLETIONS}, got {n}")
    return n


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    if len(bias) > MAX_LOGIT_BIAS:
        raise FieldError("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
    return {_bias_id(key): value for key, value in bias.items()}


def _bias_id(key: str) -> int:
    """A logit_bias key: a token id, written as a JSON object's key (a string)."""
    if not (key.isascii() and key.isdigit() and len(key) <= 10 and int(key) < UINT32):
        raise FieldError("logit_bias", f"{key[:24]!r} is not a token id (a non-negative integer)")
    return int(key)


def _token_ids(ids: list[int]) -> list[int]:
    for i, token in enumerate(ids):
        if not 0 <= token < (1 << 32):
            raise FieldError(f"prompt[{i}]", f"{token} is not a token id")
    return ids


def field_path(loc: tuple[int | str, ...]) -> str:
    """A pydantic error's location as the field's path (`messages[0].content`)."""
    name = ""
    for part in loc:
        if isinstance(part, int):
            name += f"[{part}]"
        elif not _is_union_branch(part):
            name += f".{part}" if name else part
    return name


def _is_union_branch(part: str) -> bool:
    """pydantic names the union member it tried (`str`, `list[int]`) in an error's location."""
    return part in {"str", "int", "float", "bool"} or "[" in part or part.startswith("function-")


def http_field(field: str, body: SamplingFields) -> str:
    """The HTTP API's name of a GenerateRequest field path (`sampling.temperature` -> temperature)."""
    if field.startswith(STRUCTURED_FIELD + ".") and (constraint := body.constraint()) is not None:
        return constraint.http_field(field)
    for pattern, name in TOOL_FIELDS:
        if (match := pattern.match(field)) is not None:
            return match.expand(name) + field[match.end() :]
    for path, name in HTTP_FIELDS.items():
        if field == path or field.startswith(path + "[") or field.startswith(path + "."):
            rest = field[len(path) :]
            if name == "prompt" and isinstance(body, ChatCompletionRequest):
                name = "messages"
            elif name == "max_tokens":
                name = body.max_tokens_field
            elif name == "top_logprobs" and isinstance(body, CompletionRequest):
                name = "logprobs"
            return (name + rest).lstrip(".") if name else rest.lstrip(".")
    return field


def http_message(message: str, field: str, body: SamplingFields) -> str:
    """A check's message with its field path renamed for the HTTP API."""
    renamed = http_field(field, body)
    if not message.startswith(field):
        return message
    return (renamed + message[len(field) :]).replace("max_new_tokens", body.max_tokens_field)


# ---- responses -----------------------------------------------------------------------------


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# A response's token counts: prompt, completion, prompt found cached, completion of the thinking
Counts = tuple[int, int, int, int]


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, reasoning_tokens: int = 0
) -> dict[str, Any]:
    """OpenAI's usage; `prompt_tokens_details.cached_tokens`: prompt tokens whose KV was reused;
    `completion_tokens_details.reasoning_tokens`: of the completion, a reasoning model's thinking
    (where it thought)."""
    counts: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if reasoning_tokens:
        counts["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return counts


def finish_name(reason: FinishReason | None) -> str | None:
    return None if reason is None else FINISH_REASONS[reason]


class ResponseIds:
    """The id, object names and creation time every body and chunk of one response shares."""

    def __init__(self, rid: str, model: str, endpoint: Literal["completions", "chat"]) -> None:
        self.rid = rid
        self.model = model
        self.chat = endpoint == "chat"
        self.created = int(time.time())

    def head(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.rid, "object": kind, "created": self.created, "model": self.model}

    def choice(
        self,
        index: int,
        text: str,
        finish: FinishReason | None,
        chunk: bool,
        logprobs: dict[str, Any] | None = None,
        calls: Sequence[CallDelta] = (),
        stop_reason: str | int | None = None,
        reasoning: str = "",
    ) -> dict[str, Any]:
        """A choice of a body (`calls`: all its calls' deltas) or of a chunk (those new);
        `stop_reason` (vLLM's): the stop string or stop token id that ended it, else null;
        `reasoning`: a reasoning model's thinking (all of it, or that new), as
        `reasoning_content` (DeepSeek's, SGLang's and vLLM's older name) and `reasoning` (vLLM's
        newer) on a message or delta that has any."""
        choice: dict[str, Any] = {
            "index": index,
            "logprobs": logprobs,
            "finish_reason": finish_name(finish),
            "stop_reason": stop_reason,
        }
        if not self.chat:
            choice["text"] = text
        elif chunk:
            delta: dict[str, Any] = {"content": text} if text else {}
            if reasoning:
                delta.update(reasoning_content=reasoning, reasoning=reasoning)
            if calls:
                delta["tool_calls"] = chunk_calls(calls)
            choice["delta"] = delta
        else:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if calls or reasoning:  # OpenAI's reply that only calls has content null
                message["content"] = text or None
            if reasoning:
                message.update(reasoning_content=reasoning, reasoning=reasoning)
            if calls:
                message["tool_calls"] = [whole_call(c) for c in merge_deltas(calls)]
            choice["message"] = message
        return choice

    def body(self, choices: list[dict[str, Any]], counts: Counts) -> dict[str, Any]:
        return {**self.head(False), "choices": choices, "usage": usage(*counts)}

    def chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        return {**self.head(True), "choices": [choice]}

    def role_chunk(self, index: int) -> dict[str, Any]:
        """A chat stream's first chunk of each choice: the assistant's role."""
        choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
        return {**self.head(True), "choices": [{**choice, "finish_reason": None, "stop_reason": None}]}

    def usage_chunk(self, counts: Counts) -> dict[str, Any]:
        return {**self.head(True), "choices": [], "usage": usage(*counts)}


def whole_call(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def chunk_calls(deltas: Sequence[CallDelta]) -> list[dict[str, Any]]:
    """A chunk's `delta.tool_calls`: one entry per call the deltas touch, in order; a call's
    first entry carries its id, type and name, every entry a fragment of its arguments."""
    entries: dict[int, dict[str, Any]] = {}
    for d in deltas:
        entry = entries.setdefault(d.index, {"index": d.index, "function": {"arguments": ""}})
        if d.name:
            entry.update({"id": d.id, "type": "function"})
            entry["function"] = {"name": d.name, "arguments": entry["function"]["arguments"]}
        entry["function"]["arguments"] += d.arguments
    return list(entries.values())


# ---- log-probabilities ---------------------------------------------------------------------

TokenBytes = Callable[[int], bytes]  # a token id's bytes (`Tokenizer.token_bytes`)


def token_text(raw: bytes) -> str:
    """A token's string in the log-probabilities: its bytes as UTF-8, with U+FFFD for each
    byte that is not part of a whole character in them (a token may hold part of one, as
    byte-level tokens do; the chat format's `bytes` keeps them all)."""
    return raw.decode("utf-8", errors="replace")


def json_logprob(logprob: float) -> float:
    return logprob if logprob >= MIN_LOGPROB else MIN_LOGPROB  # NaN compares false: MIN too


class ChoiceLogprobs(Protocol):
    def format(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob | None]) -> dict[str, Any]:
        """The `logprobs` of a choice (or chunk) that carries these tokens: one entry per
        token that has its log-probabilities (a backend that computes none sends none); None:
        a token that has none (an echoed prompt's first)."""
        ...


class ChatLogprobs:
    """Chat's format: `content`, one entry per token, its alternatives most likely first."""

    def __init__(self, spell: TokenBytes) -> None:
        self._spell = spell

    def format(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob | None]) -> dict[str, Any]:
        content = [self._entry(token, lp) for token, lp in zip(token_ids, logprobs, strict=False) if lp]
        return {"content": content, "refusal": None}

    def _entry(self, token: int, lp: TokenLogprob) -> dict[str, Any]:
        top = [self._token(i, v) for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)]
        return {**self._token(token, lp.logprob), "top_logprobs": top}

    def _token(self, token: int, logprob: float) -> dict[str, Any]:
        raw = self._spell(token)
        return {"token": token_text(raw), "logprob": json_logprob(logprob), "bytes": list(raw)}


class CompletionLogprobs:
    """The completions endpoint's (OpenAI's legacy) format: parallel lists. `top_logprobs`
    maps token strings to log-probabilities and always holds the sampled token, as OpenAI
    and vLLM return it; where tokens share a string, the likeliest one's value is kept.
    `text_offset` is the character of the choice's text where each token starts (kept across
    the chunks of a stream)."""

    def __init__(self, spell: TokenBytes) -> None:
        self._spell = spell
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._chars = 0  # characters the bytes so far complete

    def format(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob | None]) -> dict[str, Any]:
        lists: dict[str, list[Any]] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for token, lp in zip(token_ids, logprobs, strict=False):
            raw = self._spell(token)
            text = token_text(raw)
            lists["tokens"].append(text)
            if lp is None:  # an echoed prompt's first token: nothing before it to condition on
                lists["token_logprobs"].append(None)
                lists["top_logprobs"].append(None)
            else:
                logprob = json_logprob(lp.logprob)
                lists["token_logprobs"].append(logprob)
                lists["top_logprobs"].append(self._top(lp, text, logprob))
            lists["text_offset"].append(self._text_offset(raw))
        return lists

    def _top(self, lp: TokenLogprob, text: str, logprob: float) -> dict[str, float]:
        top: dict[str, float] = {}
        for token, value in zip(lp.top_ids, lp.top_logprobs, strict=True):
            top.setdefault(token_text(self._spell(token)), json_logprob(value))
        top.setdefault(text, logprob)
        return top

    def _text_offset(self, raw: bytes) -> int:
        """The characters before the token, counting an unfinished one that the token does
        not continue as the U+FFFD it becomes."""
        unfinished = self._utf8.getstate()[0]
        offset = self._chars
        if unfinished and not (raw and UTF8_CONTINUATION[0] <= raw[0] <= UTF8_CONTINUATION[1]):
            offset += 1
        self._chars += len(self._utf8.decode(raw))
        return offset
