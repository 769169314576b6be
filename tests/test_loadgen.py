"""The load generator without a real server: statistics, arrivals, workloads, reports, and
run_benchmark against a scripted in-process Generation service on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from datetime import datetime
from itertools import count, islice
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeAlias

import grpc
import numpy as np
import pytest

from loadgen import (
    BenchmarkConfig,
    BenchmarkResult,
    JsonlDataset,
    RandomDataset,
    Slos,
    benchmark,
    client,
    run_benchmark,
)
from loadgen.arrivals import arrival_intervals, send_offsets
from loadgen.backend import GRPC_BACKENDS, BackendName, Sampling
from loadgen.cli import build_parser, config_from_args
from loadgen.cli import run as run_cli
from loadgen.client import build_request, open_channels, received
from loadgen.openai_protocol import chat_body, completion_body
from loadgen.progress import render_progress
from loadgen.records import RequestRecord
from loadgen.report import format_summary, result_json
from loadgen.stats import (
    distribution_ms,
    end_to_end_latency,
    inter_token_latencies,
    meets_slos,
    parse_slos,
    peak_concurrency,
    summarize,
    time_per_output_token,
    time_to_first_token,
)
from loadgen.timing import RequestTiming
from loadgen.workload import (
    WARMUP_STREAM,
    JsonlWorkload,
    PrefixRepetitionDataset,
    PrefixRepetitionWorkload,
    PromptSpec,
    RandomWorkload,
    WorkloadError,
    length_bounds,
    load_jsonl,
    load_workload,
    sends_token_ids,
)
from stepahead.v1 import generation_pb2 as pb
from stepahead.v1 import generation_pb2_grpc
from tests.live import CALL_TIMEOUT_S, POLL_S, SETTLE_TIMEOUT_S
from tests.test_loadgen_openai import ScriptedOpenAI
from tests.test_loadgen_openai import serve as serve_openai

pytestmark = pytest.mark.anyio
Context: TypeAlias = grpc.aio.ServicerContext[Any, Any]

# Hand-built requests; times in seconds since the benchmark start.
# COALESCED: 5 tokens in messages of 1, 1 and 3 (the client lagged before the last one).
COALESCED = RequestRecord(
    index=0,
    input_len=10,
    send_time=0.0,
    end_time=0.6,
    message_times=(0.1, 0.3, 0.6),
    message_tokens=(1, 1, 3),
    finish_reason="LENGTH",
)
# FIRST_COALESCED: 3 tokens, 2 in its first message, then a bare finish message at 0.5.
FIRST_COALESCED = RequestRecord(
    index=1,
    input_len=20,
    send_time=0.0,
    end_time=0.5,
    message_times=(0.2, 0.4),
    message_tokens=(2, 1),
    finish_reason="STOP",
)
ONE_TOKEN = RequestRecord(
    index=2,
    input_len=30,
    send_time=1.0,
    end_time=1.05,
    message_times=(1.05,),
    message_tokens=(1,),
    finish_reason="LENGTH",
)
UNAVAILABLE = RequestRecord(index=3, input_len=40, send_time=0.0, end_time=0.01, error="UNAVAILABLE")
INVALID = RequestRecord(
    index=4,
    input_len=50,
    send_time=0.5,
    end_time=0.51,
    error="INVALID_ARGUMENT",
    error_detail="sampling.max_new_tokens: too many",
)
RECORDS = (COALESCED, FIRST_COALESCED, ONE_TOKEN, UNAVAILABLE, INVALID)


# --- statistics ---


def test_distribution_percentiles_interpolate_linearly() -> None:
    d = distribution_ms([0.010, 0.040, 0.020, 0.100, 0.030])
    assert d.count == 5
    assert d.mean == pytest.approx(40.0)
    assert d.median == pytest.approx(30.0)
    assert d.p90 == pytest.approx(76.0)  # rank 3.6: 40 + 0.6 * (100 - 40)
    assert d.p99 == pytest.approx(97.6)  # rank 3.96
    assert d.std == pytest.approx(math.sqrt(1000.0))  # population: (900+400+100+0+3600) / 5


def test_distribution_of_nothing_is_all_zero() -> None:
    d = distribution_ms([])
    assert (d.count, d.mean, d.median, d.std, d.p90, d.p99) == (0, 0.0, 0.0, 0.0, 0.0, 0.0)


def test_per_request_latencies_with_coalesced_messages() -> None:
    assert time_to_first_token(COALESCED) == pytest.approx(0.1)
    assert end_to_end_latency(COALESCED) == pytest.approx(0.6)
    assert time_per_output_token(COALESCED) == pytest.approx(0.5 / 4)
    # the 3-token message's 0.3 s gap is spread over its 3 tokens
    assert inter_token_latencies(COALESCED) == pytest.approx([0.2, 0.1, 0.1, 0.1])


def test_tokens_of_the_first_message_get_no_itl_and_a_bare_finish_ends_e2e() -> None:
    assert time_to_first_token(FIRST_COALESCED) == pytest.approx(0.2)
    assert end_to_end_latency(FIRST_COALESCED) == pytest.approx(0.5)
    assert time_per_output_token(FIRST_COALESCED) == pytest.approx(0.3 / 2)
    assert inter_token_latencies(FIRST_COALESCED) == pytest.approx([0.2])


def test_one_token_request_has_no_tpot_and_no_itl() -> None:
    assert time_to_first_token(ONE_TOKEN) == pytest.approx(0.05)
    assert time_per_output_token(ONE_TOKEN) is None
    assert inter_token_latencies(ONE_TOKEN) == []


def test_summary_counts_throughputs_and_latencies_of_completed_requests() -> None:
    s = summarize(RECORDS, duration_s=2.0)
    assert (s.completed, s.failed) == (3, 2)
    assert s.errors == {"UNAVAILABLE": 1, "INVALID_ARGUMENT": 1}
    assert s.finish_reasons == {"LENGTH": 2, "STOP": 1}
    assert (s.total_input_tokens, s.total_output_tokens) == (60, 9)
    assert s.request_throughput == pytest.approx(1.5)
    assert s.output_throughput == pytest.approx(4.5)
    assert s.total_token_throughput == pytest.approx(34.5)
    assert s.request_goodput is None
    assert (s.ttft.count, s.tpot.count, s.itl.count, s.e2el.count) == (3, 2, 5, 3)
    assert s.ttft.mean == pytest.approx((100 + 200 + 50) / 3)
    assert s.tpot.mean == pytest.approx((125 + 150) / 2)  # the one-token request has no TPOT
    assert s.itl.mean == pytest.approx((200 + 100 + 100 + 100 + 200) / 5)
    assert s.e2el.median == pytest.approx(500.0)


def test_a_completed_request_without_tokens_has_e2e_but_no_ttft() -> None:
    aborted = RequestRecord(index=0, input_len=3, send_time=0.0, end_time=0.25, finish_reason="ABORT")
    s = summarize([aborted], duration_s=1.0)
    assert (s.completed, s.ttft.count, s.e2el.count) == (1, 0, 1)
    assert s.e2el.mean == pytest.approx(250.0)
    assert not meets_slos(aborted, Slos(ttft=1000))
    assert meets_slos(aborted, Slos(e2el=1000))


@pytest.mark.parametrize(
    ("slos", "good"),
    [
        (Slos(ttft=150), {0, 2}),  # FIRST_COALESCED has TTFT 200 ms
        (Slos(tpot=130), {0, 2}),  # FIRST_COALESCED has TPOT 150 ms; one token counts as TPOT 0
        (Slos(e2el=500), {1, 2}),  # inclusive: FIRST_COALESCED takes exactly 500 ms; COALESCED 600
        (Slos(ttft=150, e2el=500), {2}),
        (Slos(ttft=1000, tpot=1000, e2el=1000), {0, 1, 2}),
    ],
)
def test_goodput_counts_completed_requests_meeting_every_slo(slos: Slos, good: set[int]) -> None:
    assert {r.index for r in RECORDS if meets_slos(r, slos)} == good
    assert summarize(RECORDS, duration_s=2.0, slos=slos).request_goodput == pytest.approx(len(good) / 2)


def test_parse_slos() -> None:
    assert parse_slos(["ttft:200", "e2el:5000.5"]) == Slos(ttft=200.0, e2el=5000.5)
    assert parse_slos([]) == Slos() and not Slos().given
    for bad in (["ttfb:200"], ["ttft:fast"], ["ttft:0"], ["tpot:5", "tpot:6"], ["ttft"]):
        with pytest.raises(ValueError, match="goodput"):
            parse_slos(bad)


def span(start: float, end: float) -> RequestRecord:
    return RequestRecord(index=0, input_len=1, send_time=start, end_time=end)


@pytest.mark.parametrize(
    ("spans", "peak"),
    [
        ([], 0),
        ([(0, 1)], 1),
        ([(0, 1), (1, 2)], 1),  # back to back: never two at once
        ([(0, 1), (0.5, 2), (1, 3), (2.5, 4)], 2),
        ([(0, 5), (1, 2), (1.5, 3), (1.8, 1.9), (4, 6)], 4),
    ],
)
def test_peak_concurrency_from_start_and_end_times(spans: list[tuple[float, float]], peak: int) -> None:
    assert peak_concurrency([span(*s) for s in spans]) == peak


# --- arrivals ---


def intervals(rate: float, burstiness: float, n: int = 20000, seed: int = 0) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(seed)
    return np.fromiter(islice(arrival_intervals(rate, burstiness, rng), n), dtype=np.float64)


@pytest.mark.parametrize("shape", [0.5, 1.0, 4.0])
def test_gamma_intervals_have_mean_one_over_rate_and_cv_one_over_sqrt_shape(shape: float) -> None:
    gaps = intervals(rate=20.0, burstiness=shape)
    assert gaps.mean() == pytest.approx(1 / 20.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(shape), rel=0.05)


def test_same_seed_same_intervals() -> None:
    assert np.array_equal(intervals(5.0, 1.0, n=50, seed=7), intervals(5.0, 1.0, n=50, seed=7))
    assert not np.array_equal(intervals(5.0, 1.0, n=50, seed=7), intervals(5.0, 1.0, n=50, seed=8))


def test_infinite_rate_gives_zero_intervals() -> None:
    assert list(islice(arrival_intervals(math.inf, 0.5, np.random.default_rng(0)), 100)) == [0.0] * 100


def test_send_offsets_start_at_zero_and_accumulate_intervals() -> None:
    offsets = list(islice(send_offsets(10.0, 2.0, np.random.default_rng(3)), 6))
    gaps = list(islice(arrival_intervals(10.0, 2.0, np.random.default_rng(3)), 5))
    assert offsets[0] == 0.0
    assert offsets[1:] == pytest.approx(list(np.cumsum(gaps)))


@pytest.mark.parametrize(("rate", "burstiness"), [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0), (1.0, math.inf)])
def test_bad_arrival_parameters_are_refused(rate: float, burstiness: float) -> None:
    with pytest.raises(ValueError):
        next(arrival_intervals(rate, burstiness, np.random.default_rng(0)))


# --- workloads ---


def test_random_lengths_stay_within_the_range_ratio_bounds() -> None:
    workload = RandomWorkload(RandomDataset(input_len=100, output_len=20, range_ratio=0.25), seed=0)
    specs = [workload.prompt(i) for i in range(500)]
    input_lens = [len(s.prompt) for s in specs]
    output_lens = [s.output_len for s in specs]
    assert 75 <= min(input_lens) < max(input_lens) <= 125
    assert 15 <= min(output_lens) < max(output_lens) <= 25
    ids = {t for s in specs if isinstance(s.prompt, tuple) for t in s.prompt}
    assert len(ids) > 1 and min(ids) >= 32 and max(ids) <= 126


def test_length_bounds() -> None:
    assert length_bounds(100, 0.0) == (100, 100)
    assert length_bounds(10, 0.5) == (5, 15)
    assert length_bounds(1, 0.9) == (1, 2)  # never below one token


def test_zero_range_ratio_gives_exact_lengths_and_text_prompts_are_printable() -> None:
    workload = RandomWorkload(RandomDataset(input_len=64, output_len=8, as_text=True), seed=1)
    for spec in (workload.prompt(i) for i in range(20)):
        assert isinstance(spec.prompt, str) and len(spec.prompt) == 64 and spec.prompt.isprintable()
        assert spec.output_len == 8 and spec.known_input_len == 0


def test_random_prompts_depend_only_on_seed_stream_and_index() -> None:
    dataset = RandomDataset(input_len=32, output_len=8, range_ratio=0.5)
    a, b = RandomWorkload(dataset, seed=5), RandomWorkload(dataset, seed=5)
    assert [a.prompt(i) for i in (3, 1, 2)] == [b.prompt(i) for i in (3, 1, 2)]
    assert a.prompt(0) != RandomWorkload(dataset, seed=6).prompt(0)
    assert a.prompt(0) != RandomWorkload(dataset, seed=5, stream=1).prompt(0)


@pytest.mark.parametrize(
    "bad",
    [
        dict(range_ratio=1.0),
        dict(range_ratio=-0.1),
        dict(input_len=0),
        dict(output_len=0),
    ],
)
def test_bad_random_dataset_is_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        RandomDataset(**bad)


def ids_of(spec: PromptSpec) -> tuple[int, ...]:
    assert isinstance(spec.prompt, tuple)
    return spec.prompt


def test_prefix_repetition_lengths_ids_and_round_robin_prefixes() -> None:
    workload = PrefixRepetitionWorkload(PrefixRepetitionDataset(16, 8, 3, 5), seed=0)
    specs = [workload.prompt(i) for i in range(30)]
    assert all(len(ids_of(s)) == 24 and s.output_len == 5 and s.known_input_len == 24 for s in specs)
    assert {t for s in specs for t in ids_of(s)} <= set(range(32, 127))
    assert [workload.prefix_index(i) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert len({ids_of(s)[16:] for s in specs}) == 30  # every suffix is the request's own


def common_prefix_len(prompts: list[tuple[int, ...]]) -> int:
    """How many leading ids every prompt has in common."""
    first = prompts[0]
    return next((i for i in range(len(first)) if any(p[i] != first[i] for p in prompts)), len(first))


def test_requests_of_one_prefix_share_exactly_its_leading_ids() -> None:
    workload = PrefixRepetitionWorkload(PrefixRepetitionDataset(16, 8, 3, 5), seed=0)
    groups = [[ids_of(workload.prompt(i)) for i in range(k, 30, 3)] for k in range(3)]
    for k, group in enumerate(groups):
        assert common_prefix_len(group) == 16
        assert group[0][:16] == workload.prefixes[k]
    assert len({group[0][:16] for group in groups}) == 3


def test_prefix_repetition_depends_only_on_seed_stream_and_index() -> None:
    dataset = PrefixRepetitionDataset(32, 8, 2, 4)
    a, b = load_workload(dataset, 5), load_workload(dataset, 5)
    assert isinstance(a, PrefixRepetitionWorkload)
    assert [a.prompt(i) for i in (3, 1, 2)] == [b.prompt(i) for i in (3, 1, 2)]
    other_seed = ids_of(load_workload(dataset, 6).prompt(0))
    assert other_seed[:32] != ids_of(a.prompt(0))[:32]
    warmup = ids_of(load_workload(dataset, 5, WARMUP_STREAM).prompt(0))
    assert warmup[:32] == ids_of(a.prompt(0))[:32] and warmup[32:] != ids_of(a.prompt(0))[32:]


def test_prefix_repetition_text_is_the_same_characters_and_a_suffix_may_be_empty() -> None:
    ids = PrefixRepetitionWorkload(PrefixRepetitionDataset(12, 4, 2, 3), seed=1)
    text = PrefixRepetitionWorkload(PrefixRepetitionDataset(12, 4, 2, 3, as_text=True), seed=1)
    for i in range(6):
        prompt = text.prompt(i).prompt
        assert isinstance(prompt, str) and prompt.isprintable() and text.prompt(i).known_input_len == 0
        assert prompt == "".join(map(chr, ids_of(ids.prompt(i))))
    bare = PrefixRepetitionWorkload(PrefixRepetitionDataset(12, 0, 1, 3), seed=1)
    assert bare.prompt(0) == bare.prompt(1) and len(ids_of(bare.prompt(0))) == 12


@pytest.mark.parametrize(
    "bad",
    [dict(prefix_len=0), dict(suffix_len=-1), dict(num_prefixes=0), dict(output_len=0)],
)
def test_bad_prefix_repetition_dataset_is_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        PrefixRepetitionDataset(**bad)


def test_prefix_repetition_prompts_in_the_openai_bodies() -> None:
    dataset = PrefixRepetitionDataset(8, 4, 2, 3)
    spec = load_workload(dataset, 0).prompt(0)
    text_spec = load_workload(replace(dataset, as_text=True), 0).prompt(0)
    sampling = Sampling(0.0, ignore_eos=True)
    assert completion_body(spec, "m", sampling)["prompt"] == list(ids_of(spec))
    assert completion_body(text_spec, "m", sampling)["prompt"] == text_spec.prompt
    assert chat_body(text_spec, "m", sampling)["messages"] == [{"role": "user", "content": text_spec.prompt}]
    assert sends_token_ids(dataset) and not sends_token_ids(replace(dataset, as_text=True))
    with pytest.raises(ValueError, match="--prompt-as-text"):
        BenchmarkConfig(backend="openai-chat", dataset=dataset)
    BenchmarkConfig(backend="openai-chat", dataset=replace(dataset, as_text=True))  # text is accepted


@pytest.mark.parametrize(("backend", "as_text"), [("openai", False), ("openai", True), ("openai-chat", True)])
async def test_prefix_repetition_runs_over_the_openai_backends(backend: BackendName, as_text: bool) -> None:
    server = ScriptedOpenAI()
    runner, url = await serve_openai(server)
    dataset = PrefixRepetitionDataset(10, 3, 2, 4, as_text=as_text)
    try:
        config = BenchmarkConfig(backend=backend, base_url=url, dataset=dataset, num_prompts=4)
        result = await run_benchmark(config)
    finally:
        await runner.cleanup()
    assert (result.summary.completed, result.summary.total_input_tokens) == (4, 4 * 13)
    prompts = [b["messages"][0]["content"] if "messages" in b else b["prompt"] for b in server.bodies]
    assert all(isinstance(p, str) == as_text and len(p) == 13 for p in prompts)
    assert sorted(Counter(str(p[:10]) for p in prompts).values()) == [2, 2]  # two prefixes, twice each


def write_lines(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_jsonl_prompts_with_default_output_len_skip_blank_lines_and_cycle(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path,
        '{"prompt": "Hello", "output_len": 64}',
        "",
        '{"prompt": "Bonjour", "output_len": null}',
        '{"prompt": "Hi", "extra": 1}',
    )
    specs = load_jsonl(path, default_output_len=16)
    assert specs == (PromptSpec("Hello", 64), PromptSpec("Bonjour", 16), PromptSpec("Hi", 16))
    workload = load_workload(JsonlDataset(path, 16), seed=0)
    assert isinstance(workload, JsonlWorkload)
    assert [workload.prompt(i).prompt for i in range(5)] == ["Hello", "Bonjour", "Hi", "Hello", "Bonjour"]


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ('{"prompt": "unterminated', "not valid JSON"),
        ('["prompt", "x"]', "expected a JSON object, got list"),
        ('{"text": "x"}', '"prompt" must be a non-empty string'),
        ('{"prompt": ""}', '"prompt" must be a non-empty string'),
        ('{"prompt": "x", "output_len": 0}', '"output_len" must be an integer >= 1, got 0'),
        ('{"prompt": "x", "output_len": "64"}', "\"output_len\" must be an integer >= 1, got '64'"),
        ('{"prompt": "x", "output_len": true}', '"output_len" must be an integer >= 1, got True'),
    ],
)
def test_bad_jsonl_line_is_named_by_file_and_line_number(tmp_path: Path, bad_line: str, message: str) -> None:
    path = write_lines(tmp_path, '{"prompt": "fine"}', "", bad_line, '{"prompt": "also fine"}')
    with pytest.raises(WorkloadError) as err:
        load_jsonl(path, default_output_len=16)
    assert str(err.value).startswith(f"{path}:3: ")
    assert message in str(err.value)


def test_empty_or_missing_jsonl_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="no prompts"):
        load_jsonl(write_lines(tmp_path, "", "  "), 16)
    with pytest.raises(WorkloadError, match="cannot read"):
        load_jsonl(tmp_path / "missing.jsonl", 16)


# --- one request's timing ---


def test_request_timing_records_messages_and_the_server_prompt_length() -> None:
    timing = RequestTiming(7, PromptSpec((65, 66), 4))
    timing.sent(1.0)
    received(timing, 1.2, pb.GenerateResponse(token_ids=[1], prompt_tokens=2, completion_tokens=1))
    received(timing, 1.5, pb.GenerateResponse(token_ids=[2, 3, 4], prompt_tokens=2, completion_tokens=4))
    received(
        timing,
        1.6,
        pb.GenerateResponse(finish_reason=pb.FINISH_REASON_LENGTH, prompt_tokens=2, completion_tokens=4),
    )
    timing.ended(1.7)
    assert timing.record(9.0) == RequestRecord(
        index=7,
        input_len=2,
        send_time=1.0,
        end_time=1.6,
        message_times=(1.2, 1.5),
        message_tokens=(1, 3),
        finish_reason="LENGTH",
    )


def test_request_timing_failed_and_never_closed() -> None:
    failed = RequestTiming(0, PromptSpec("text", 4))
    failed.sent(0.5)
    failed.failed(0.6, "INVALID_ARGUMENT", "sampling.max_new_tokens: too many")
    record = failed.record(9.0)
    assert (record.error, record.end_time, record.input_len, record.ok) == ("INVALID_ARGUMENT", 0.6, 0, False)
    in_flight = RequestTiming(1, PromptSpec((65,), 4))
    in_flight.sent(0.5)
    assert in_flight.record(2.0).error == "CANCELLED" and in_flight.record(3.0).end_time == 2.0
    never_sent = RequestTiming(2, PromptSpec((65,), 4)).record(2.0)
    assert (never_sent.error, never_sent.send_time, never_sent.end_time) == ("CANCELLED", 2.0, 2.0)


def test_build_request_sends_ids_or_text() -> None:
    ids = build_request(PromptSpec((72, 105), 8), Sampling(0.5, ignore_eos=True))
    assert ids.WhichOneof("input") == "input_ids" and list(ids.input_ids.ids) == [72, 105]
    assert (ids.sampling.max_new_tokens, ids.sampling.temperature, ids.sampling.ignore_eos) == (8, 0.5, True)
    text = build_request(PromptSpec("Hi", 3), Sampling(0.0, ignore_eos=False))
    assert (text.WhichOneof("input"), text.text, text.request_id) == ("text", "Hi", "")


FEATURE_FLAGS = [
    "--top-p",
    "0.9",
    "--top-k",
    "40",
    "--repetition-penalty",
    "1.2",
    "--presence-penalty",
    "0.5",
]
FEATURE_FLAGS += [
    "--frequency-penalty",
    "-1",
    "--min-tokens",
    "3",
    "--logprobs",
    "5",
    "--logit-bias",
    "13:-100",
    "42:5",
]


def test_sampling_feature_flags_reach_the_grpc_request_and_the_openai_bodies() -> None:
    config = config_from_args(build_parser().parse_args(["--num-prompts", "1", *FEATURE_FLAGS]))
    sampling = Sampling(0.7, True, config.features)
    s = build_request(PromptSpec((72,), 8), sampling).sampling
    assert (s.top_p, s.top_k, s.repetition_penalty, s.presence_penalty) == pytest.approx((0.9, 40, 1.2, 0.5))
    assert (s.frequency_penalty, s.min_tokens, s.logprobs, s.top_logprobs) == (-1.0, 3, True, 5)
    assert dict(s.logit_bias) == {13: -100.0, 42: 5.0}
    chat = chat_body(PromptSpec("Hi", 8), "m", sampling)
    assert (chat["logprobs"], chat["top_logprobs"], chat["logit_bias"]) == (
        True,
        5,
        {"13": -100.0, "42": 5.0},
    )
    completion = completion_body(PromptSpec("Hi", 8), "m", sampling)
    assert completion["logprobs"] == 5 and "top_logprobs" not in completion
    assert (completion["repetition_penalty"], completion["min_tokens"], completion["top_k"]) == (1.2, 3, 40)
    plain = completion_body(PromptSpec("Hi", 8), "m", Sampling(0.0, False))
    assert not {"logprobs", "logit_bias", "presence_penalty", "top_p", "min_tokens"} & set(plain)
    bad = build_parser().parse_args(["--num-prompts", "1", "--logit-bias", "13"])
    with pytest.raises(ValueError, match="--logit-bias: '13' is not ID:BIAS"):
        config_from_args(bad)


# --- reports ---


def result_of(records: tuple[RequestRecord, ...], config: BenchmarkConfig) -> BenchmarkResult:
    return BenchmarkResult(
        config,
        datetime(2025, 1, 2, 3, 4, 5),
        records,
        summarize(records, 2.0, config.slos),
        interrupted=False,
        warmup_failed=0,
    )


SUMMARY_KEYS = {
    "date",
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "max_concurrency",
    "peak_concurrency",
    "errors",
    "num_prompts",
    "request_rate",
    "burstiness",
} | {
    f"{stat}_{metric}_ms"
    for stat in ("mean", "median", "std", "p90", "p99")
    for metric in ("ttft", "tpot", "itl", "e2el")
}
DETAILED_KEYS = {"input_lens", "output_lens", "ttfts", "itls", "request_errors"}


def test_result_json_keys_and_values() -> None:
    result = result_of(RECORDS, BenchmarkConfig(num_prompts=5, max_concurrency=4))
    plain = result_json(result)
    assert plain.keys() >= SUMMARY_KEYS and not DETAILED_KEYS & plain.keys()
    assert "request_goodput" not in plain
    assert plain["date"] == "20250102-030405" and plain["request_rate"] == "inf"
    assert (plain["completed"], plain["failed"], plain["max_concurrency"]) == (3, 2, 4)
    assert plain["errors"] == {"UNAVAILABLE": 1, "INVALID_ARGUMENT": 1}
    assert plain["mean_tpot_ms"] == pytest.approx(result.summary.tpot.mean)
    assert plain["p99_itl_ms"] == pytest.approx(result.summary.itl.p99)


def test_detailed_result_json_has_per_request_arrays() -> None:
    config = BenchmarkConfig(num_prompts=5, request_rate=4.0, slos=Slos(ttft=150))
    data = result_json(result_of(RECORDS, config), detailed=True)
    assert data["request_goodput"] == pytest.approx(1.0) and data["request_rate"] == 4.0
    assert data["input_lens"] == [10, 20, 30, 40, 50]
    assert data["output_lens"] == [5, 3, 1, 0, 0]
    assert data["ttfts"] == pytest.approx([0.1, 0.2, 0.05, 0.0, 0.0])
    assert data["itls"] == [pytest.approx([0.2, 0.1, 0.1, 0.1]), pytest.approx([0.2]), [], [], []]
    assert data["request_errors"] == [
        "",
        "",
        "",
        "UNAVAILABLE",
        "INVALID_ARGUMENT: sampling.max_new_tokens: too many",
    ]


def test_summary_table_shows_counts_errors_and_latencies() -> None:
    table = format_summary(result_of(RECORDS, BenchmarkConfig(slos=Slos(e2el=500))))
    lines = table.splitlines()
    assert "Successful requests:                    3" in lines
    assert "Failed requests:                        2" in lines
    assert "  UNAVAILABLE:                          1" in lines
    assert "Request goodput (req/s):                1.00" in lines
    assert "Peak concurrent requests:               3" in lines
    assert "Mean TPOT (ms):                         137.50" in lines
    for metric in ("TTFT", "TPOT", "ITL", "E2EL"):
        assert any(line.startswith(f"P90 {metric} (ms):") for line in lines)
        assert any(line.startswith(f"P99 {metric} (ms):") for line in lines)


def test_summary_table_of_no_completed_request() -> None:
    table = format_summary(result_of((UNAVAILABLE,), BenchmarkConfig()))
    assert "TTFT (ms):                              n/a (no samples)" in table.splitlines()


def test_progress_line() -> None:
    assert (
        render_progress(5, 0, 10, 2.5, None)
        == "[###############...............] 5/10 requests  2.0 req/s  0:02.5 elapsed"
    )
    assert (
        render_progress(30, 2, None, 75.0, 300.0)
        == "[########......................] 30 requests  0.4 req/s  1:15.0 elapsed  (2 failed)"
    )
    assert render_progress(0, 0, 3, 0.0, None).startswith("[" + "." * 30 + "] 0/3 requests  0.0 req/s")


# --- command line ---


def parse(*argv: str) -> BenchmarkConfig:
    return config_from_args(build_parser().parse_args(list(argv)))


def test_cli_defaults_and_flags() -> None:
    assert parse() == BenchmarkConfig()
    config = parse(
        "--server",
        "10.0.0.1:9000",
        "--request-rate",
        "12.5",
        "--burstiness",
        "0.5",
        "--max-concurrency",
        "8",
        "--duration",
        "30",
        "--seed",
        "3",
        "--warmup",
        "2",
        "--random-input-len",
        "64",
        "--random-output-len",
        "16",
        "--random-range-ratio",
        "0.1",
        "--prompt-as-text",
        "--ignore-eos",
        "--temperature",
        "0.7",
        "--connections",
        "3",
        "--goodput",
        "ttft:100",
        "tpot:20",
    )
    assert config == BenchmarkConfig(
        server="10.0.0.1:9000",
        dataset=RandomDataset(64, 16, 0.1, as_text=True),
        num_prompts=None,
        duration_s=30.0,
        request_rate=12.5,
        burstiness=0.5,
        max_concurrency=8,
        connections=3,
        seed=3,
        warmup=2,
        ignore_eos=True,
        temperature=0.7,
        slos=Slos(ttft=100.0, tpot=20.0),
    )
    jsonl = parse("--dataset", "jsonl", "--dataset-path", "p.jsonl", "--default-output-len", "7")
    assert jsonl.dataset == JsonlDataset(Path("p.jsonl"), 7) and jsonl.num_prompts == 1000


def test_cli_prefix_repetition_defaults_are_vllms_and_its_flags() -> None:
    assert parse("--dataset", "prefix-repetition").dataset == PrefixRepetitionDataset(256, 256, 10, 128)
    flags = ["--prefix-repetition-prefix-len", "1024", "--prefix-repetition-suffix-len", "32"]
    flags += ["--prefix-repetition-num-prefixes", "1", "--prefix-repetition-output-len", "64"]
    config = parse("--dataset", "prefix-repetition", *flags, "--prompt-as-text")
    assert config.dataset == PrefixRepetitionDataset(1024, 32, 1, 64, as_text=True)
    assert parse(*flags).dataset == RandomDataset()  # the flags of another dataset are ignored
    with pytest.raises(ValueError, match="--prompt-as-text"):
        parse("--backend", "openai-chat", "--dataset", "prefix-repetition")


@pytest.mark.parametrize(
    "argv",
    [
        ["--dataset", "jsonl"],
        ["--request-rate", "0"],
        ["--duration", "5"],  # unbounded at an infinite rate
        ["--num-prompts", "0"],
        ["--max-concurrency", "0"],
        ["--connections", "0"],
        ["--random-range-ratio", "1"],
        ["--temperature", "-1"],
        ["--dataset", "prefix-repetition", "--prefix-repetition-num-prefixes", "0"],
        ["--dataset", "prefix-repetition", "--prefix-repetition-prefix-len", "0"],
    ],
)
def test_cli_refuses_bad_configurations(argv: list[str]) -> None:
    with pytest.raises(ValueError):
        parse(*argv)


def test_cli_names_the_bad_line_of_a_dataset_before_sending_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_lines(tmp_path, '{"prompt": "ok"}', "{nope")
    assert run_cli(["--server", "127.0.0.1:1", "--dataset", "jsonl", "--dataset-path", str(path)]) == 2
    assert f"error: {path}:2: not valid JSON" in capsys.readouterr().err


# --- run_benchmark against a scripted service ---


class ScriptedGeneration(generation_pb2_grpc.GenerationServicer):
    """Streams `max_new_tokens` tokens, `chunk` per message, one message per `step_s`, once
    `hold_until` requests have arrived (so that many are surely in flight together).
    A text prompt "fail:NAME" is refused with that status; "hang" streams until cancelled."""

    def __init__(
        self, step_s: float = 0.0, chunk: int = 1, hold_until: int = 0, abort_read_s: float = 0.0
    ) -> None:
        self.step_s, self.chunk, self.hold_until = step_s, chunk, hold_until
        self.abort_read_s = abort_read_s  # a slow server: each abort is read this much later
        self.received = 0
        self.peers: dict[str, str] = {}  # the client address each text prompt came from
        self.cancelled = 0
        self.aborted: list[str] = []  # request ids aborted on GenerateMany calls
        self.all_in = asyncio.Event()

    async def Generate(
        self, request: pb.GenerateRequest, context: Context
    ) -> AsyncIterator[pb.GenerateResponse]:
        self.received += 1
        self.peers[request.text] = context.peer()
        if self.received >= self.hold_until:
            self.all_in.set()
        await self.all_in.wait()
        if request.text.startswith("fail:"):
            await context.abort(grpc.StatusCode[request.text.removeprefix("fail:")], "scripted failure")
        finished = False
        try:
            async for response in self.stream(request):
                yield response
            finished = True
        finally:
            self.cancelled += not finished

    async def stream(self, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateResponse]:
        n = 10**9 if request.text == "hang" else request.sampling.max_new_tokens
        prompt_tokens = len(request.input_ids.ids) or len(request.text)
        for done in range(self.chunk, n + self.chunk, self.chunk):
            await asyncio.sleep(self.step_s)
            count = min(done, n)
            yield pb.GenerateResponse(
                token_ids=[65] * (count - done + self.chunk),
                prompt_tokens=prompt_tokens,
                completion_tokens=count,
                finish_reason=pb.FINISH_REASON_LENGTH if count == n else pb.FINISH_REASON_UNSPECIFIED,
            )

    async def GenerateMany(
        self, requests: AsyncIterator[pb.GenerateManyRequest], context: Context
    ) -> AsyncIterator[pb.GenerateManyResponse]:
        """Generate's script for each request on the call; each message carries what the
        requests' streams have made since the last (a refusal as an error entry). An abort ends
        its request's stream without a last response (it counts as cancelled)."""
        outbox: asyncio.Queue[pb.GenerateResponse | pb.ManyError | None] = asyncio.Queue()
        streams: dict[str, asyncio.Task[None]] = {}

        async def run(request: pb.GenerateRequest) -> None:
            self.received += 1
            self.peers[request.text] = context.peer()
            if self.received >= self.hold_until:
                self.all_in.set()
            await self.all_in.wait()
            if request.text.startswith("fail:"):
                code = grpc.StatusCode[request.text.removeprefix("fail:")].value[0]
                refusal = pb.ManyError(request_id=request.request_id, code=code, message="scripted failure")
                outbox.put_nowait(refusal)
                return
            finished = False
            try:
                async for response in self.stream(request):
                    response.request_id = request.request_id
                    outbox.put_nowait(response)
                finished = True
            finally:
                self.cancelled += not finished

        async def read() -> None:
            async for message in requests:
                if message.WhichOneof("kind") == "generate":
                    streams[message.generate.request_id] = asyncio.create_task(run(message.generate))
                else:
                    await asyncio.sleep(self.abort_read_s)
                    self.aborted.append(message.abort.request_id)
                    streams[message.abort.request_id].cancel()
            await asyncio.gather(*streams.values(), return_exceptions=True)
            outbox.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            ended = False
            while not ended and (item := await outbox.get()) is not None:
                items = [item]
                while not outbox.empty():
                    more = outbox.get_nowait()
                    if more is None:
                        ended = True
                        break
                    items.append(more)
                yield pb.GenerateManyResponse(
                    responses=[i for i in items if isinstance(i, pb.GenerateResponse)],
                    errors=[i for i in items if isinstance(i, pb.ManyError)],
                )
        finally:
            reader.cancel()
            for task in streams.values():
                task.cancel()

    async def Abort(self, request: pb.AbortRequest, context: Context) -> pb.AbortResponse:
        return pb.AbortResponse()

    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: Context
    ) -> pb.GetServerInfoResponse:
        return pb.GetServerInfoResponse()


