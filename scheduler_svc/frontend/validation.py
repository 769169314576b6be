"""Checks of a GenerateRequest; each failure names the offending field.

Everything a client sends is bounded here before any work is spent on it: sizes are checked
before text is tokenized and before ids are scanned, so a hostile request costs at most a parse.
A structured-output constraint is compiled last, once every cheap check has passed: it is the
costliest one (milliseconds, up to seconds for a large schema).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar, cast

from google.protobuf import descriptor, descriptor_pb2, descriptor_pool, message, message_factory

from scheduler_svc.contract import (
    MAX_COMPLETIONS,
    MAX_LOGIT_BIAS,
    MAX_TOP_LOGPROBS,
    MIN_TEMPERATURE,
    SamplingParams,
)
from scheduler_svc.frontend.chat import RESERVED_VARIABLES, ChatMessage, ChatTemplate, ChatTemplateError
from scheduler_svc.frontend.reasoning import starts_inside, tag_tokens
from scheduler_svc.frontend.tokenizer import Tokenizer
from scheduler_svc.frontend.tools import (
    ANY_ARGUMENTS,
    CallFormat,
    Tool,
    ToolCall,
    ToolChoice,
    ToolError,
    call_tags,
    check_tools,
    compile_tools,
    tool_constraint,
)
from stepahead.grammars import (
    ANY_JSON_OBJECT,
    GrammarError,
    compile_constraint,
    is_cached,
    thinking_constraint,
)
from stepahead.protocol import MAX_CONSTRAINT_BYTES, Constraint, ConstraintKind, WorkerInfo
from stepahead.v1 import generation_pb2

MAX_REQUEST_ID_CHARS = 256
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
DEFAULT_MAX_TEXT_BYTES = 1 << 20
DEFAULT_MAX_REQUEST_BYTES = 4 << 20  # a whole request message or HTTP body
MAX_CHAT_MESSAGES = 1024
CHAT_ROLES = ("system", "user", "assistant", "tool")
MESSAGES_FIELD = "input.messages.messages"
TOOLS_PREFIX = "input.messages."  # of the tools' fields: input.messages.tools[0].name
CHOICE_MODES = ("none", "auto", "required")
MAX_PENALTY = 2.0  # presence and frequency, as OpenAI bounds them
MAX_BIAS = 100.0
MAX_CHOICES = 1024
STRUCTURED_FIELD = "sampling.structured"

M = TypeVar("M", bound=message.Message)


class InvalidRequest(ValueError):
    """The request cannot be served as sent (INVALID_ARGUMENT); the message starts with the field."""

    @property
    def field(self) -> str:
        return str(self).split(":", 1)[0]


class NoChatTemplate(ValueError):
    """A conversation, for a model without a chat template (FAILED_PRECONDITION)."""


@dataclass(frozen=True)
class RequestLimits:
    """Operator-set bounds on one request's input."""

    max_text_bytes: int = DEFAULT_MAX_TEXT_BYTES
    max_prompt_tokens: int = 0  # 0: the model's context length


default_limits = RequestLimits()


@dataclass(frozen=True)
class Compiled:
    """A request's constraint, compiled: what the frontend's metrics count."""

    kind: ConstraintKind
    seconds: float  # the compile's (a lookup's, when cached)
    cached: bool


@dataclass(frozen=True)
class ValidRequest:
    prompt_ids: list[int]
    params: SamplingParams
    n: int = 1  # completions of the prompt
    compiled: Compiled | None = None  # None: unconstrained
    calls: CallFormat | None = None  # replies are parsed for tool calls in this format (None: not)
    # Replies' thinking split from their text, starting inside it if True (None: not split)
    reasoning: bool | None = None


