"""Hostile requests against a live sim pair: each gets a precise status naming the field, and
the server goes on serving with nothing leaked."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest

from scheduler_svc.frontend.validation import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_TEXT_BYTES
from scheduler_svc.process import cli as scheduler_cli
from stepahead.processes import Service, serving_pair
from stepahead.v1 import generation_pb2 as pb
from stepahead.v1 import generation_pb2_grpc
from tests.live import CALL_TIMEOUT_S, FRONTEND_COUNTS, frontend_flags, wait_all_free, wait_until
from worker_svc.backends import sim_continuation as sim_expected

pytestmark = pytest.mark.anyio
SIM = ["--model", "sim", "--sim-step-ms", "2", "--check-invariants", "--kv-slots", "4096"]
MAX_REQUEST_BYTES = 65536
MAX_TEXT_BYTES = 8192
MAX_PROMPT_TOKENS = 1024
LIMITS = [
    "--max-request-bytes",
    str(MAX_REQUEST_BYTES),
    "--max-text-bytes",
    str(MAX_TEXT_BYTES),
    "--max-prompt-tokens",
    str(MAX_PROMPT_TOKENS),
]
VOCAB = 258  # sim: 256 bytes + BOS + EOS
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def frontends_id(count: int) -> str:
    return f"frontends={count}"


@pytest.fixture(scope="module", params=FRONTEND_COUNTS, ids=frontends_id)
def sim_pair(request: pytest.FixtureRequest) -> Iterator[tuple[Service, Service]]:
    with serving_pair(SIM, [*LIMITS, *frontend_flags(request.param)]) as pair:
        yield pair


def request(
    text: str = "hi", max_new_tokens: int = 4, rid: str = "", **sampling: object
) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=rid,
        text=text,
        sampling=pb.SamplingParams(max_new_tokens=max_new_tokens, **sampling),  # type: ignore[arg-type]
    )


def ids_request(ids: list[int]) -> pb.GenerateRequest:
    return pb.GenerateRequest(input_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(max_new_tokens=4))


def corrupted(message: pb.GenerateRequest, marker: bytes, replacement: bytes) -> bytes:
    """`message` on the wire with `marker` swapped for bytes of the same length, so every length
    prefix stays valid and only the content is wrong."""
    assert len(marker) == len(replacement)
    wire = message.SerializeToString()
    assert wire.count(marker) == 1
    return wire.replace(marker, replacement)


@dataclass(frozen=True)
class Bad:
    name: str
    payload: pb.GenerateRequest | bytes
    code: grpc.StatusCode
    field: str | None  # where the message starts; None when gRPC itself answers


BAD_INPUTS = [
    Bad("no input", pb.GenerateRequest(sampling=pb.SamplingParams(max_new_tokens=4)), INVALID, "input"),
    Bad("empty text", request(""), INVALID, "input.text"),
    Bad("empty ids", ids_request([]), INVALID, "input.input_ids.ids"),
    Bad("id outside the vocabulary", ids_request([1, VOCAB]), INVALID, "input.input_ids.ids[1]"),
    Bad("id at uint32 max", ids_request([2**32 - 1]), INVALID, "input.input_ids.ids[0]"),
    Bad("text over the byte limit", request("a" * (MAX_TEXT_BYTES + 1)), INVALID, "input.text"),
    Bad(
        "text over the byte limit in few chars",
        request("é" * (MAX_TEXT_BYTES // 2 + 1)),
        INVALID,
        "input.text",
    ),
    Bad("text over the prompt tokens", request("a" * (MAX_PROMPT_TOKENS + 1)), INVALID, "input.text"),
    Bad(
        "ids over the prompt tokens",
        ids_request([7] * (MAX_PROMPT_TOKENS + 1)),
        INVALID,
        "input.input_ids.ids",
    ),
    Bad("bad UTF-8 in text", corrupted(request("MARKER"), b"MARKER", b"MAR\xff\xfe!"), INVALID, "input.text"),
    Bad(
        "bad UTF-8 in text (lone continuation)",
        corrupted(request("ab"), b"ab", b"a\x80"),
        INVALID,
        "input.text",
    ),
    Bad(
        "bad UTF-8 in request_id", corrupted(request(rid="RID"), b"RID", b"R\xc0\xaf"), INVALID, "request_id"
    ),
    Bad(
        "bad UTF-8 in a stop string",
        corrupted(request(stop=["x", "y", "MARK"]), b"MARK", b"M\xed\xa0\x80"),  # an encoded surrogate
        INVALID,
        "sampling.stop[2]",
    ),
    Bad("corrupt wire format", b"\xff\xff\xff\xff", INVALID, "request"),
    Bad("truncated message", request("truncated").SerializeToString()[:-3], INVALID, "request"),
    Bad("length prefix past the end", b"\x12\x7fhi", INVALID, "request"),
    Bad("max_new_tokens 0", request(max_new_tokens=0), INVALID, "sampling.max_new_tokens"),
    Bad("no sampling at all", pb.GenerateRequest(text="hi"), INVALID, "sampling.max_new_tokens"),
    Bad(
        "max_new_tokens at uint32 max", request(max_new_tokens=2**32 - 1), INVALID, "sampling.max_new_tokens"
    ),
    Bad("max_new_tokens past the KV pool", request(max_new_tokens=5000), INVALID, "sampling.max_new_tokens"),
    Bad("negative temperature", request(temperature=-0.5), INVALID, "sampling.temperature"),
    Bad("NaN temperature", request(temperature=float("nan")), INVALID, "sampling.temperature"),
    Bad("inf temperature", request(temperature=float("inf")), INVALID, "sampling.temperature"),
    Bad("-inf temperature", request(temperature=float("-inf")), INVALID, "sampling.temperature"),
    Bad("top_p 0", request(top_p=0.0), INVALID, "sampling.top_p"),
    Bad("top_p above 1", request(top_p=1.5), INVALID, "sampling.top_p"),
    Bad("negative top_p", request(top_p=-0.1), INVALID, "sampling.top_p"),
    Bad("NaN top_p", request(top_p=float("nan")), INVALID, "sampling.top_p"),
    Bad("inf top_p", request(top_p=float("inf")), INVALID, "sampling.top_p"),
    Bad(
        "stop token outside the vocabulary",
        request(stop_token_ids=[5, 300]),
        INVALID,
        "sampling.stop_token_ids[1]",
    ),
    Bad("too many stop tokens", request(stop_token_ids=[5] * 257), INVALID, "sampling.stop_token_ids"),
    Bad("too many stop strings", request(stop=[f"s{i}" for i in range(17)]), INVALID, "sampling.stop"),
    Bad("empty stop string", request(stop=["ok", ""]), INVALID, "sampling.stop[1]"),
    Bad("stop string too long", request(stop=["ok", "x" * 257]), INVALID, "sampling.stop[1]"),
    Bad("request_id too long", request(rid="x" * 257), INVALID, "request_id"),
    Bad("request_id with a bell", request(rid="abc\x07"), INVALID, "request_id"),
    Bad("request_id with a newline", request(rid="forged\nlog line"), INVALID, "request_id"),
    Bad("request_id with DEL", request(rid="a\x7f"), INVALID, "request_id"),
    Bad("request_id with a C1 control", request(rid="a\x9bb"), INVALID, "request_id"),
    Bad("request_id with a line separator", request(rid="a\u2028b"), INVALID, "request_id"),
    Bad("request_id with a NUL", request(rid="a\x00b"), INVALID, "request_id"),
    Bad(
        "message over --max-request-bytes",
        request("a" * MAX_REQUEST_BYTES),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        None,
    ),
]


def _identity(data: bytes) -> bytes:
    return data


async def call_raw(address: str, method: str, payload: bytes) -> tuple[grpc.StatusCode, str]:
    """Sends `payload` as it is, past any client-side serialization."""
    async with grpc.aio.insecure_channel(address) as channel:
        if method == "Generate":
            stream = channel.unary_stream(
                f"/stepahead.v1.Generation/{method}",
                request_serializer=_identity,
                response_deserializer=_identity,
            )
            call = stream(payload, timeout=CALL_TIMEOUT_S)
            try:
                async for _ in call:
                    pass
            except grpc.aio.AioRpcError as exc:
                return exc.code(), str(exc.details())
            return grpc.StatusCode.OK, ""
        unary = channel.unary_unary(
            f"/stepahead.v1.Generation/{method}",
            request_serializer=_identity,
            response_deserializer=_identity,
        )
        try:
            await unary(payload, timeout=CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            return exc.code(), str(exc.details())
        return grpc.StatusCode.OK, ""


async def generate(address: str, req: pb.GenerateRequest) -> list[int]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        return [t async for r in stub.Generate(req, timeout=CALL_TIMEOUT_S) for t in r.token_ids]


async def serves_a_normal_request(address: str) -> None:
    tokens = await generate(address, request("a normal one", 5, ignore_eos=True))
    assert tokens == sim_expected(b"a normal one", 5)


def test_at_least_twenty_hostile_inputs() -> None:
    assert len(BAD_INPUTS) >= 20
    assert len({bad.name for bad in BAD_INPUTS}) == len(BAD_INPUTS)


def wire(bad: Bad) -> bytes:
    return bad.payload if isinstance(bad.payload, bytes) else bad.payload.SerializeToString()


@pytest.mark.parametrize("bad", BAD_INPUTS, ids=[bad.name for bad in BAD_INPUTS])
async def test_hostile_input_gets_a_precise_status_then_the_server_serves(
    sim_pair: tuple[Service, Service], bad: Bad
) -> None:
    _, scheduler = sim_pair
    code, details = await call_raw(scheduler.address, "Generate", wire(bad))
    assert code == bad.code, details
    if bad.field is not None:
        assert details.startswith(bad.field + ": "), details
    await serves_a_normal_request(scheduler.address)
    await wait_all_free(scheduler.address)


BAD_ABORT = pb.AbortRequest(request_id="RID").SerializeToString().replace(b"RID", b"R\xff\xff")
BAD_INFO = b"\xff\xff\xff"
BAD_TEXT = corrupted(request("ab"), b"ab", b"\xff!")


async def test_malformed_utf8_is_invalid_argument_on_every_method(sim_pair: tuple[Service, Service]) -> None:
    _, scheduler = sim_pair
    assert await call_raw(scheduler.address, "Abort", BAD_ABORT) == (INVALID, "request_id: not valid UTF-8")
    code, details = await call_raw(scheduler.address, "GetServerInfo", BAD_INFO)
    assert code == INVALID and details.startswith("request: cannot be parsed")
    code, details = await call_raw(scheduler.address, "Generate", BAD_TEXT)
    assert (code, details) == (INVALID, "input.text: not valid UTF-8")


async def test_limits_allow_what_they_promise(sim_pair: tuple[Service, Service]) -> None:
    _, scheduler = sim_pair
    at_the_limits = request(
        "a" * MAX_PROMPT_TOKENS,
        2,
        rid="r" * 256,
        stop=["s" * 256] * 16,
        stop_token_ids=[VOCAB - 2] * 256,  # BOS: the sim never samples it
        ignore_eos=True,
    )
    assert await generate(scheduler.address, at_the_limits) == sim_expected(b"a" * MAX_PROMPT_TOKENS, 2)
    await wait_all_free(scheduler.address)


@pytest.mark.parametrize("frontends", FRONTEND_COUNTS, ids=frontends_id)
async def test_nothing_reached_grpc_as_an_unexpected_error(frontends: int) -> None:
    """Bad payloads used to raise DecodeError inside gRPC: UNKNOWN and a logged traceback. Every
    one goes to a pair of its own, whose output is scanned once the scheduler printed, on being
    stopped, its "stopping:" line: what it printed for them came before, so it has been read."""
    with serving_pair(SIM, [*LIMITS, *frontend_flags(frontends)]) as (worker, scheduler):
        for bad in BAD_INPUTS:
            await call_raw(scheduler.address, "Generate", wire(bad))
        for method, payload in (("Abort", BAD_ABORT), ("GetServerInfo", BAD_INFO), ("Generate", BAD_TEXT)):
            await call_raw(scheduler.address, method, payload)
        await serves_a_normal_request(scheduler.address)
        assert worker.proc.poll() is None and scheduler.proc.poll() is None
        scheduler.stop()
        wait_until(lambda: any("stopping:" in line for line in scheduler.output), "its stopping line read")
    assert not any("Traceback" in line or "Unexpected" in line for line in scheduler.output)


def test_default_limits_are_documented_ones() -> None:
    config = scheduler_cli.parse_args([])
    assert config.api.max_request_bytes == DEFAULT_MAX_REQUEST_BYTES == 4 * 1024 * 1024
    assert config.frontend.limits.max_text_bytes == DEFAULT_MAX_TEXT_BYTES == 1024 * 1024
    assert config.frontend.limits.max_prompt_tokens == 0  # the model's context length
    with pytest.raises(SystemExit):
        scheduler_cli.parse_args(["--max-text-bytes", "0"])
