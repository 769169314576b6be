"""The gRPC backend: client connections, one request over gRPC, and what its messages tell."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import uuid
from collections.abc import AsyncIterator

import grpc

from loadgen.backend import BackendError, Sampling, SamplingFeatures
from loadgen.timing import Clock, RequestTiming
from loadgen.workload import PromptSpec
from stepahead.targets import open_target, split_servers
from stepahead.v1 import generation_pb2 as pb
from stepahead.v1 import generation_pb2_grpc

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
# How long a closing GenerateMany call waits for the server to end it before cancelling it.
CLOSE_TIMEOUT_S = 5.0


def open_channels(server: str, count: int) -> list[grpc.aio.Channel]:
    """`count` channels to `server`, each over its own TCP connection. Several servers
    (comma-separated, or a dns:/ipv4:/ipv6: target) are replicas: each channel then connects to
    every one and sends its calls round robin over them. BackendError for a name that cannot be
    resolved."""
    try:
        servers = split_servers(server)
        return [open_target(servers, options=OWN_CONNECTION) for _ in range(count)]
    except ValueError as exc:
        raise BackendError(f"--server: {exc}") from exc


async def connect(channel: grpc.aio.Channel) -> None:
    """Waits until the channel is connected or its attempt failed (its requests then fail fast)."""
    state = channel.get_state(try_to_connect=True)
    while state not in SETTLED:
        await channel.wait_for_state_change(state)
        state = channel.get_state(try_to_connect=True)


def build_request(spec: PromptSpec, sampling_config: Sampling, index: int = 0) -> pb.GenerateRequest:
    """Request `index` of the run; its id is left to the server, so concurrent load generators
    never collide."""
    sampling = pb.SamplingParams(
        max_new_tokens=spec.output_len,
        temperature=sampling_config.temperature,
        ignore_eos=sampling_config.ignore_eos,
    )
    _add_features(sampling, sampling_config.features)
    if sampling_config.constrained.applies(index):
        sampling.json_schema = sampling_config.constrained.schema
    if isinstance(spec.prompt, str):
        return pb.GenerateRequest(text=spec.prompt, sampling=sampling)
    return pb.GenerateRequest(input_ids=pb.TokenIds(ids=spec.prompt), sampling=sampling)


def _add_features(sampling: pb.SamplingParams, f: SamplingFeatures) -> None:
    if f.top_p is not None:
        sampling.top_p = f.top_p
    if f.repetition_penalty is not None:
        sampling.repetition_penalty = f.repetition_penalty
    sampling.top_k = f.top_k
    sampling.presence_penalty = f.presence_penalty
    sampling.frequency_penalty = f.frequency_penalty
    sampling.min_tokens = f.min_tokens
    sampling.logit_bias.update(f.logit_bias)
    if f.logprobs is not None:
        sampling.logprobs, sampling.top_logprobs = True, f.logprobs


def received(timing: RequestTiming, now: float, response: pb.GenerateResponse) -> None:
    timing.heard(now)
    timing.prompt_tokens = response.prompt_tokens
    if response.token_ids:
        timing.arrived(now, len(response.token_ids))
    if response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
        timing.finish_reason = pb.FinishReason.Name(response.finish_reason).removeprefix("FINISH_REASON_")


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
            received(timing, clock(), response)
    except grpc.aio.AioRpcError as exc:
        timing.failed(clock(), exc.code().name, exc.details() or "")
        return
    timing.ended(clock())


class GrpcBackend:
    """Request i goes over connection i mod `connections` (to the next replica of that
    connection's round robin, when there are several)."""

    model = None

    def __init__(self, server: str, connections: int, sampling: Sampling) -> None:
        self.channels = open_channels(server, connections)
        self.stubs = [generation_pb2_grpc.GenerationStub(channel) for channel in self.channels]
        self.sampling = sampling

    async def connect(self) -> None:
        await asyncio.gather(*(connect(channel) for channel in self.channels))

    async def send(self, timing: RequestTiming, clock: Clock) -> None:
        request = build_request(timing.spec, self.sampling, timing.index)
        stub = self.stubs[timing.index % len(self.stubs)]
        await send_request(stub, request, timing, clock)

    async def close(self) -> None:
        await asyncio.gather(*(channel.close() for channel in self.channels))


class ManyCall:
    """One GenerateMany call: every request of a connection goes up it, under an id of this
    load generator's, and each message down is routed to its requests' timings."""

    def __init__(self, stub: generation_pb2_grpc.GenerationAsyncStub) -> None:
        self._stub = stub
        self._outbox: asyncio.Queue[pb.GenerateManyRequest | None] = asyncio.Queue()
        self._live: dict[str, tuple[RequestTiming, asyncio.Future[None]]] = {}
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:12]  # concurrent load generators never collide
        self._reader: asyncio.Task[None] | None = None

    async def send(self, request: pb.GenerateRequest, timing: RequestTiming, clock: Clock) -> None:
        """Runs one request to its end; a failure is recorded, never raised. The call starts with
        the first request, and again with the next one after it ended (its requests failed)."""
        if self._reader is None or self._reader.done():
            self._outbox = asyncio.Queue()
            self._reader = asyncio.create_task(self._read(clock, self._outbox))
        request.request_id = f"{self._prefix}-{next(self._ids)}"
        done = asyncio.get_running_loop().create_future()
        self._live[request.request_id] = (timing, done)
        timing.sent(clock())
        self._outbox.put_nowait(pb.GenerateManyRequest(generate=request))
        try:
            await done
        finally:
            if self._live.pop(request.request_id, None) is not None:  # stopped while it ran
                self._outbox.put_nowait(
                    pb.GenerateManyRequest(abort=pb.AbortRequest(request_id=request.request_id))
                )

    async def close(self) -> None:
        """Half-closes the call and lets the server end it, so every abort already queued
        reaches it first; the call is cancelled only if the server has not ended it within
        CLOSE_TIMEOUT_S (a request still live, or a server that never ends the call)."""
        self._outbox.put_nowait(None)
        if self._reader is None:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._reader), CLOSE_TIMEOUT_S)
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader

    @staticmethod
    async def _requests(
        outbox: asyncio.Queue[pb.GenerateManyRequest | None],
    ) -> AsyncIterator[pb.GenerateManyRequest]:
        while (message := await outbox.get()) is not None:
            yield message

    async def _read(self, clock: Clock, outbox: asyncio.Queue[pb.GenerateManyRequest | None]) -> None:
        call = self._stub.GenerateMany(self._requests(outbox))
        try:
            async for message in call:
                now = clock()
                for response in message.responses:
                    if (entry := self._live.get(response.request_id)) is not None:
                        received(entry[0], now, response)
                        if response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                            entry[0].ended(now)
                            self._end(response.request_id)
                for error in message.errors:
                    if (entry := self._live.get(error.request_id)) is not None:
                        entry[0].failed(now, _code_name(error.code), error.message)
                        self._end(error.request_id)
            status, detail = "UNKNOWN", "the call ended with the request live"
        except grpc.aio.AioRpcError as exc:
            status, detail = exc.code().name, exc.details() or ""
        for timing, _ in self._live.values():
            timing.failed(clock(), status, detail)
        for rid in list(self._live):
            self._end(rid)

    def _end(self, rid: str) -> None:
        entry = self._live.pop(rid, None)
        if entry is not None:
            entry[1].set_result(None)


def _code_name(value: int) -> str:
    """The name of a google.rpc.Code number (UNKNOWN for one gRPC does not know)."""
    return next((c.name for c in grpc.StatusCode if c.value[0] == value), grpc.StatusCode.UNKNOWN.name)


class GrpcManyBackend(GrpcBackend):
    """As GrpcBackend, with one GenerateMany call a connection carrying all its requests."""

    def __init__(self, server: str, connections: int, sampling: Sampling) -> None:
        super().__init__(server, connections, sampling)
        self.calls = [ManyCall(stub) for stub in self.stubs]

    async def send(self, timing: RequestTiming, clock: Clock) -> None:
        request = build_request(timing.spec, self.sampling, timing.index)
        await self.calls[timing.index % len(self.calls)].send(request, timing, clock)

    async def close(self) -> None:
        await asyncio.gather(*(call.close() for call in self.calls))
        await super().close()