def validate_request(
    request: generation_pb2.GenerateRequest,
    tokenizer: Tokenizer,
    info: WorkerInfo,
    seed: int,
    limits: RequestLimits = default_limits,
    chat: ChatTemplate | None = None,
    open_ended: bool = False,
    capped: bool = False,
) -> ValidRequest:
    """`seed` is used when the request brings none; `chat` renders a `messages` input. With
    `open_ended`, a max_new_tokens of 0 means as many as the context and KV pool leave room for;
    with `capped`, max_new_tokens is a cap: at most what they leave (Anthropic's `max_tokens`)."""
    _check_request_id(request.request_id)
    max_prompt_tokens = limits.max_prompt_tokens or info.max_context_len
    source = PromptSource(tokenizer, chat, limits.max_text_bytes, max_prompt_tokens)
    tools = tool_request(request)  # checked once: they are rendered, then compiled
    prompt_ids, rendered = _prompt(request, source, info.vocab_size, tools)
    sampling = request.sampling
    if (open_ended and sampling.max_new_tokens == 0) or capped:
        sampling = _with_room_left(sampling, len(prompt_ids), info)
    fmt = chat.call_format if chat is not None else None
    tags = None if fmt is None or tools is None else call_tags(fmt, tokenizer)
    requested = _one_constraint(requested_constraint(sampling), tools, fmt, tags)
    params = _sampling_params(sampling, info.vocab_size, seed, requested)
    _check_fits(len(prompt_ids), params.max_new_tokens, info)
    n = _completions(sampling)
    if requested is not None and info.structured_outputs_unavailable:
        raise InvalidRequest(
            f"{requested.field}: not served with this model: {info.structured_outputs_unavailable}"
        )
    compiled = None if requested is None else _compile(requested)  # the costliest check, last
    calls = fmt if requested is not None and requested.tools is not None else None
    reasoning = _reasoning(request, chat, rendered)
    if reasoning is not None and params.constraint is not None:
        # the answer is held to the constraint, the thinking before it free (compiled: the
        # answer's grammar is cached, and the worker compiles the same). Tool choice `auto` too:
        # its free text is text, and the thinking's tags may be tokens (Qwen3's), never text.
        thinking = thinking_constraint(params.constraint, reasoning, tag_tokens(tokenizer))
        compile_constraint(thinking)
        params = dataclasses.replace(params, constraint=thinking)
    return ValidRequest(prompt_ids, params, n, compiled, calls, reasoning)


def _reasoning(
    request: generation_pb2.GenerateRequest, chat: ChatTemplate | None, rendered: str
) -> bool | None:
    """Whether a chat reply's thinking is split from its text, and whether it starts inside it
    (None: not split)."""
    if not rendered or chat is None or not chat.thinks or not request.messages.separate_reasoning:
        return None
    return starts_inside(rendered)


def prompt_ids(
    request: generation_pb2.GenerateRequest,
    tokenizer: Tokenizer,
    info: WorkerInfo,
    limits: RequestLimits = default_limits,
    chat: ChatTemplate | None = None,
) -> list[int]:
    """The prompt ids of a request's input (text, ids or chat messages with their tools),
    checked as a generation's are; its sampling is not looked at (/tokenize)."""
    max_prompt_tokens = limits.max_prompt_tokens or info.max_context_len
    source = PromptSource(tokenizer, chat, limits.max_text_bytes, max_prompt_tokens)
    return _prompt(request, source, info.vocab_size, tool_request(request))[0]


def _with_room_left(
    sampling: generation_pb2.SamplingParams, prompt_len: int, info: WorkerInfo
) -> generation_pb2.SamplingParams:
    room = min(info.max_context_len, info.kv_slots) - prompt_len
    if room < 1:
        raise InvalidRequest(f"input: the prompt ({prompt_len} tokens) leaves no room for an answer")
    filled = generation_pb2.SamplingParams()
    filled.CopyFrom(sampling)
    filled.max_new_tokens = min(room, sampling.max_new_tokens) if sampling.max_new_tokens else room
    return filled


def _check_request_id(rid: str) -> None:
    if len(rid) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(f"request_id: at most {MAX_REQUEST_ID_CHARS} characters, got {len(rid)}")
    for i, char in enumerate(rid):
        if not char.isprintable():  # control, format, line-break or unassigned characters
            raise InvalidRequest(f"request_id: must be printable, got U+{ord(char):04X} at index {i}")


@dataclass(frozen=True)
class PromptSource:
    """What turns a request's input into prompt ids, and its bounds."""

    tokenizer: Tokenizer
    chat: ChatTemplate | None
    max_text_bytes: int
    max_prompt_tokens: int


