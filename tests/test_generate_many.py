"""GenerateMany: many requests on one call, against the real services (the sim model), with the
engine core's own frontend and with frontend processes."""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Sequence

import grpc
import pytest

from loadgen import BenchmarkConfig, RandomDataset, run_benchmark
from scheduler_svc.frontend.grpc_api import MAX_MANY_MESSAGE_BYTES, many_messages
from scheduler_svc.frontend.multiplex import News, RequestFailure
from scheduler_svc.frontend.streams import ClientRequest, Completions, OutputChunk, OutputStream
from scheduler_svc.frontend.text import RequestText
from scheduler_svc.frontend.tokenizer import ByteTokenizer
from stepahead.processes import (
    STOP_TIMEOUT_S,
    Service,
    serving_pair,
    spawn_scheduler,
    spawn_worker,
    wait_serving,
)
from stepahead.v1 import generation_pb2 as pb
from stepahead.v1 import generation_pb2_grpc
from tests.harness import params
from tests.live import (
    CALL_TIMEOUT_S,
    FRONTEND_COUNTS,
    frontend_flags,
    generate,
    paused,
    request,
    server_info,
    unused_port,
    wait_all_free,
    wait_frontends_serving,
    wait_info,
)
from tests.test_faults import stop_all
from worker_svc.backends import sim_continuation as sim_expected

SIM = ["--model", "sim", "--sim-step-ms", "3", "--sim-token-us", "0", "--check-invariants"]
LONG = 8000  # tokens: 24 s of the sim at 3 ms a step, whatever the machine; the tests end them
# A restarted worker must come back before live requests give up on it (a hang guard: a worker
# starts in seconds).
RETRY = ["--worker-retry-timeout", "600"]


def generate_message(req: pb.GenerateRequest) -> pb.GenerateManyRequest:
    return pb.GenerateManyRequest(generate=req)


def abort_message(rid: str) -> pb.GenerateManyRequest:
    return pb.GenerateManyRequest(abort=pb.AbortRequest(request_id=rid))


async def messages_of(items: Sequence[pb.GenerateManyRequest]) -> AsyncIterator[pb.GenerateManyRequest]:
    for item in items:
        yield item


def key(r: pb.GenerateResponse) -> tuple[str, int]:
    return r.request_id, r.index


class Gathered:
    """A GenerateMany call's messages, by request and completion."""

    def __init__(self) -> None:
        self.messages = 0
        self.responses: dict[tuple[str, int], list[pb.GenerateResponse]] = defaultdict(list)
        self.errors: dict[str, pb.ManyError] = {}

    def add(self, message: pb.GenerateManyResponse) -> None:
        self.messages += 1
        for r in message.responses:
            earlier = self.responses[key(r)]
            assert not earlier or not earlier[-1].finish_reason, "a response after its finish"
            self.responses[key(r)].append(r)
        for e in message.errors:
            assert e.request_id not in self.errors, e
            self.errors[e.request_id] = e

    def tokens(self, rid: str, index: int = 0) -> list[int]:
        return [t for r in self.responses[(rid, index)] for t in r.token_ids]

    def text(self, rid: str, index: int = 0) -> str:
        return "".join(r.text for r in self.responses[(rid, index)])

    def finish(self, rid: str, index: int = 0) -> int:
        return self.responses[(rid, index)][-1].finish_reason


ManyCall = grpc.aio.StreamStreamCall[pb.GenerateManyRequest, pb.GenerateManyResponse]


async def gather_call(call: ManyCall) -> Gathered:
    gathered = Gathered()
    async for message in call:
        gathered.add(message)
    return gathered


def stub_of(channel: grpc.aio.Channel) -> generation_pb2_grpc.GenerationAsyncStub:
    return generation_pb2_grpc.GenerationStub(channel)


class OpenCall:
    """A GenerateMany call whose messages up the test sends as it goes; `close()` half-closes."""

    def __init__(self, stub: generation_pb2_grpc.GenerationAsyncStub) -> None:
        self._outbox: asyncio.Queue[pb.GenerateManyRequest | None] = asyncio.Queue()
        self.call: ManyCall = stub.GenerateMany(self._requests(), timeout=CALL_TIMEOUT_S)
        self.gathered = Gathered()

    async def _requests(self) -> AsyncIterator[pb.GenerateManyRequest]:
        while (item := await self._outbox.get()) is not None:
            yield item

    def send(self, message: pb.GenerateManyRequest) -> None:
        self._outbox.put_nowait(message)

    def close(self) -> None:
        self._outbox.put_nowait(None)

    async def read_until(self, done: Callable[[Gathered], bool]) -> None:
        while not done(self.gathered):
            message = await self.call.read()
            assert isinstance(message, pb.GenerateManyResponse), message
            self.gathered.add(message)

    async def read_to_end(self) -> grpc.StatusCode:
        while isinstance(message := await self.call.read(), pb.GenerateManyResponse):
            self.gathered.add(message)
        return await self.call.code()


