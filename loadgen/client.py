"""Client connections, issuing one request over gRPC, and recording when its tokens arrive."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from loadgen.records import RequestRecord
from loadgen.workload import PromptSpec
from stepahead.v1 import generation_pb2 as pb
from stepahead.v1 import generation_pb2_grpc

Clock = Callable[[], float]
CANCELLED = grpc.StatusCode.CANCELLED.name
# NOTE: channels to the same target with the same arguments share one subchannel, so one TCP
# connection; a local subchannel pool gives each channel a connection of its own.
OWN_CONNECTION = (("grpc.use_local_subchannel_pool", 1),)
SETTLED = frozenset(
    {
        grpc.ChannelConnectivity.READY,
        grpc.ChannelConnectivity.TRANSIENT_FAILURE,
        grpc.ChannelConnectivity.SHUTDOWN,
    }
)


def open_channels(server: str, count: int) -> list[grpc.aio.Channel]:
    """`count` channels to `server`, each over its own TCP connection."""
    return [grpc.aio.insecure_channel(server, options=OWN_CONNECTION) for _ in range(count)]


async def connect(channel: grpc.aio.Channel) -> None:
    """Waits until the channel is connected or its attempt failed (its requests then fail fast)."""
    state = channel.get_state(try_to_connect=True)
    while state not in SETTLED:
        await channel.wait_for_state_change(state)
        state = channel.get_state(try_to_connect=True)


def build_request(spec: PromptSpec, temperature: float, ignore_eos: bool) -> pb.GenerateRequest:
    """The request id is left to the server, so concurrent load generators never collide."""
    sampling = pb.SamplingParams(
        max_new_tokens=spec.output_len, temperature=temperature, ignore_eos=ignore_eos
    )
    if isinstance(spec.prompt, str):
        return pb.GenerateRequest(text=spec.prompt, sampling=sampling)
    return pb.GenerateRequest(input_ids=pb.TokenIds(ids=spec.prompt), sampling=sampling)


@dataclass
class RequestTiming:
    """Filled in while a request runs; `record` freezes it, as cancelled if it has not closed."""

    index: int
    spec: PromptSpec
    send_time: float | None = None
    end_time: float | None = None
    closed: bool = False
    message_times: list[float] = field(default_factory=list)
    message_tokens: list[int] = field(default_factory=list)
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    error_detail: str = ""

    def sent(self, now: float) -> None:
        self.send_time = now

    def received(self, now: float, response: pb.GenerateResponse) -> None:
        self.end_time = now
        self.prompt_tokens = response.prompt_tokens
        if response.token_ids:
            self.message_times.append(now)
            self.message_tokens.append(len(response.token_ids))
        if response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            self.finish_reason = pb.FinishReason.Name(response.finish_reason).removeprefix("FINISH_REASON_")

    def ended(self, now: float) -> None:
        """The stream closed with OK; the request ended at its last message, if it had one."""
        self.closed = True
        if self.end_time is None:
            self.end_time = now

    def failed(self, now: float, status: str, detail: str) -> None:
        self.closed = True
        self.end_time, self.error, self.error_detail = now, status, detail

    def record(self, now: float) -> RequestRecord:
        if not self.closed:
            self.failed(now, CANCELLED, "stopped by the client")
        return RequestRecord(
            index=self.index,
            input_len=self.spec.known_input_len if self.prompt_tokens is None else self.prompt_tokens,
            send_time=now if self.send_time is None else self.send_time,
            end_time=now if self.end_time is None else self.end_time,
            message_times=tuple(self.message_times),
            message_tokens=tuple(self.message_tokens),
            finish_reason=self.finish_reason,
            error=self.error,
            error_detail=self.error_detail,
        )


async def send_request(
    stub: generation_pb2_grpc.GenerationAsyncStub,
    request: pb.GenerateRequest,
    timing: RequestTiming,
    clock: Clock,
) -> None:
    """Streams one request to its end; a gRPC error is recorded, never raised."""
    timing.sent(clock())
    try:
        async for response in stub.Generate(request):
            timing.received(clock(), response)
    except grpc.aio.AioRpcError as exc:
        timing.failed(clock(), exc.code().name, exc.details() or "")
        return
    timing.ended(clock())