def _prompt(
    request: generation_pb2.GenerateRequest, source: PromptSource, vocab: int, tools: ToolRequest | None
) -> tuple[list[int], str]:
    """The prompt's ids, and its text as the chat template rendered it ("" for other inputs)."""
    which = request.WhichOneof("input")
    if which is None:
        raise InvalidRequest("input: set text, input_ids or messages")
    if which == "text":
        return _text_ids(request.text, source), ""
    if which == "messages":
        return _chat_ids(request.messages, source, () if tools is None else tools.tools)
    if not request.input_ids.ids:
        raise InvalidRequest("input.input_ids.ids: must not be empty")
    _check_prompt_length(len(request.input_ids.ids), "input.input_ids.ids", source.max_prompt_tokens)
    ids = list(request.input_ids.ids)
    _check_in_vocab(ids, "input.input_ids.ids", vocab)
    return ids, ""


def _text_ids(text: str, source: PromptSource) -> list[int]:
    if not text:
        raise InvalidRequest("input.text: must not be empty")
    _check_text_size(len(text.encode()), "input.text", source.max_text_bytes)
    ids = source.tokenizer.encode(text)
    if not ids:
        raise InvalidRequest("input.text: encodes to no tokens")
    _check_prompt_length(len(ids), "input.text", source.max_prompt_tokens)
    return ids


def _template_kwargs(text: str, max_bytes: int) -> dict[str, object]:
    """A request's extra chat-template variables: a JSON object, bounded, naming none of the
    variables the request sets otherwise."""
    if not text:
        return {}
    field = "input.messages.template_kwargs"
    _check_text_size(len(text.encode()), field, max_bytes)
    try:
        kwargs = json.loads(text)
    except ValueError as exc:
        raise InvalidRequest(f"{field}: not JSON: {exc}") from None
    if not isinstance(kwargs, dict):
        raise InvalidRequest(f"{field}: must be a JSON object")
    for name in kwargs:
        if name in RESERVED_VARIABLES:
            raise InvalidRequest(f"{field}.{name}: set by the request itself, not here")
    return kwargs


def _chat_ids(
    chat: generation_pb2.ChatMessages, source: PromptSource, tools: tuple[Tool, ...] = ()
) -> tuple[list[int], str]:
    """The ids and the rendered text; checked before rendering: the sizes bound what the
    template is given."""
    if source.chat is None:
        raise NoChatTemplate(
            "input.messages: the model has no chat template: send a prompt (gRPC text or input_ids; "
            "HTTP /v1/completions), or serve it with --chat-template FILE"
        )
    checked = _check_chat_messages(list(chat.messages), source.max_text_bytes)
    opens_reply = not chat.HasField("add_generation_prompt") or chat.add_generation_prompt
    if chat.continue_final_message and opens_reply:
        raise InvalidRequest(
            "input.messages.continue_final_message: the last message is continued only with "
            "add_generation_prompt false (the reply is its turn's rest, not a turn of its own)"
        )
    tools_size = sum(len(t.name) + len(t.description.encode()) + len(t.parameters.encode()) for t in tools)
    # Their schemas become the grammar's text, bounded as a constraint's is.
    _check_text_size(tools_size, f"{TOOLS_PREFIX}tools", MAX_CONSTRAINT_BYTES)
    try:
        text = source.chat.render(
            checked,
            opens_reply,
            tools,
            _template_kwargs(chat.template_kwargs, source.max_text_bytes),
            chat.continue_final_message,
        )
    except ChatTemplateError as exc:
        raise InvalidRequest(f"input.messages: the chat template refused them: {exc}") from exc
    ids = source.tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise InvalidRequest("input.messages: renders to no tokens")
    _check_prompt_length(len(ids), "input.messages", source.max_prompt_tokens)
    return ids, text


def _check_chat_messages(messages: list[generation_pb2.ChatMessage], max_bytes: int) -> list[ChatMessage]:
    field = MESSAGES_FIELD
    if not messages:
        raise InvalidRequest(f"{field}: must not be empty")
    if len(messages) > MAX_CHAT_MESSAGES:
        raise InvalidRequest(f"{field}: at most {MAX_CHAT_MESSAGES} messages, got {len(messages)}")
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise InvalidRequest(f"{field}[{i}].role: must be one of {', '.join(CHAT_ROLES)}; got {m.role!r}")
        if m.tool_calls and m.role != "assistant":
            raise InvalidRequest(
                f"{field}[{i}].tool_calls: only an assistant turn makes calls, not {m.role!r}"
            )
    size = sum(
        len(m.content.encode()) + len(m.reasoning_content.encode()) + sum(c.ByteSize() for c in m.tool_calls)
        for m in messages
    )
    _check_text_size(size, field, max_bytes)
    return [
        ChatMessage(
            m.role,
            m.content,
            _history_calls(m.tool_calls, f"{field}[{i}]"),
            m.tool_call_id,
            m.reasoning_content,
        )
        for i, m in enumerate(messages)
    ]


