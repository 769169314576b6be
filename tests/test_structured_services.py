"""Structured outputs through the running services: the gRPC API's `structured` oneof, with 0
and 2 frontends and with a worker of two tensor-parallel ranks, gives the outputs of the
in-process serial loop; a worker killed mid-grammar loses nothing (its requests are recomputed:
prompt and outputs replayed into fresh matchers) and changes no output."""

from __future__ import annotations

import asyncio
import json
import pathlib
from dataclasses import replace

import grpc
import openai
import pytest
import torch

from bench.promtext import scrape, total
from scheduler_svc.contract import FinishReason
from stepahead.processes import STOP_TIMEOUT_S, serving_pair, spawn_scheduler, spawn_worker, wait_serving
from stepahead.protocol import Constraint
from stepahead.v1 import generation_pb2 as pb
from stepahead.v1 import generation_pb2_grpc
from tests.harness import ClientView, WorkItem, params, serve_workload
from tests.live import (
    CALL_TIMEOUT_S,
    FRONTEND_COUNTS,
    channels_by_frontend,
    frontend_flags,
    paused,
    server_info,
    unused_port,
    wait_all_free,
    wait_until,
    worker_stats_after_drain,
)
from tests.test_architectures import hf_checkpoint, write_char_tokenizer
from tests.test_faults import RETRY, stop_all, streamed
from tests.test_sampling_equivalence import assert_same_outputs, completions
from tests.test_structured import CONSTRAINTS, EOS, accepted_prefix, is_valid, structured_workload

TINY64 = [
    "--model",
    "tiny",
    "--dtype",
    "float64",
    "--check-invariants",
    "--kv-slots",
    "1500",
    "--request-slots",
    "48",
]


def structured_proto(item: WorkItem) -> pb.GenerateRequest:
    """The item as a client sends it: every sampling feature, and its constraint in the oneof."""
    p = item.params
    sampling = pb.SamplingParams(
        max_new_tokens=p.max_new_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        seed=p.seed,
        stop_token_ids=sorted(p.stop_token_ids),
        stop=list(p.stop),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs,
        top_logprobs=p.top_logprobs,
        repetition_penalty=p.repetition_penalty,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        min_tokens=p.min_tokens,
        logit_bias=dict(p.logit_bias),
        n=item.n,
    )
    c = p.constraint
    if c is not None:
        if c.kind == "json":
            sampling.json_schema = c.text
        elif c.kind == "regex":
            sampling.regex = c.text
        elif c.kind == "choice":
            sampling.choice.choices.extend(json.loads(c.text))
        else:
            sampling.grammar = c.text
    return pb.GenerateRequest(
        request_id=item.rid, input_ids=pb.TokenIds(ids=item.prompt_ids), sampling=sampling
    )


async def call(
    channel: grpc.aio.Channel, abort_channel: grpc.aio.Channel, item: WorkItem
) -> list[ClientView]:
    views = [ClientView() for _ in range(item.n)]
    stream = generation_pb2_grpc.GenerationStub(channel).Generate(
        structured_proto(item), timeout=CALL_TIMEOUT_S
    )
    aborted = False
    async for r in stream:
        view = views[r.index]
        view.token_ids += r.token_ids
        view.text += r.text
        view.finish_reason = FinishReason(r.finish_reason) if r.finish_reason else None
        if item.abort_after is not None and not aborted and len(views[0].token_ids) >= item.abort_after:
            aborted = True
            abort = pb.AbortRequest(request_id=item.rid)
            await generation_pb2_grpc.GenerationStub(abort_channel).Abort(abort, timeout=CALL_TIMEOUT_S)
    return views


async def serve_items(address: str, frontends: int, items: list[WorkItem]) -> dict[str, ClientView]:
    groups = await channels_by_frontend(address, frontends, per_frontend=2)
    channels = [c for group in zip(*groups.values(), strict=True) for c in group]  # alternate frontends
    try:
        tasks = {}
        for i, item in enumerate(items):
            await asyncio.sleep(item.delay_s)
            pair = channels[i % len(channels)], channels[(i + 1) % len(channels)]
            tasks[item.rid] = asyncio.create_task(call(*pair, item))
        views: dict[str, ClientView] = {}
        for rid, task in tasks.items():
            views.update({rid if i == 0 else f"{rid}/{i}": v for i, v in enumerate(await task)})
        return views
    finally:
        for channel in channels:
            await channel.close()


def tokens_only(items: list[WorkItem]) -> list[WorkItem]:
    """Log-probabilities aside (the equality of those is the in-process tests'), the workload."""
    return [replace(item, params=replace(item.params, logprobs=False, top_logprobs=0)) for item in items]


