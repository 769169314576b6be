"""Checks of a GenerateRequest; each failure names the offending field.

Everything a client sends is bounded here before any work is spent on it: sizes are checked
before text is tokenized and before ids are scanned, so a hostile request costs at most a parse.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar, cast

from google.protobuf import descriptor, descriptor_pb2, descriptor_pool, message, message_factory

from scheduler_svc.request import SamplingParams
from scheduler_svc.tokenizer import Tokenizer
from stepahead.protocol import WorkerInfo
from stepahead.v1 import generation_pb2

MAX_REQUEST_ID_CHARS = 256
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
DEFAULT_MAX_TEXT_BYTES = 1 << 20

M = TypeVar("M", bound=message.Message)


class InvalidRequest(ValueError):
    """The request cannot be served as sent (INVALID_ARGUMENT)."""


@dataclass(frozen=True)
class RequestLimits:
    """Operator-set bounds on one request's input."""

    max_text_bytes: int = DEFAULT_MAX_TEXT_BYTES
    max_prompt_tokens: int = 0  # 0: the model's context length


default_limits = RequestLimits()


@dataclass(frozen=True)
class ValidRequest:
    prompt_ids: list[int]
    params: SamplingParams


def validate_request(
    request: generation_pb2.GenerateRequest,
    tokenizer: Tokenizer,
    info: WorkerInfo,
    seed: int,
    limits: RequestLimits = default_limits,
) -> ValidRequest:
    """`seed` is used when the request brings none."""
    _check_request_id(request.request_id)
    max_prompt_tokens = limits.max_prompt_tokens or info.max_context_len
    prompt_ids = _prompt_ids(request, tokenizer, info.vocab_size, limits.max_text_bytes, max_prompt_tokens)
    params = _sampling_params(request.sampling, info.vocab_size, seed)
    _check_fits(len(prompt_ids), params.max_new_tokens, info)
    return ValidRequest(prompt_ids, params)


def _check_request_id(rid: str) -> None:
    if len(rid) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(f"request_id: at most {MAX_REQUEST_ID_CHARS} characters, got {len(rid)}")
    for i, char in enumerate(rid):
        if not char.isprintable():  # control, format, line-break or unassigned characters
            raise InvalidRequest(f"request_id: must be printable, got U+{ord(char):04X} at index {i}")


def _prompt_ids(
    request: generation_pb2.GenerateRequest,
    tokenizer: Tokenizer,
    vocab: int,
    max_text_bytes: int,
    max_prompt_tokens: int,
) -> list[int]:
    which = request.WhichOneof("input")
    if which is None:
        raise InvalidRequest("input: set text or input_ids")
    if which == "text":
        return _text_ids(request.text, tokenizer, max_text_bytes, max_prompt_tokens)
    if not request.input_ids.ids:
        raise InvalidRequest("input.input_ids.ids: must not be empty")
    _check_prompt_length(len(request.input_ids.ids), "input.input_ids.ids", max_prompt_tokens)
    ids = list(request.input_ids.ids)
    _check_in_vocab(ids, "input.input_ids.ids", vocab)
    return ids


def _text_ids(text: str, tokenizer: Tokenizer, max_text_bytes: int, max_prompt_tokens: int) -> list[int]:
    if not text:
        raise InvalidRequest("input.text: must not be empty")
    size = len(text.encode())
    if size > max_text_bytes:
        raise InvalidRequest(f"input.text: at most {max_text_bytes} bytes of UTF-8, got {size}")
    ids = tokenizer.encode(text)
    if not ids:
        raise InvalidRequest("input.text: encodes to no tokens")
    _check_prompt_length(len(ids), "input.text", max_prompt_tokens)
    return ids


def _check_prompt_length(num_tokens: int, field: str, max_prompt_tokens: int) -> None:
    if num_tokens > max_prompt_tokens:
        raise InvalidRequest(f"{field}: a prompt has at most {max_prompt_tokens} tokens, got {num_tokens}")


def _check_in_vocab(ids: list[int], field: str, vocab: int) -> None:
    for i, token in enumerate(ids):
        if token >= vocab:
            raise InvalidRequest(f"{field}[{i}]: {token} is outside the vocabulary (0..{vocab - 1})")


def _sampling_params(p: generation_pb2.SamplingParams, vocab: int, seed: int) -> SamplingParams:
    if p.max_new_tokens < 1:
        raise InvalidRequest("sampling.max_new_tokens: must be at least 1")
    if not math.isfinite(p.temperature) or p.temperature < 0:
        raise InvalidRequest(f"sampling.temperature: must be a finite number >= 0, got {p.temperature}")
    top_p = p.top_p if p.HasField("top_p") else 1.0
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise InvalidRequest(f"sampling.top_p: must be in (0, 1], got {top_p}")
    _check_stop_token_ids(list(p.stop_token_ids), vocab)
    _check_stop_strings(list(p.stop))
    return SamplingParams(
        max_new_tokens=p.max_new_tokens,
        temperature=p.temperature,
        top_p=top_p,
        top_k=p.top_k,
        seed=p.seed if p.HasField("seed") else seed,
        stop_token_ids=frozenset(p.stop_token_ids),
        stop=tuple(p.stop),
        ignore_eos=p.ignore_eos,
    )


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


def _check_fits(prompt_len: int, max_new_tokens: int, info: WorkerInfo) -> None:
    total = prompt_len + max_new_tokens
    if total > info.max_context_len:
        raise InvalidRequest(
            f"sampling.max_new_tokens: prompt ({prompt_len} tokens) + max_new_tokens "
            f"({max_new_tokens}) exceeds the context length {info.max_context_len}"
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