def _history_calls(calls: Iterable[generation_pb2.ToolCall], field: str) -> tuple[ToolCall, ...]:
    """An assistant turn's calls, as the template gets them (their arguments as objects)."""
    for j, call in enumerate(calls):
        where = f"{field}.tool_calls[{j}]"
        if not call.name:
            raise InvalidRequest(f"{where}.name: must not be empty")
        try:
            arguments = json.loads(call.arguments)
        except ValueError as exc:
            raise InvalidRequest(f"{where}.arguments: not JSON: {exc}") from None
        if not isinstance(arguments, dict):
            raise InvalidRequest(f"{where}.arguments: must be a JSON object")
    return tuple(ToolCall(c.name, c.arguments, c.id) for c in calls)


def _check_text_size(size: int, field: str, max_text_bytes: int) -> None:
    if size > max_text_bytes:
        raise InvalidRequest(f"{field}: at most {max_text_bytes} bytes of UTF-8, got {size}")


def _check_prompt_length(num_tokens: int, field: str, max_prompt_tokens: int) -> None:
    if num_tokens > max_prompt_tokens:
        raise InvalidRequest(f"{field}: a prompt has at most {max_prompt_tokens} tokens, got {num_tokens}")


def _check_in_vocab(ids: list[int], field: str, vocab: int) -> None:
    for i, token in enumerate(ids):
        if token >= vocab:
            raise InvalidRequest(f"{field}[{i}]: {token} is outside the vocabulary (0..{vocab - 1})")


def _sampling_params(
    p: generation_pb2.SamplingParams, vocab: int, seed: int, requested: RequestedConstraint | None
) -> SamplingParams:
    if p.max_new_tokens < 1:
        raise InvalidRequest("sampling.max_new_tokens: must be at least 1")
    if not math.isfinite(p.temperature) or p.temperature < 0:
        raise InvalidRequest(f"sampling.temperature: must be a finite number >= 0, got {p.temperature}")
    top_p = p.top_p if p.HasField("top_p") else 1.0
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise InvalidRequest(f"sampling.top_p: must be in (0, 1], got {top_p}")
    min_p = p.min_p if p.HasField("min_p") else 0.0
    if not (math.isfinite(min_p) and 0 <= min_p <= 1):
        raise InvalidRequest(f"sampling.min_p: must be in [0, 1], got {min_p}")
    _check_stop_token_ids(list(p.stop_token_ids), vocab)
    _check_stop_strings(list(p.stop))
    return SamplingParams(
        max_new_tokens=p.max_new_tokens,
        temperature=p.temperature and max(p.temperature, MIN_TEMPERATURE),  # 0: greedy
        top_p=top_p,
        top_k=p.top_k,
        seed=p.seed if p.HasField("seed") else seed,
        stop_token_ids=frozenset(p.stop_token_ids),
        stop=tuple(p.stop),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs,
        top_logprobs=_top_logprobs(p),
        repetition_penalty=_repetition_penalty(p),
        presence_penalty=_output_penalty(p.presence_penalty, "sampling.presence_penalty"),
        frequency_penalty=_output_penalty(p.frequency_penalty, "sampling.frequency_penalty"),
        min_tokens=_min_tokens(p),
        logit_bias=_logit_bias(dict(p.logit_bias), vocab),
        constraint=None if requested is None else _bounded_constraint(requested, p),
        skip_special_tokens=p.skip_special_tokens if p.HasField("skip_special_tokens") else True,
        include_stop_str=p.include_stop_str_in_output,
        min_p=min_p,
        prompt_logprobs=_prompt_logprobs(p),
    )


def _prompt_logprobs(p: generation_pb2.SamplingParams) -> int | None:
    if not p.HasField("prompt_logprobs"):
        return None
    if p.prompt_logprobs > MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"sampling.prompt_logprobs: at most {MAX_TOP_LOGPROBS}, got {p.prompt_logprobs}")
    return p.prompt_logprobs