@pytest.fixture(scope="module")
def workload() -> tuple[list[WorkItem], dict[str, ClientView]]:
    """A smaller structured workload and its in-process serial outputs (the reference)."""
    items = tokens_only(structured_workload(30, seed=53, sampled=True))
    reference, _, _ = asyncio.run(
        serve_workload("tiny", "serial", items, kv_slots=1500, request_slots=48, dtype=torch.float64)
    )
    return items, reference


def run_live(
    worker_args: list[str], scheduler_args: list[str], frontends: int, items: list[WorkItem]
) -> dict[str, ClientView]:
    with serving_pair(
        worker_args, ["--max-batch-tokens", "128", *scheduler_args, *frontend_flags(frontends)]
    ) as (
        worker,
        scheduler,
    ):

        async def run() -> dict[str, ClientView]:
            got = await serve_items(scheduler.address, frontends, items)
            await wait_all_free(scheduler.address)
            stats = await worker_stats_after_drain(worker.address)
            assert stats.sentinel_reads == 0 and stats.out_of_order_launches == 0
            return got

        views = asyncio.run(run())
        assert total(scrape(scheduler.metrics_url), "stepahead_preemptions_total") > 0
        worker_metrics = scrape(worker.metrics_url)
        assert total(worker_metrics, "stepahead_grammar_masked_rows_total") > 0
        assert total(worker_metrics, "stepahead_grammar_violations_total") == 0
    return views


def check_same(items: list[WorkItem], reference: dict[str, ClientView], got: dict[str, ClientView]) -> None:
    assert_same_outputs(items, reference, got)
    for key, item in completions(items):
        c, view = item.params.constraint, got[key]
        if c is None:
            continue
        assert accepted_prefix(c, [t for t in view.token_ids if t != EOS]), key
        if view.finish_reason == FinishReason.STOP:
            assert is_valid(c, view.text), (key, view.text)


@pytest.mark.parametrize("frontends", FRONTEND_COUNTS, ids=lambda n: f"frontends={n}")
def test_live_overlap_gives_the_in_process_serial_outputs_whatever_the_frontends(
    frontends: int, workload: tuple[list[WorkItem], dict[str, ClientView]]
) -> None:
    items, reference = workload
    check_same(items, reference, run_live(TINY64, ["--mode", "overlap"], frontends, items))


def test_tp2_gives_the_one_rank_outputs(workload: tuple[list[WorkItem], dict[str, ClientView]]) -> None:
    """Rank 0 alone runs matchers and broadcasts its constrained rows' ids; --check-invariants
    has the ranks compare every step's ids."""
    items, reference = workload
    check_same(items, reference, run_live([*TINY64, "--tp", "2"], ["--mode", "overlap"], 0, items))


# ---- a worker lost mid-grammar ----------------------------------------------------------------

SIM = [
    "--model",
    "sim",
    "--sim-step-ms",
    "3",
    "--sim-token-us",
    "0",
    "--check-invariants",
    "--kv-slots",
    "65536",
]
NUMBERS = json.dumps(
    {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 999},
        "minItems": 90,
        "maxItems": 90,
    }
)
LOST_MAX_TOKENS = 300


def lost_items() -> list[WorkItem]:
    """Constrained calls that decode for hundreds of steps (the first words they can end are
    longer than that, or they end by their grammar later), greedy and seeded."""
    constraints = [Constraint("regex", "[a-z]{400}"), Constraint("json", NUMBERS), *CONSTRAINTS]
    return [
        WorkItem(
            f"g{i}",
            [40 + i, 50 + i % 7, 60],
            params(
                LOST_MAX_TOKENS,
                constraint=constraints[i % len(constraints)],
                temperature=0.7 * (i % 2),
                seed=i,
            ),
            0.0,
        )
        for i in range(14)
    ]


