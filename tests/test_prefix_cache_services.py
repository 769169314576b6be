"""The prefix cache through live processes (tiny worker, overlap scheduler, frontends in 0 or 2
processes, and `--no-prefix-cache`): each response's `cached_tokens`, OpenAI's
`usage.prompt_tokens_details.cached_tokens`, GetServerInfo's cache figures, and the same text
whether the prompt was cached or not."""

from __future__ import annotations

import random
from collections.abc import Iterator

import openai
import pytest

from stepahead.processes import Service, serving_pair
from stepahead.v1 import generation_pb2 as pb
from tests.live import FRONTEND_COUNTS, frontend_flags, generate, unused_port, wait_all_free

pytestmark = pytest.mark.anyio
TINY = ["--model", "tiny", "--check-invariants", "--kv-slots", "4096"]
# The pair (and its prefix cache) is the module's: each test has prompts of its own, which share no
# prefix with another test's (distinct first tokens), so what a test finds cached is what it
# cached itself, in any order.
PROMPT = [33, *(random.Random(1).randrange(32, 127) for _ in range(99))]
USAGE_PROMPT = [34, *(random.Random(2).randrange(32, 127) for _ in range(49)), *[66] * 30]


@pytest.fixture(scope="module", params=[*FRONTEND_COUNTS, "off"], ids=lambda p: f"frontends={p}")
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[Service, bool]]:
    """The scheduler, and whether its prefix cache is on."""
    off = request.param == "off"
    flags = ["--no-prefix-cache"] if off else frontend_flags(int(request.param))
    with serving_pair(TINY, ["--http-port", str(unused_port()), *flags]) as (_, scheduler):
        yield scheduler, not off


def ids_request(ids: list[int], max_new_tokens: int) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    return pb.GenerateRequest(input_ids=pb.TokenIds(ids=ids), sampling=sampling)


def tokens(responses: list[pb.GenerateResponse]) -> list[int]:
    return [t for r in responses for t in r.token_ids]


async def test_responses_say_how_much_of_the_prompt_was_cached(pair: tuple[Service, bool]) -> None:
    scheduler, cache = pair
    before = await wait_all_free(scheduler.address)
    first = await generate(scheduler.address, ids_request(PROMPT, 6))
    again = await generate(scheduler.address, ids_request([*PROMPT, 65], 6))
    assert {r.cached_tokens for r in first} == {0}
    assert {r.cached_tokens for r in again} == {len(PROMPT) if cache else 0}
    repeat = await generate(scheduler.address, ids_request(PROMPT, 6))
    assert tokens(repeat) == tokens(first), "a cached prompt gives the tokens its computation gave"
    assert {r.cached_tokens for r in repeat} == {len(PROMPT) - 1 if cache else 0}  # its last is computed
    info = await wait_all_free(scheduler.address)
    saved = info.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens
    assert saved == (2 * len(PROMPT) - 1 if cache else 0)
    assert (info.prefix_cache_slots > 0) == cache


async def test_openai_usage_reports_the_cached_prompt_tokens(pair: tuple[Service, bool]) -> None:
    scheduler, cache = pair
    async with openai.AsyncOpenAI(base_url=f"{scheduler.http_url}/v1", api_key="x", max_retries=0) as client:
        prompt = USAGE_PROMPT
        await client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
        whole = await client.completions.create(
            model="tiny", prompt=[*prompt, 67], max_tokens=4, temperature=0
        )
        assert whole.usage is not None and whole.usage.prompt_tokens_details is not None
        assert whole.usage.prompt_tokens_details.cached_tokens == (len(prompt) if cache else 0)
        stream = await client.completions.create(
            model="tiny",
            prompt=[*prompt, 68],
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        usages = [chunk.usage async for chunk in stream if chunk.usage is not None]
        assert [u.prompt_tokens_details.cached_tokens for u in usages if u.prompt_tokens_details] == [
            len(prompt) if cache else 0
        ]
    await wait_all_free(scheduler.address)