def streaming(count: int) -> Callable[[Gathered], bool]:
    return lambda g: sum(1 for (rid, _), rs in g.responses.items() if rs) >= count


MIXED = [
    request("alpha", 7, "a", ignore_eos=True),
    request("bravo", 40, "b", n=2),
    request("charlie", 1, "c", logprobs=True, top_logprobs=2),
    request("delta", 25, "d", stop=["x"]),
    *[request(f"echo {i}", 5 + 3 * i, f"e{i}") for i in range(12)],
]


@pytest.mark.parametrize("frontends", FRONTEND_COUNTS)
def test_many_requests_on_one_call_stream_what_their_own_calls_would(frontends: int) -> None:
    """Sixteen requests (n = 2, logprobs, a stop string among them) on one call, the client
    half-closing at once: every completion's tokens, text, finish and counts are those of its own
    Generate call, messages carry several requests' news, and the call ends OK."""
    with serving_pair(SIM, frontend_flags(frontends)) as (_, scheduler):
        asyncio.run(wait_frontends_serving(scheduler.address, frontends))

        async def scenario() -> tuple[Gathered, dict[str, list[pb.GenerateResponse]], grpc.StatusCode]:
            async with grpc.aio.insecure_channel(scheduler.address) as channel:
                call = stub_of(channel).GenerateMany(
                    messages_of([generate_message(r) for r in MIXED]), timeout=CALL_TIMEOUT_S
                )
                gathered = await gather_call(call)
                code = await call.code()
            alone = {r.request_id: await generate(scheduler.address, r) for r in MIXED}
            await wait_all_free(scheduler.address)
            return gathered, alone, code

        gathered, alone, code = asyncio.run(scenario())
    assert code == grpc.StatusCode.OK and not gathered.errors
    for req in MIXED:
        rid = req.request_id
        for index in range(max(req.sampling.n, 1)):
            own = [r for r in alone[rid] if r.index == index]
            assert gathered.tokens(rid, index) == [t for r in own for t in r.token_ids], (rid, index)
            assert gathered.text(rid, index) == "".join(r.text for r in own), (rid, index)
            assert gathered.finish(rid, index) == own[-1].finish_reason
            last = gathered.responses[(rid, index)][-1]
            assert last.completion_tokens == own[-1].completion_tokens
            assert last.prompt_tokens == own[-1].prompt_tokens
    assert gathered.tokens("a") == sim_expected(b"alpha", 7)
    assert len(gathered.responses[("c", 0)][0].logprobs[0].top_logprobs) == 2
    assert gathered.finish("d") in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
    responses = sum(len(v) for v in gathered.responses.values())
    assert gathered.messages < responses  # news of several requests shared a message


def test_a_refused_request_fails_alone_with_its_field_named() -> None:
    """On one call: a request without an id, one with a bad field and one reusing a live id each
    get an error entry; the good (long) request runs on until it is aborted on the call, and the
    call ends OK."""
    with serving_pair(SIM, frontend_flags(0)) as (worker, scheduler):
        asyncio.run(wait_frontends_serving(scheduler.address, 0))

        async def scenario() -> tuple[Gathered, grpc.StatusCode]:
            async with grpc.aio.insecure_channel(scheduler.address) as channel:
                many = OpenCall(stub_of(channel))
                many.send(generate_message(request("good", LONG, "good", ignore_eos=True)))
                await many.read_until(streaming(1))  # "good" is live ...
                with paused(worker.proc):  # ... and stays live while the others are refused
                    many.send(generate_message(request("no id", 3)))
                    many.send(generate_message(request("bad", 3, "bad", temperature=-1.0)))
                    many.send(generate_message(request("again", 3, "good")))
                    await many.read_until(lambda g: len(g.errors) == 3)
                many.send(abort_message("good"))
                many.close()
                return many.gathered, await many.read_to_end()

        gathered, code = asyncio.run(scenario())
        asyncio.run(wait_all_free(scheduler.address))
    assert code == grpc.StatusCode.OK
    errors = gathered.errors
    assert set(errors) == {"", "bad", "good"}
    assert errors[""].code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "request_id" in errors[""].message
    assert errors["bad"].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "temperature" in errors["bad"].message
    assert errors["good"].code == grpc.StatusCode.ALREADY_EXISTS.value[0]
    good = gathered.tokens("good")  # the live one was untouched
    assert 0 < len(good) < LONG and good == sim_expected(b"good", len(good))
    assert gathered.finish("good") == pb.FINISH_REASON_ABORT