async def serve(servicer: ScriptedGeneration) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def bench_against(
    servicer: ScriptedGeneration, config: BenchmarkConfig, stop: asyncio.Event | None = None
) -> BenchmarkResult:
    server, address = await serve(servicer)
    try:
        return await run_benchmark(_at(config, address), stop)
    finally:
        await server.stop(None)


def _at(config: BenchmarkConfig, address: str) -> BenchmarkConfig:
    return replace(config, server=address)


class StopAfter:
    """Sets `stop` once `after` measured requests are done."""

    def __init__(self, stop: asyncio.Event, after: int) -> None:
        self.stop, self.after, self.done = stop, after, 0

    def on_start(self) -> None:
        pass

    def on_request_done(self, record: RequestRecord) -> None:
        self.done += 1
        if self.done == self.after:
            self.stop.set()


async def until(condition: Callable[[], bool], what: str) -> None:
    """Polls `condition` on this loop (SETTLE_TIMEOUT_S at most: a hang guard)."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} after {SETTLE_TIMEOUT_S:g}s")
        await asyncio.sleep(POLL_S)


def jsonl(tmp_path: Path, lines: list[str]) -> JsonlDataset:
    return JsonlDataset(write_lines(tmp_path, *lines), default_output_len=4)


@pytest.mark.parametrize("backend", GRPC_BACKENDS)
async def test_coalesced_messages_count_every_token_and_warmup_is_not_measured(backend: BackendName) -> None:
    servicer = ScriptedGeneration(chunk=3)
    dataset = RandomDataset(input_len=8, output_len=10)
    config = BenchmarkConfig(dataset=dataset, num_prompts=6, warmup=2, backend=backend)
    result = await bench_against(servicer, config)
    assert servicer.received == 8 and len(result.records) == 6
    s = result.summary
    assert (s.completed, s.failed, s.total_input_tokens, s.total_output_tokens) == (6, 0, 48, 60)
    assert [r.message_tokens for r in result.records] == [(3, 3, 3, 1)] * 6
    assert s.itl.count == 6 * 7 and s.tpot.count == 6 and not result.interrupted


@pytest.mark.parametrize("backend", GRPC_BACKENDS)
async def test_errors_are_counted_by_status_name(tmp_path: Path, backend: BackendName) -> None:
    lines = [
        '{"prompt": "fine"}',
        '{"prompt": "fail:INVALID_ARGUMENT"}',
        '{"prompt": "fail:UNAVAILABLE"}',
        '{"prompt": "fail:INVALID_ARGUMENT"}',
    ]
    result = await bench_against(
        ScriptedGeneration(), BenchmarkConfig(dataset=jsonl(tmp_path, lines), num_prompts=4, backend=backend)
    )
    assert (result.summary.completed, result.summary.failed) == (1, 3)
    assert result.summary.errors == {"INVALID_ARGUMENT": 2, "UNAVAILABLE": 1}
    assert result.records[1].error_detail == "scripted failure"


@pytest.mark.parametrize("backend", GRPC_BACKENDS)
async def test_max_concurrency_bounds_requests_in_flight(backend: BackendName) -> None:
    config = BenchmarkConfig(dataset=RandomDataset(4, 3), num_prompts=12, max_concurrency=3, backend=backend)
    result = await bench_against(ScriptedGeneration(step_s=0.001, hold_until=3), config)
    assert result.summary.completed == 12 and result.summary.peak_concurrency == 3


async def test_duration_stops_issuing_and_lets_in_flight_requests_finish(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The benchmark's clock is the test's: it stands still while the first two requests are
    issued (the server holds them), then passes the duration; only then are they answered."""
    now = [0.0]
    monkeypatch.setattr(benchmark, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    servicer = ScriptedGeneration(hold_until=10**9)  # held until the test lets them go
    config = BenchmarkConfig(dataset=RandomDataset(4, 5), num_prompts=None, duration_s=1.0, max_concurrency=2)
    run = asyncio.create_task(bench_against(servicer, config))
    await until(lambda: servicer.received == 2, "two requests in flight")
    now[0] = 2.0
    servicer.all_in.set()
    result = await asyncio.wait_for(run, CALL_TIMEOUT_S)
    s = result.summary
    assert s.completed == 2 == servicer.received and s.failed == 0 and not result.interrupted
    assert s.total_output_tokens == 5 * s.completed
    assert s.duration_s >= max(r.end_time for r in result.records)


@pytest.mark.parametrize("backend", GRPC_BACKENDS)
async def test_stop_cancels_in_flight_requests_and_keeps_the_completed(
    tmp_path: Path, backend: BackendName
) -> None:
    """grpc-many: each cancelled request is aborted on the call, and the call is half-closed and
    left for the server to end, so a server slow to read still hears every abort."""
    servicer = ScriptedGeneration(step_s=0.001, hold_until=4, abort_read_s=0.05)
    stop = asyncio.Event()
    config = BenchmarkConfig(
        dataset=jsonl(tmp_path, ['{"prompt": "quick", "output_len": 2}'] + ['{"prompt": "hang"}'] * 3),
        num_prompts=4,
        backend=backend,
    )
    server, address = await serve(servicer)
    try:
        result = await run_benchmark(_at(config, address), stop, StopAfter(stop, after=1))
        # The server hears of the cancellations asynchronously.
        await until(lambda: servicer.cancelled == 3, "three requests cancelled")
    finally:
        await server.stop(None)
    assert result.interrupted and servicer.cancelled == 3
    assert len(servicer.aborted) == (3 if backend == "grpc-many" else 0)
    assert (result.summary.completed, result.summary.failed) == (1, 3)
    assert result.summary.errors == {"CANCELLED": 3}
    assert all(r.end_time <= result.summary.duration_s for r in result.records)


@pytest.mark.parametrize("backend", GRPC_BACKENDS)
async def test_unreachable_server_fails_every_request_as_unavailable(backend: BackendName) -> None:
    """One at a time over one connection: with grpc-many, a request after a failed call starts
    a new one."""
    dataset = RandomDataset(4, 2)
    config = BenchmarkConfig(
        server="127.0.0.1:1",
        dataset=dataset,
        num_prompts=3,
        backend=backend,
        max_concurrency=1,
        connections=1,
    )
    result = await run_benchmark(config)
    assert (result.summary.completed, result.summary.failed) == (0, 3)
    assert result.summary.errors == {"UNAVAILABLE": 3}


async def test_bad_dataset_is_reported_before_connecting(tmp_path: Path) -> None:
    config = BenchmarkConfig(server="127.0.0.1:1", dataset=jsonl(tmp_path, ["{nope"]), num_prompts=1)
    with pytest.raises(WorkloadError, match=":1: not valid JSON"):
        await run_benchmark(config)


# --- connections ---


def numbered(tmp_path: Path, count: int) -> JsonlDataset:
    """Prompt i is the text "p<i>", so the server can tell which request came over which connection."""
    return jsonl(tmp_path, [json.dumps({"prompt": f"p{i}", "output_len": 2}) for i in range(count)])


@pytest.mark.parametrize(
    ("request_rate", "max_concurrency"),
    [(math.inf, 3), (400.0, None)],  # a closed loop, and Poisson arrivals
)
async def test_request_i_goes_over_connection_i_mod_n(
    tmp_path: Path, request_rate: float, max_concurrency: int | None
) -> None:
    servicer = ScriptedGeneration()
    config = BenchmarkConfig(
        dataset=numbered(tmp_path, 12),
        num_prompts=12,
        request_rate=request_rate,
        max_concurrency=max_concurrency,
        connections=4,
    )
    result = await bench_against(servicer, config)
    assert result.summary.completed == 12
    peers = [servicer.peers[f"p{i}"] for i in range(12)]
    assert len(set(peers)) == 4
    assert all(peers[i] == peers[i % 4] for i in range(12))


async def test_one_connection_carries_every_request(tmp_path: Path) -> None:
    servicer = ScriptedGeneration()
    config = BenchmarkConfig(dataset=numbered(tmp_path, 6), num_prompts=6, connections=1, warmup=2)
    result = await bench_against(servicer, config)
    assert result.summary.completed == 6 and len(set(servicer.peers.values())) == 1


class ReadyAtStart:
    """Records whether every channel was connected when the measured run started."""

    def __init__(self, channels: list[grpc.aio.Channel]) -> None:
        self.channels = channels
        self.ready_at_start: bool | None = None

    def on_start(self) -> None:
        ready = grpc.ChannelConnectivity.READY
        self.ready_at_start = all(c.get_state() == ready for c in self.channels)

    def on_request_done(self, record: RequestRecord) -> None:
        pass


async def test_every_connection_is_up_before_the_measured_run_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[grpc.aio.Channel] = []

    def recording_open(server: str, count: int) -> list[grpc.aio.Channel]:
        opened.extend(open_channels(server, count))
        return opened

    monkeypatch.setattr(client, "open_channels", recording_open)
    observer = ReadyAtStart(opened)
    server, address = await serve(ScriptedGeneration())
    try:
        config = BenchmarkConfig(server=address, dataset=RandomDataset(4, 2), num_prompts=2, connections=5)
        result = await run_benchmark(config, observer=observer)
    finally:
        await server.stop(None)
    assert len(opened) == 5 and observer.ready_at_start and result.summary.completed == 2


async def test_the_default_run_keeps_its_summary_and_result_keys() -> None:
    config = BenchmarkConfig(dataset=RandomDataset(4, 3), num_prompts=10)
    assert config.connection_limit == 8 and parse().connection_limit == 8
    result = await bench_against(ScriptedGeneration(), config)
    assert (result.summary.completed, result.summary.failed, result.summary.total_output_tokens) == (
        10,
        0,
        30,
    )
    data = result_json(result)
    assert data.keys() == SUMMARY_KEYS | {
        "backend",
        "server",
        "model",
        "interrupted",
        "finish_reasons",
        "connections",
    }
    assert (data["backend"], data["model"], data["connections"]) == ("grpc", None, 8)
    assert "Successful requests:                    10" in format_summary(result).splitlines()


# --- replicas: several servers ---


def test_cli_server_and_base_url_name_replicas() -> None:
    assert parse("--server", "10.0.0.1:9000,10.0.0.2:9000").server == "10.0.0.1:9000,10.0.0.2:9000"
    assert parse("--server", "dns:///schedulers:50051").server == "dns:///schedulers:50051"
    urls = "http://10.0.0.1:8000,http://10.0.0.2:8000"
    assert parse("--backend", "openai", "--base-url", urls).base_url == urls


@pytest.mark.parametrize(
    "argv",
    [
        ["--server", "10.0.0.1:9000,,10.0.0.2:9000"],
        ["--server", "dns:///a:1,b:2"],
        ["--backend", "openai", "--base-url", "http://10.0.0.1:8000,10.0.0.2:8000"],
        ["--backend", "openai", "--base-url", "http://10.0.0.1:8000,"],
    ],
)
def test_cli_refuses_bad_replica_lists(argv: list[str]) -> None:
    with pytest.raises(ValueError):
        parse(*argv)


def test_cli_reports_a_server_name_that_does_not_resolve(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--server", "127.0.0.1:1,no-such-host.invalid:1", "--num-prompts", "1", "--no-progress"]
    assert run_cli(argv) == 2
    assert "error: --server: cannot resolve no-such-host.invalid" in capsys.readouterr().err


def connected_to_every_replica(
    replicas: list[ScriptedGeneration],
) -> Callable[[grpc.aio.Channel], Awaitable[None]]:
    """loadgen's `connect`, then probes over the channel until each replica got one: round robin
    sends calls only to the replicas whose connection is up, so all of them are up then."""
    connect = client.connect

    async def connected(channel: grpc.aio.Channel) -> None:
        await connect(channel)
        stub = generation_pb2_grpc.GenerationStub(channel)
        tag = f"probe over {id(channel)}"
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        probes = count()
        while not all(any(text.startswith(tag) for text in r.peers) for r in replicas):
            assert time.monotonic() < deadline, f"a replica never reached after {SETTLE_TIMEOUT_S:g}s"
            text = f"{tag} #{next(probes)}"
            probe = pb.GenerateRequest(text=text, sampling=pb.SamplingParams(max_new_tokens=1))
            [_ async for _ in stub.Generate(probe, timeout=CALL_TIMEOUT_S)]
            await asyncio.sleep(POLL_S)

    return connected


async def test_each_connection_sends_its_requests_round_robin_over_the_replicas(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    replicas = [ScriptedGeneration(), ScriptedGeneration()]
    served = [await serve(servicer) for servicer in replicas]
    monkeypatch.setattr(client, "connect", connected_to_every_replica(replicas))
    config = BenchmarkConfig(
        server=",".join(address for _, address in served),
        dataset=RandomDataset(16, 2, as_text=True),  # the warmup's prompts differ from the measured
        num_prompts=24,
        max_concurrency=4,
        connections=2,
        warmup=8,
    )
    try:
        result = await run_benchmark(config)
    finally:
        await asyncio.gather(*(server.stop(None) for server, _ in served))
    workload = load_workload(config.dataset, config.seed)
    texts = [workload.prompt(i).prompt for i in range(24)]
    assert result.summary.completed == 24
    measured = [sum(text in servicer.peers for text in texts) for servicer in replicas]
    assert measured == [12, 12], measured  # every connection alternates: request i, i + 2, ...
    connections = [{servicer.peers[t] for t in texts if t in servicer.peers} for servicer in replicas]
    assert [len(c) for c in connections] == [2, 2]  # both connections reach both replicas


async def test_http_requests_go_to_the_base_urls_in_turn() -> None:
    replicas = [ScriptedOpenAI(), ScriptedOpenAI()]
    served = [await serve_openai(server) for server in replicas]
    config = BenchmarkConfig(
        backend="openai",
        base_url=",".join(url for _, url in served),
        dataset=RandomDataset(4, 2),
        num_prompts=6,
    )
    try:
        result = await run_benchmark(config)
    finally:
        await asyncio.gather(*(runner.cleanup() for runner, _ in served))
    workload = load_workload(config.dataset, config.seed)
    sent = [sorted(tuple(body["prompt"]) for body in server.bodies) for server in replicas]
    expected = [sorted(tuple(workload.prompt(i).prompt) for i in range(k, 6, 2)) for k in (0, 1)]
    assert result.summary.completed == 6 and sent == expected  # request i to URL i mod 2
    assert [server.model_lists for server in replicas] == [1, 0]  # the model comes from the first