def test_a_worker_killed_mid_grammar_loses_nothing_and_changes_no_output() -> None:
    """SIGKILL of the worker while constrained requests decode (paused first, so that some are
    mid-word for sure), a new worker on the same port: every request is recomputed on it, its
    outputs replayed into fresh matchers, and ends with what an uninterrupted run gives."""
    items = lost_items()
    reference, _, _ = asyncio.run(serve_workload("sim", "serial", items, kv_slots=65536, request_slots=48))
    port = unused_port()
    worker = spawn_worker(SIM, port=port)
    scheduler = spawn_scheduler(f"127.0.0.1:{port}", RETRY)
    try:
        wait_serving(scheduler.address)

        async def load_with_a_crash() -> dict[str, ClientView]:
            nonlocal worker
            async with grpc.aio.insecure_channel(scheduler.address) as channel:
                tasks = {item.rid: asyncio.create_task(call(channel, channel, item)) for item in items}
                target = LOST_MAX_TOKENS // 4 * len(items) // 2
                await asyncio.to_thread(
                    wait_until, lambda: streamed(scheduler) >= target, "the load under way"
                )
                with paused(worker.proc):
                    assert (await server_info(scheduler.address)).requests_running > 0
                    worker.proc.kill()
                    worker.proc.wait(STOP_TIMEOUT_S)
                worker = await asyncio.to_thread(spawn_worker, SIM, port)
                return {rid: (await task)[0] for rid, task in tasks.items()}

        got = asyncio.run(load_with_a_crash())
        for item in items:
            view, expected = got[item.rid], reference[item.rid]
            assert (view.token_ids, view.finish_reason) == (expected.token_ids, expected.finish_reason), (
                item.rid
            )
            c = item.params.constraint
            assert c is not None and accepted_prefix(c, [t for t in view.token_ids if t != EOS]), item.rid
        running = [i for i in items if reference[i.rid].finish_reason == FinishReason.LENGTH]
        assert running, "some requests were mid-word at the kill"
        assert scheduler.stop() == 0
    finally:
        stop_all(scheduler, worker)


def test_over_the_wire_a_bad_constraint_is_invalid_argument_and_the_server_keeps_serving() -> None:
    with serving_pair(["--model", "sim", "--sim-step-ms", "1", "--check-invariants"]) as (_, scheduler):

        async def run() -> str:
            async with grpc.aio.insecure_channel(scheduler.address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                bad = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_new_tokens=8, regex="a("))
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    _ = [r async for r in stub.Generate(bad, timeout=CALL_TIMEOUT_S)]
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert (refused.value.details() or "").startswith("sampling.structured.regex: ")
                good = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_new_tokens=8))
                good.sampling.choice.choices.extend(["yes", "no"])
                replies = [r async for r in stub.Generate(good, timeout=CALL_TIMEOUT_S)]
                assert replies[-1].finish_reason == pb.FINISH_REASON_STOP
                return "".join(r.text for r in replies)

        assert asyncio.run(run()) in ("yes", "no")


def test_a_tokenizer_the_grammar_engine_cannot_read_refuses_constraints_at_admission(
    tmp_path: pathlib.Path,
) -> None:
    """A checkpoint whose tokenizer.json llguidance cannot read (no decoder): a constrained request
    gets INVALID_ARGUMENT (a 400 over HTTP) naming its field and why, and the server goes on
    serving everything else. It once reached the worker, failed every step it was in and the
    session with it, and took the other requests down with it, again and again."""
    hf_checkpoint("llama", tmp_path)
    write_char_tokenizer(tmp_path)  # one token per character, and no decoder
    http_port = unused_port()
    with serving_pair(["--model", str(tmp_path)], ["--http-port", str(http_port)]) as (_, scheduler):
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{http_port}/v1",
            api_key="unused",
            max_retries=0,
            timeout=CALL_TIMEOUT_S,
        )
        name = client.models.list().data[0].id
        with pytest.raises(openai.BadRequestError, match="cannot read this model's tokenizer") as refused:
            client.completions.create(
                model=name, prompt="ab", max_tokens=4, extra_body={"structured_outputs": {"regex": "[ab]+"}}
            )
        assert "structured_outputs.regex: not served with this model" in str(refused.value)

        async def grpc_calls() -> list[int]:
            async with grpc.aio.insecure_channel(scheduler.address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                constrained = pb.GenerateRequest(
                    text="ab", sampling=pb.SamplingParams(max_new_tokens=4, json_object=True)
                )
                with pytest.raises(grpc.aio.AioRpcError) as rpc_refused:
                    _ = [r async for r in stub.Generate(constrained, timeout=CALL_TIMEOUT_S)]
                assert rpc_refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert (rpc_refused.value.details() or "").startswith("sampling.structured.json_object: ")
                plain = pb.GenerateRequest(
                    text="ab", sampling=pb.SamplingParams(max_new_tokens=4, ignore_eos=True)
                )
                return [t async for r in stub.Generate(plain, timeout=CALL_TIMEOUT_S) for t in r.token_ids]

        assert len(asyncio.run(grpc_calls())) == 4
        done = client.completions.create(
            model=name, prompt="ab", max_tokens=4, extra_body={"ignore_eos": True}
        )
        assert done.usage is not None and done.usage.completion_tokens == 4
        assert asyncio.run(server_info(scheduler.address)).worker_connected