@pytest.mark.parametrize("frontends", FRONTEND_COUNTS)
def test_an_abort_on_the_call_ends_its_request_and_a_cancelled_call_frees_everything(frontends: int) -> None:
    with serving_pair(SIM, frontend_flags(frontends)) as (_, scheduler):
        asyncio.run(wait_frontends_serving(scheduler.address, frontends))

        async def scenario() -> tuple[Gathered, list[int]]:
            async with grpc.aio.insecure_channel(scheduler.address) as channel:
                many = OpenCall(stub_of(channel))
                for rid in ("l1", "l2", "l3"):
                    many.send(generate_message(request(rid, LONG, rid, ignore_eos=True)))
                await many.read_until(streaming(3))
                many.send(abort_message("l1"))
                await many.read_until(lambda g: bool(g.finish("l1")))
                gathered = many.gathered
                await wait_info(scheduler.address, lambda i: i.requests_running == 2, "2 running")
                many.call.cancel()  # the client goes away with l2 and l3 live
            await wait_all_free(scheduler.address)
            after = await generate(scheduler.address, request("after", 5, ignore_eos=True))  # still serving
            return gathered, [t for r in after for t in r.token_ids]

        gathered, after = asyncio.run(scenario())
    assert gathered.finish("l1") == pb.FINISH_REASON_ABORT
    assert 0 < len(gathered.tokens("l1")) < LONG
    assert gathered.tokens("l1") == sim_expected(b"l1", len(gathered.tokens("l1")))
    assert after == sim_expected(b"after", 5)


def test_an_unparsable_message_ends_the_call_invalid_argument_and_frees_its_requests() -> None:
    with serving_pair(SIM, frontend_flags(0)) as (_, scheduler):
        asyncio.run(wait_frontends_serving(scheduler.address, 0))

        async def scenario() -> grpc.aio.AioRpcError:
            good = generate_message(request("fine", LONG, "fine", ignore_eos=True)).SerializeToString()
            sent = asyncio.Event()

            async def requests() -> AsyncIterator[bytes]:
                yield good
                await sent.wait()
                yield b"\xff\xff\xff"  # not a protobuf message

            async with grpc.aio.insecure_channel(scheduler.address) as channel:
                raw: grpc.aio.StreamStreamMultiCallable[bytes, bytes] = channel.stream_stream(
                    "/stepahead.v1.Generation/GenerateMany"
                )
                call = raw(requests(), timeout=CALL_TIMEOUT_S)
                await call.read()  # "fine" is running
                sent.set()
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    while await call.read() != grpc.aio.EOF:
                        pass
            await wait_all_free(scheduler.address)
            return failed.value

        failed = asyncio.run(scenario())
    assert failed.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request" in (failed.details() or "")


def test_loadgen_runs_over_one_call_a_connection() -> None:
    """loadgen's grpc-many backend: every request completes with its tokens over 2 connections."""
    with serving_pair(SIM, frontend_flags(0)) as (_, scheduler):
        asyncio.run(wait_frontends_serving(scheduler.address, 0))
        config = BenchmarkConfig(
            server=scheduler.address,
            dataset=RandomDataset(input_len=8, output_len=12),
            num_prompts=24,
            max_concurrency=8,
            connections=2,
            ignore_eos=True,
            backend="grpc-many",
        )
        result = asyncio.run(run_benchmark(config))
        asyncio.run(wait_all_free(scheduler.address))
    s = result.summary
    assert (s.completed, s.failed, s.total_output_tokens) == (24, 0, 24 * 12)
    assert s.peak_concurrency == 8
    assert all(r.finish_reason == "LENGTH" for r in result.records)


