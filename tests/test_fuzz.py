"""Random GenerateRequests against one live sim pair: every answer is a result or a client error,
never an internal one, and the server is whole afterwards."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import TypeVar

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepahead.processes import Service, serving_pair
from stepahead.v1 import generation_pb2 as pb
from stepahead.v1 import generation_pb2_grpc
from tests.live import CALL_TIMEOUT_S, all_free, wait_until
from worker_svc.backends import sim_continuation as sim_expected

SIM = ["--model", "sim", "--sim-step-ms", "1", "--sim-token-us", "0", "--kv-slots", "4096"]
VOCAB = 258
ACCEPTABLE = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS}
UINT32_MAX, UINT64_MAX = 2**32 - 1, 2**64 - 1
T = TypeVar("T")

# Each field is drawn valid most of the time and hostile otherwise, so that a fair share of the
# requests pass validation and run. Accepted requests stay small (max_new_tokens <= 8, prompts of a
# few thousand tokens at most): each takes milliseconds, far inside CALL_TIMEOUT_S (a hang guard).
HOSTILE_ONE_IN = 8


def mostly(valid: st.SearchStrategy[T], hostile: st.SearchStrategy[T]) -> st.SearchStrategy[T]:
    return st.integers(1, HOSTILE_ONE_IN).flatmap(lambda k: hostile if k == HOSTILE_ONE_IN else valid)


in_vocab = st.integers(0, VOCAB - 1)
any_id = st.one_of(st.integers(0, VOCAB + 10), st.integers(0, UINT32_MAX))
any_float32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
printable = st.characters(categories=["L", "N", "P", "S"])
request_ids = mostly(st.text(printable, max_size=24), st.text(max_size=300))
texts = mostly(
    st.one_of(
        st.text(min_size=1, max_size=64),
        st.builds(
            lambda unit, times: unit * times, st.text(printable, min_size=1, max_size=1), st.integers(1, 3000)
        ),
    ),
    st.one_of(
        st.just(""),
        st.builds(
            lambda unit, times: unit * times, st.text(min_size=1, max_size=4), st.integers(1000, 20000)
        ),
    ),
)
token_ids = mostly(st.lists(in_vocab, min_size=1, max_size=48), st.lists(any_id, max_size=48))
max_new_tokens = mostly(st.integers(1, 8), st.one_of(st.just(0), st.integers(4097, UINT32_MAX)))
temperatures = mostly(st.floats(0, 2, width=32), any_float32)
top_ps = mostly(st.none() | st.floats(0, 1, exclude_min=True, width=32), any_float32)
stop_token_ids = mostly(st.lists(in_vocab, max_size=4), st.lists(any_id, min_size=1, max_size=270))
stops = mostly(
    st.lists(st.text(min_size=1, max_size=6), max_size=3), st.lists(st.text(max_size=300), max_size=20)
)


@st.composite
def sampling_params(draw: st.DrawFn) -> pb.SamplingParams:
    params = pb.SamplingParams(
        max_new_tokens=draw(max_new_tokens),
        temperature=draw(temperatures),
        top_k=draw(st.integers(0, UINT32_MAX)),
        stop_token_ids=draw(stop_token_ids),
        stop=draw(stops),
        ignore_eos=draw(st.booleans()),
    )
    if (top_p := draw(top_ps)) is not None:
        params.top_p = top_p
    if (seed := draw(st.none() | st.integers(0, UINT64_MAX))) is not None:
        params.seed = seed
    return params


@st.composite
def generate_requests(draw: st.DrawFn) -> pb.GenerateRequest:
    request = pb.GenerateRequest(request_id=draw(request_ids))
    which = draw(mostly(st.sampled_from(["text", "input_ids"]), st.just("none")))
    if which == "text":
        request.text = draw(texts)
    elif which == "input_ids":
        request.input_ids.ids.extend(draw(token_ids))
    if draw(mostly(st.just(True), st.just(False))):
        request.sampling.CopyFrom(draw(sampling_params()))
    return request


@pytest.fixture(scope="module")
def sim_pair() -> Iterator[tuple[Service, Service]]:
    with serving_pair(SIM) as pair:
        yield pair


def generate_status(stub: generation_pb2_grpc.GenerationStub, request: pb.GenerateRequest) -> grpc.StatusCode:
    try:
        for _ in stub.Generate(request, timeout=CALL_TIMEOUT_S):
            pass
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def wait_all_free(stub: generation_pb2_grpc.GenerationStub) -> None:
    """The last request's release may trail its final message."""
    info = pb.GetServerInfoRequest()
    wait_until(lambda: all_free(stub.GetServerInfo(info, timeout=CALL_TIMEOUT_S)), "all slots free")


def test_random_requests_never_get_an_internal_error(sim_pair: tuple[Service, Service]) -> None:
    _, scheduler = sim_pair
    statuses: Counter[grpc.StatusCode] = Counter()
    with grpc.insecure_channel(scheduler.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        @settings(
            max_examples=150,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(generate_requests())
        def answered_as_a_client_error_at_worst(request: pb.GenerateRequest) -> None:
            status = generate_status(stub, request)
            statuses[status] += 1
            assert status in ACCEPTABLE, (status, request)

        answered_as_a_client_error_at_worst()
        # The run exercised both sides of validation, not only refusals.
        assert statuses[grpc.StatusCode.OK] >= 10 and statuses[grpc.StatusCode.INVALID_ARGUMENT] >= 10, (
            statuses
        )

        health = health_pb2_grpc.HealthStub(channel)
        reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=CALL_TIMEOUT_S)  # type: ignore[attr-defined]
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        normal = pb.GenerateRequest(
            text="still fine", sampling=pb.SamplingParams(max_new_tokens=6, ignore_eos=True)
        )
        tokens = [t for r in stub.Generate(normal, timeout=CALL_TIMEOUT_S) for t in r.token_ids]
        assert tokens == sim_expected(b"still fine", 6)
        wait_all_free(stub)
