"""The sampling features through live processes on 127.0.0.1 (tiny worker, overlap scheduler,
frontends in 0 or 2 processes): `n` completions in one call, log-probabilities in the
GenerateResponse, aborts of every completion, and nothing leaked."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from stepahead.processes import Service, serving_pair
from stepahead.v1 import generation_pb2 as pb
from stepahead.v1 import generation_pb2_grpc
from stepahead_client.client import build_request, parse_args
from tests.live import (
    CALL_TIMEOUT_S,
    FRONTEND_COUNTS,
    frontend_flags,
    generate,
    paused,
    request,
    server_info,
    wait_all_free,
)

pytestmark = pytest.mark.anyio
TINY = ["--model", "tiny", "--check-invariants", "--kv-slots", "4096"]


@pytest.fixture(scope="module", params=FRONTEND_COUNTS, ids=lambda n: f"frontends={n}")
def tiny_pair(request: pytest.FixtureRequest) -> Iterator[tuple[Service, Service]]:
    with serving_pair(TINY, ["--max-batch-tokens", "256", *frontend_flags(request.param)]) as pair:
        yield pair


def by_index(responses: list[pb.GenerateResponse]) -> dict[int, list[pb.GenerateResponse]]:
    grouped: dict[int, list[pb.GenerateResponse]] = defaultdict(list)
    for r in responses:
        grouped[r.index].append(r)
    return dict(grouped)


def tokens(responses: list[pb.GenerateResponse]) -> list[int]:
    return [t for r in responses for t in r.token_ids]


async def test_n_completions_in_one_call(tiny_pair: tuple[Service, Service]) -> None:
    _, scheduler = tiny_pair
    sampled: dict[str, Any] = dict(temperature=1.0, seed=1234, ignore_eos=True)
    call = await generate(scheduler.address, request("Three answers:", 12, rid="n3", n=3, **sampled))
    groups = by_index(call)
    assert sorted(groups) == [0, 1, 2]
    for responses in groups.values():
        assert all(r.request_id == "n3" for r in responses)
        assert [r.finish_reason for r in responses][-1] == pb.FINISH_REASON_LENGTH
        assert all(r.finish_reason == pb.FINISH_REASON_UNSPECIFIED for r in responses[:-1])
        assert responses[-1].completion_tokens == len(tokens(responses)) == 12
    assert call[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED  # the stream ends with the last finish
    outputs = [tokens(groups[i]) for i in range(3)]
    assert len({tuple(o) for o in outputs}) == 3, "each completion draws its own tokens"
    single = await generate(scheduler.address, request("Three answers:", 12, **sampled))
    assert tokens(single) == outputs[0], "completion 0 keeps the request's seed"
    again = await generate(scheduler.address, request("Three answers:", 12, n=3, **sampled))
    assert [tokens(by_index(again)[i]) for i in range(3)] == outputs, "seeded: the same n completions"
    await wait_all_free(scheduler.address)


async def test_abort_ends_every_completion(tiny_pair: tuple[Service, Service]) -> None:
    """Long requests, seen running (a first message), are ended while the worker is stopped:
    none can end by itself meanwhile."""
    worker, scheduler = tiny_pair
    async with grpc.aio.insecure_channel(scheduler.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        long = request("abort us", 1500, rid="n-abort", n=4, ignore_eos=True)
        call = stub.Generate(long, timeout=CALL_TIMEOUT_S)
        assert isinstance(await call.read(), pb.GenerateResponse)
        with paused(worker.proc):
            abort = pb.AbortRequest(request_id="n-abort")
            assert (await stub.Abort(abort, timeout=CALL_TIMEOUT_S)).aborted
        finishes: dict[int, int] = {}
        while isinstance(r := await call.read(), pb.GenerateResponse):
            if r.finish_reason:
                finishes[r.index] = r.finish_reason
        assert finishes == dict.fromkeys(range(4), pb.FINISH_REASON_ABORT)
        long = request("cancel us", 1500, rid="n-cancel", n=3, ignore_eos=True)
        cancelled = stub.Generate(long, timeout=CALL_TIMEOUT_S)
        await cancelled.read()
        with paused(worker.proc):
            info = await server_info(scheduler.address)
            assert info.requests_running + info.requests_waiting == 3  # all live when cancelled
            cancelled.cancel()
    await wait_all_free(scheduler.address)


async def test_logprobs_come_with_each_token(tiny_pair: tuple[Service, Service]) -> None:
    _, scheduler = tiny_pair
    greedy: dict[str, Any] = dict(temperature=0.0, ignore_eos=True)
    plain = await generate(scheduler.address, request("Log me", 10, **greedy))
    assert all(not r.logprobs for r in plain)
    call = await generate(scheduler.address, request("Log me", 10, logprobs=True, top_logprobs=4, **greedy))
    assert tokens(call) == tokens(plain), "log-probabilities do not change the tokens"
    entries = [lp for r in call for lp in r.logprobs]
    assert [lp.token_id for lp in entries] == tokens(call)
    for lp in entries:
        top = [(t.token_id, t.logprob) for t in lp.top_logprobs]
        assert len(top) == 4 and [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        assert top[0][0] == lp.token_id and top[0][1] == pytest.approx(lp.logprob), "greedy: the most likely"
        assert lp.logprob < 0
    only_chosen = await generate(scheduler.address, request("Log me", 10, logprobs=True, **greedy))
    chosen = [lp for r in only_chosen for lp in r.logprobs]
    assert [lp.logprob for lp in chosen] == [lp.logprob for lp in entries]
    assert all(not lp.top_logprobs for lp in chosen)


async def test_features_leave_nothing_behind(tiny_pair: tuple[Service, Service]) -> None:
    _, scheduler = tiny_pair
    features: dict[str, Any] = dict(
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=1.0,
        min_tokens=3,
        logit_bias={70: 5.0, 71: -100.0},
        logprobs=True,
        top_logprobs=2,
    )
    calls = [request(f"busy {i}", 16, n=1 + i % 3, temperature=i % 2, seed=i, **features) for i in range(12)]
    results = await asyncio.gather(*(generate(scheduler.address, c) for c in calls))
    for call, responses in zip(calls, results, strict=True):
        groups = by_index(responses)
        assert sorted(groups) == list(range(call.sampling.n))
        for group in groups.values():
            assert len(tokens(group)) >= 3 and 71 not in tokens(group)
    await wait_all_free(scheduler.address)


def test_the_cli_client_sends_the_penalties() -> None:
    argv = ["Hi", "--repetition-penalty", "1.3", "--presence-penalty", "0.5", "--frequency-penalty", "-1"]
    sampling = build_request(parse_args([*argv, "--min-tokens", "4"])).sampling
    assert sampling.HasField("repetition_penalty") and sampling.repetition_penalty == pytest.approx(1.3)
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.min_tokens) == (0.5, -1.0, 4)
    assert not build_request(parse_args(["Hi"])).sampling.HasField("repetition_penalty")
