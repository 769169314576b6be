"""The event loop every process runs: uvloop by default, the standard loop on request, both
serving end to end."""

from __future__ import annotations

import asyncio

import pytest

from stepahead import event_loop
from stepahead.processes import serving_pair
from tests.live import frontend_flags, generate, request, wait_frontends_serving
from worker_svc.backends import sim_continuation as sim_expected

SIM = ["--model", "sim", "--sim-step-ms", "2", "--kv-slots", "1024"]


async def _running() -> str:
    return event_loop.running()


def test_uvloop_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(event_loop.EVENT_LOOP_ENV, raising=False)
    assert event_loop.chosen() == "uvloop"
    assert event_loop.run(_running()) == "uvloop"


def test_standard_loop_on_request(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(event_loop.EVENT_LOOP_ENV, "asyncio")
    assert event_loop.run(_running()) == "asyncio"


def test_unknown_loop_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(event_loop.EVENT_LOOP_ENV, "trio")
    with pytest.raises(SystemExit, match=f"{event_loop.EVENT_LOOP_ENV}='trio'"):
        event_loop.chosen()


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_services_serve_on_either_loop(loop: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Worker, core and a frontend process each say which loop they run, and a request streams
    the expected tokens through all three on it."""
    monkeypatch.setenv(event_loop.EVENT_LOOP_ENV, loop)
    with serving_pair(SIM, frontend_flags(1)) as (worker, scheduler):
        asyncio.run(wait_frontends_serving(scheduler.address, 1))
        responses = asyncio.run(generate(scheduler.address, request("loop", 6, ignore_eos=True)))
        said = [line for line in [*worker.output, *scheduler.output] if "event loop: " in line]
    tokens = [t for r in responses for t in r.token_ids]
    assert tokens == sim_expected(b"loop", 6)
    assert len(said) == 3, said  # the worker, the core and its frontend process
    assert all(line.rstrip().endswith(f"event loop: {loop}") for line in said), said