def _top_logprobs(p: generation_pb2.SamplingParams) -> int:
    if p.top_logprobs > MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"sampling.top_logprobs: at most {MAX_TOP_LOGPROBS}, got {p.top_logprobs}")
    if p.top_logprobs and not p.logprobs:
        raise InvalidRequest("sampling.top_logprobs: only with logprobs set")
    return p.top_logprobs


def _repetition_penalty(p: generation_pb2.SamplingParams) -> float:
    penalty = p.repetition_penalty if p.HasField("repetition_penalty") else 1.0
    if not (math.isfinite(penalty) and penalty > 0):
        raise InvalidRequest(f"sampling.repetition_penalty: must be a finite number > 0, got {penalty}")
    return penalty


def _output_penalty(penalty: float, field: str) -> float:
    if not (math.isfinite(penalty) and -MAX_PENALTY <= penalty <= MAX_PENALTY):
        raise InvalidRequest(f"{field}: must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {penalty}")
    return penalty


def _min_tokens(p: generation_pb2.SamplingParams) -> int:
    if p.min_tokens > p.max_new_tokens:
        raise InvalidRequest(
            f"sampling.min_tokens: at most max_new_tokens ({p.max_new_tokens}), got {p.min_tokens}"
        )
    return p.min_tokens


def _logit_bias(bias: dict[int, float], vocab: int) -> tuple[tuple[int, float], ...]:
    field = "sampling.logit_bias"
    if len(bias) > MAX_LOGIT_BIAS:
        raise InvalidRequest(f"{field}: at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
    for token, value in sorted(bias.items()):
        if token >= vocab:
            raise InvalidRequest(f"{field}[{token}]: {token} is outside the vocabulary (0..{vocab - 1})")
        if not (math.isfinite(value) and -MAX_BIAS <= value <= MAX_BIAS):
            raise InvalidRequest(f"{field}[{token}]: must be in [-{MAX_BIAS:g}, {MAX_BIAS:g}], got {value}")
    return tuple(sorted(bias.items()))


def _completions(p: generation_pb2.SamplingParams) -> int:
    n = p.n if p.HasField("n") else 1
    if not 1 <= n <= MAX_COMPLETIONS:
        raise InvalidRequest(f"sampling.n: must be in 1..{MAX_COMPLETIONS}, got {n}")
    return n


def _check_stop_token_ids(ids: list[int], vocab: int) -> None:
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(f"sampling.stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}")
    _check_in_vocab(ids, "sampling.stop_token_ids", vocab)


def _check_stop_strings(stops: list[str]) -> None:
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"sampling.stop: at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
    for i, stop in enumerate(stops):
        if not stop:
            raise InvalidRequest(f"sampling.stop[{i}]: must not be empty")
        if len(stop) > MAX_STOP_CHARS:
            raise InvalidRequest(f"sampling.stop[{i}]: at most {MAX_STOP_CHARS} characters, got {len(stop)}")


# ---- structured output ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestedConstraint:
    """The constraint a request asks for, as sent (not checked yet), and the field that sends it."""

    field: str  # as the checks name it: `sampling.structured.regex`
    constraint: Constraint
    tools: ToolRequest | None = None  # the tools whose calls `constraint` holds the reply to


def constraint_field(which: str) -> str:
    """The path the checks name a member of the `structured` oneof by (a choice: by its list)."""
    path = f"{STRUCTURED_FIELD}.{which}"
    return f"{path}.choices" if which == "choice" else path


def requested_constraint(p: generation_pb2.SamplingParams) -> RequestedConstraint | None:
    """The `structured` oneof as a Constraint; None when unset or `json_object` is false."""
    which = p.WhichOneof("structured")
    if which is None or (which == "json_object" and not p.json_object):
        return None
    field = constraint_field(which)
    if which == "json_object":
        return RequestedConstraint(field, Constraint("json", ANY_JSON_OBJECT))
    if which == "choice":
        return RequestedConstraint(field, Constraint("choice", json.dumps(list(p.choice.choices))))
    if which == "json_schema":
        return RequestedConstraint(field, Constraint("json", p.json_schema))
    if which == "regex":
        return RequestedConstraint(field, Constraint("regex", p.regex))
    return RequestedConstraint(field, Constraint("grammar", p.grammar))


def needs_compiling(request: generation_pb2.GenerateRequest) -> bool:
    """Whether checking `request` may compile a constraint (one not in the cache): milliseconds
    to seconds of CPU, work for a thread rather than an event loop. Tools: always taken as so."""
    requested = requested_constraint(request.sampling)
    if requested is not None and not is_cached(requested.constraint):
        return True
    return request.WhichOneof("input") == "messages" and len(request.messages.tools) > 0


def _bounded_constraint(requested: RequestedConstraint, p: generation_pb2.SamplingParams) -> Constraint:
    """Sizes checked before anything is compiled."""
    field, constraint = requested.field, requested.constraint
    if constraint.kind == "choice":
        _check_choices(list(p.choice.choices), field)
    elif not constraint.text:
        raise InvalidRequest(f"{field}: must not be empty")
    _check_text_size(len(constraint.text.encode()), field, MAX_CONSTRAINT_BYTES)
    return constraint


def _check_choices(choices: list[str], field: str) -> None:
    if not choices:
        raise InvalidRequest(f"{field}: must not be empty")
    if len(choices) > MAX_CHOICES:
        raise InvalidRequest(f"{field}: at most {MAX_CHOICES} choices, got {len(choices)}")
    for i, choice in enumerate(choices):
        if not choice:
            raise InvalidRequest(f"{field}[{i}]: must not be empty")


def _compile(requested: RequestedConstraint) -> Compiled:
    """Compiled (or found in the cache) before admission, so that a constraint that does not compile
    is refused naming its field rather than failing on the worker."""
    cached = is_cached(requested.constraint)
    start = time.perf_counter()
    try:
        if requested.tools is not None:
            compile_tools(list(requested.tools.tools), requested.constraint, TOOLS_PREFIX)
        else:
            compile_constraint(requested.constraint)
    except ToolError as exc:
        raise InvalidRequest(str(exc)) from exc
    except GrammarError as exc:
        raise InvalidRequest(f"{requested.field}: {str(exc).strip()}") from exc
    return Compiled(requested.constraint.kind, time.perf_counter() - start, cached)


# ---- tools -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolRequest:
    """The tools a conversation offers and how the reply may call them, checked (not compiled)."""

    tools: tuple[Tool, ...]
    choice: ToolChoice
    parallel: bool


def tool_request(request: generation_pb2.GenerateRequest) -> ToolRequest | None:
    """None when the input is no conversation, or one that offers no tools and sets no choice."""
    if request.WhichOneof("input") != "messages":
        return None
    chat = request.messages
    if not chat.tools and not chat.HasField("tool_choice"):
        return None
    tools = tuple(
        Tool(t.name, t.description, t.parameters or ANY_ARGUMENTS, t.strict if t.HasField("strict") else True)
        for t in chat.tools
    )
    choice = _tool_choice(chat)
    parallel = chat.parallel_tool_calls if chat.HasField("parallel_tool_calls") else True
    try:
        check_tools(list(tools), choice, TOOLS_PREFIX)
    except ToolError as exc:
        raise InvalidRequest(str(exc)) from exc
    return ToolRequest(tools, choice, parallel)


def _tool_choice(chat: generation_pb2.ChatMessages) -> ToolChoice:
    which = chat.tool_choice.WhichOneof("choice")
    if which is None:
        return ToolChoice("auto")
    if which == "function":
        return ToolChoice("named", chat.tool_choice.function)
    mode = chat.tool_choice.mode
    if mode not in CHOICE_MODES:
        raise InvalidRequest(
            f"{TOOLS_PREFIX}tool_choice.mode: must be one of {', '.join(CHOICE_MODES)}; got {mode!r}"
        )
    return ToolChoice(mode)  # type: ignore[arg-type]


def _one_constraint(
    structured: RequestedConstraint | None,
    tools: ToolRequest | None,
    fmt: CallFormat | None,
    tags: tuple[int, int] | None = None,
) -> RequestedConstraint | None:
    """The constraint the reply is held to: its `structured` one, or its tools' calls (one per
    request: a reply is either); `tags`: the call tags' token ids (`call_tags`)."""
    calls = (
        None if tools is None else tool_constraint(list(tools.tools), tools.choice, tools.parallel, fmt, tags)
    )
    if calls is None:
        return structured
    if structured is not None:
        raise InvalidRequest(
            f"{structured.field}: a reply that may call tools is held to their calls already; "
            "set tool_choice 'none' to constrain the reply otherwise"
        )
    return RequestedConstraint(f"{TOOLS_PREFIX}tools", calls, tools)


def _check_fits(prompt_len: int, max_new_tokens: int, info: WorkerInfo) -> None:
    total = prompt_len + max_new_tokens
    if total > info.max_context_len:
        raise InvalidRequest(
            f"sampling.max_new_tokens: prompt ({prompt_len} tokens) + max_new_tokens "
            f"({max_new_tokens}) exceeds the model's context length (max_model_len) {info.max_context_len}"
        )
    if total > info.kv_slots:
        raise InvalidRequest(
            f"sampling.max_new_tokens: prompt ({prompt_len} tokens) + max_new_tokens "
            f"({max_new_tokens}) exceeds the KV pool of {info.kv_slots} tokens"
        )


# ---- parsing ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class UnparsableRequest:
    """What the deserializer hands the handler in place of a message it could not parse."""

    reason: str  # starts with the field path, like InvalidRequest


def lenient_deserializer(message_class: type[M]) -> Callable[[bytes], M | UnparsableRequest]:
    """A request deserializer that never raises: a payload protobuf rejects becomes an
    UnparsableRequest naming the string field with bad UTF-8, or the request as a whole."""
    real = cast(descriptor.Descriptor, message_class.DESCRIPTOR)
    mirror = _bytes_mirror(real)

    def deserialize(payload: bytes) -> M | UnparsableRequest:
        try:
            return message_class.FromString(payload)
        except message.DecodeError:
            return UnparsableRequest(_parse_failure(payload, mirror, real))

    return deserialize


def _parse_failure(payload: bytes, mirror: type[message.Message], real: descriptor.Descriptor) -> str:
    try:
        raw = mirror.FromString(payload)
    except message.DecodeError:
        return f"request: cannot be parsed as {real.full_name}"
    bad_utf8 = next(_bad_utf8_paths(raw, real), None)
    if bad_utf8 is None:
        return f"request: cannot be parsed as {real.full_name}"
    return f"{bad_utf8}: not valid UTF-8"


def _bytes_mirror(real: descriptor.Descriptor) -> type[message.Message]:
    """The message `real` with every string field declared as bytes, in a pool of its own: it
    parses every payload `real` parses, plus those whose only fault is malformed UTF-8."""
    file_proto = descriptor_pb2.FileDescriptorProto()
    real.file.CopyToProto(file_proto)
    for message_proto in _all_message_protos(file_proto.message_type):
        for field in message_proto.field:
            if field.type == descriptor_pb2.FieldDescriptorProto.TYPE_STRING:
                field.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file_proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(real.full_name))