def test_news_over_the_size_limit_is_split_between_messages_never_within_a_request() -> None:
    """64 requests with 40 KiB of new text each (2.5 MiB together): several messages, each under
    the limit, every request's news whole in one of them, in order; the failures in the first."""
    ready = asyncio.Event()

    def completions(i: int) -> Completions:
        text = RequestText(ByteTokenizer(), ())
        client = ClientRequest(i, f"r{i}", [1, 2], params(3), text, OutputStream(ready=ready))
        return Completions(f"r{i}", [1, 2], ready, [client])

    text_of = [chr(65 + i % 26) * (40 << 10) for i in range(64)]
    chunks = [OutputChunk([65] * 3, text, None, 3) for text in text_of]
    news: list[News] = [(completions(i), [(0, chunk)]) for i, chunk in enumerate(chunks)]
    failures = [RequestFailure("bad", grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p: ...")]
    messages = many_messages(news, failures)
    assert len(messages) > 2
    assert all(m.ByteSize() <= MAX_MANY_MESSAGE_BYTES for m in messages)
    assert [r.request_id for m in messages for r in m.responses] == [f"r{i}" for i in range(64)]
    responses = [r for m in messages for r in m.responses]
    assert [r.text for r in responses] == text_of and all(list(r.token_ids) == [65] * 3 for r in responses)
    assert [e.request_id for e in messages[0].errors] == ["bad"] and not any(m.errors for m in messages[1:])
    small = many_messages(news[:4], failures)
    assert len(small) == 1 and len(small[0].responses) == 4


def fault_request(i: int, tokens: int) -> pb.GenerateRequest:
    return request(f"many fault {i}", tokens, f"m{i}", ignore_eos=True)


@pytest.mark.parametrize("frontends", FRONTEND_COUNTS)
def test_a_killed_worker_loses_no_request_on_the_call(frontends: int) -> None:
    """Twenty requests and a long one on one call, all streaming; the worker is killed (SIGKILL)
    and another started: every request ends with exactly its own tokens (recomputed where they
    were lost), the long one is aborted on the call, and the call ends OK."""
    rng = random.Random(7)
    lengths = [rng.randint(150, 400) for _ in range(20)]
    port = unused_port()
    sim = [*SIM, "--kv-slots", "65536"]
    worker: Service | None = spawn_worker(sim, port=port)
    scheduler = spawn_scheduler(f"127.0.0.1:{port}", [*RETRY, *frontend_flags(frontends)])
    try:
        wait_serving(scheduler.address)
        asyncio.run(wait_frontends_serving(scheduler.address, frontends))

        async def scenario() -> tuple[Gathered, grpc.StatusCode]:
            nonlocal worker
            async with grpc.aio.insecure_channel(scheduler.address) as channel:
                many = OpenCall(stub_of(channel))
                many.send(generate_message(fault_request(len(lengths), LONG)))
                for i, n in enumerate(lengths):
                    many.send(generate_message(fault_request(i, n)))
                await many.read_until(streaming(len(lengths) + 1))
                assert worker is not None
                with paused(worker.proc):  # the long one is surely live
                    assert (await server_info(scheduler.address)).requests_running > 0
                    worker.proc.kill()
                    worker.proc.wait(STOP_TIMEOUT_S)
                worker = await asyncio.to_thread(spawn_worker, sim, port)
                long_id = f"m{len(lengths)}"
                await many.read_until(lambda g: all(g.finish(f"m{i}") for i in range(len(lengths))))
                many.send(abort_message(long_id))
                many.close()
                return many.gathered, await many.read_to_end()

        gathered, code = asyncio.run(scenario())
        assert code == grpc.StatusCode.OK and not gathered.errors
        for i, n in enumerate(lengths):
            assert gathered.tokens(f"m{i}") == sim_expected(f"many fault {i}".encode(), n), i
        assert gathered.finish(f"m{len(lengths)}") == pb.FINISH_REASON_ABORT
        asyncio.run(wait_all_free(scheduler.address))
        assert scheduler.stop() == 0
    finally:
        stop_all(scheduler, worker)


def test_requests_on_the_call_fail_alone_when_no_worker_comes_back() -> None:
    """The worker is killed under three live requests and none comes back within the retry
    timeout: each gets an UNAVAILABLE entry, and the call itself ends OK."""
    port = unused_port()
    worker = spawn_worker(SIM, port=port)
    scheduler = spawn_scheduler(f"127.0.0.1:{port}", ["--worker-retry-timeout", "1"])
    try:
        wait_serving(scheduler.address)

        async def scenario() -> tuple[Gathered, grpc.StatusCode]:
            async with grpc.aio.insecure_channel(scheduler.address) as channel:
                many = OpenCall(stub_of(channel))
                for i in range(3):
                    many.send(generate_message(fault_request(i, LONG)))
                await many.read_until(streaming(3))
                with paused(worker.proc):
                    assert (await server_info(scheduler.address)).requests_running == 3
                    worker.proc.kill()
                    worker.proc.wait(STOP_TIMEOUT_S)
                await many.read_until(lambda g: len(g.errors) == 3)
                many.close()
                return many.gathered, await many.read_to_end()

        gathered, code = asyncio.run(scenario())
        assert code == grpc.StatusCode.OK
        assert {rid: e.code for rid, e in gathered.errors.items()} == {
            f"m{i}": grpc.StatusCode.UNAVAILABLE.value[0] for i in range(3)
        }
        assert scheduler.stop() == 0
    finally:
        stop_all(scheduler, worker)