def _all_message_protos(
    messages: Iterable[descriptor_pb2.DescriptorProto],
) -> Iterator[descriptor_pb2.DescriptorProto]:
    for message_proto in messages:
        yield message_proto
        yield from _all_message_protos(message_proto.nested_type)


def _bad_utf8_paths(raw: message.Message, real: descriptor.Descriptor, prefix: str = "") -> Iterator[str]:
    """Paths (`input.text`, `sampling.stop[3]`) of the string fields of `real` whose bytes in
    its mirror `raw` are not UTF-8."""
    for raw_field, value in raw.ListFields():
        field = real.fields_by_name[raw_field.name]
        name = _path_name(field)
        items = list(value) if field.is_repeated else [value]
        for i, item in enumerate(items):
            path = f"{prefix}{name}[{i}]" if field.is_repeated else f"{prefix}{name}"
            if field.type == descriptor.FieldDescriptor.TYPE_STRING and not _is_utf8(item):
                yield path
            elif field.message_type is not None:
                yield from _bad_utf8_paths(item, field.message_type, path + ".")


def _path_name(field: descriptor.FieldDescriptor) -> str:
    """A member of a oneof is named through it (`input.text`), as the validation messages do; the
    one-field oneof protoc makes for a proto3 `optional` field (`_top_p`) is not a real one."""
    oneof = field.containing_oneof
    if oneof is None or (len(oneof.fields) == 1 and oneof.name == f"_{field.name}"):
        return field.name
    return f"{oneof.name}.{field.name}"


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True
