"""The frontend's stream pacing (scheduler_svc/frontend/pacing.py): while its event loop keeps
up, every due stream is woken in the step that made it due; once the loop runs late (forced
here by blocking it), due streams are woken every `factor` steps, so their tokens merge into
fewer messages, with a request's first token and its finish never held and nothing held past
MAX_HOLD_S; the factor comes back down once the loop keeps up. A frontend with few messages to
send (under MIN_MESSAGES_PER_S) holds nothing, however late its loop."""

from __future__ import annotations

import asyncio
import time

import pytest

from scheduler_svc.contract import FinishReason, StepOutputs
from scheduler_svc.frontend import pacing
from scheduler_svc.frontend.frontend import Frontend, FrontendConfig
from scheduler_svc.frontend.pacing import MAX_FACTOR, StreamPacer
from tests.harness import params
from tests.test_openai_sampling import SCRIPTED_INFO, ScriptedCore

pytestmark = pytest.mark.anyio


class Stream:
    def __init__(self) -> None:
        self.ready = asyncio.Event()
        self.due = True


BUSY = pacing.MIN_MESSAGES_PER_S * 10  # due wakes a second: a frontend with many streams


def test_the_factor_doubles_while_behind_and_halves_after_a_calm_spell() -> None:
    pacer = StreamPacer()
    factors = []
    for _ in range(6):
        pacer.observe(0.05, BUSY)
        factors.append(pacer.factor)
    assert factors == [2, 4, 8, MAX_FACTOR, MAX_FACTOR, MAX_FACTOR]
    calm = 0
    while pacer.factor == MAX_FACTOR:
        pacer.observe(0.0, BUSY)
        calm += 1
    assert calm >= pacing.CALM_PROBES and pacer.factor == MAX_FACTOR // 2
    for _ in range(200):
        pacer.observe(0.0, BUSY)
    assert pacer.factor == 1


async def test_few_messages_are_never_held_however_late_the_loop() -> None:
    """A lone client on a machine whose cores the forward takes: the loop runs late, but its
    tokens still leave at once; a held stream is woken as soon as the rate falls."""
    pacer = StreamPacer()
    for _ in range(20):
        pacer.observe(0.05, pacing.MIN_MESSAGES_PER_S / 4)
    assert pacer.factor == 1
    for _ in range(20):
        pacer.observe(0.05, BUSY)
    assert pacer.factor == MAX_FACTOR
    stream = Stream()
    pacer.release([stream])
    assert not stream.ready.is_set()  # held
    while pacer.factor > 1:
        pacer.observe(0.05, 0.0)
    assert stream.ready.is_set()
    pacer.release([stream])
    assert stream.ready.is_set()


async def test_at_factor_1_every_due_stream_wakes_in_its_step() -> None:
    pacer, streams = StreamPacer(), [Stream() for _ in range(3)]
    pacer.release(streams[:2])
    assert [s.ready.is_set() for s in streams] == [True, True, False]


async def test_behind_due_streams_wake_every_factor_steps_and_never_past_the_hold() -> None:
    held = []
    pacer = StreamPacer(lambda: held.append(1))
    pacer.factor = 4
    stream = Stream()
    woken_at = []
    for step in range(1, 9):
        pacer.release([stream])
        if stream.ready.is_set():
            woken_at.append(step)
            stream.ready.clear()
    assert woken_at == [4, 8] and len(held) == 6
    pacer.release([stream])  # step 9: held; no step follows
    assert not stream.ready.is_set()
    await asyncio.wait_for(stream.ready.wait(), pacing.MAX_HOLD_S * 10)


async def test_a_blocked_loop_raises_the_factor_and_stopping_resets_it() -> None:
    pacer = StreamPacer()
    pacer.watch()
    many = [Stream() for _ in range(int(pacing.MIN_MESSAGES_PER_S * pacing.PROBE_S * 4))]
    for _ in range(8):
        pacer.release(many)  # four times the rate below which nothing is held
        time.sleep(pacing.PROBE_S)  # the loop is blocked: the probe runs late by about this much
        await asyncio.sleep(0)
    await asyncio.sleep(pacing.PROBE_S * 2)
    assert pacer.factor > 1 and pacer.lag_s > pacing.BEHIND_S
    pacer.stop()
    assert pacer.factor == 1


async def test_the_frontend_holds_neither_a_first_token_nor_a_finish() -> None:
    """Forced behind (factor 4): the reader gets the first token alone, then the tokens of four
    steps a message, and the finish at once."""
    core = ScriptedCore()
    frontend = Frontend(FrontendConfig())
    frontend.core = core
    frontend.worker_state(SCRIPTED_INFO, True)
    completions = frontend.submit("r", [65, 66], params(32, ignore_eos=True))
    handle = core.specs[0].handle
    frontend.pacer.factor = 4
    messages = []
    for i in range(10):
        outputs = StepOutputs()
        outputs.add(handle, 97 + i, FinishReason.LENGTH if i == 9 else None)
        frontend.send(outputs)
        if completions.ready.is_set():
            messages.append(completions.take()[0][1].token_ids)
    assert messages == [[97], [98, 99, 100], [101, 102, 103, 104], [105, 106]]
    assert completions.done


async def test_a_stream_read_while_held_is_not_woken_for_less_than_its_interval() -> None:
    """--stream-interval 4: woken in one step but read late, after the next step held it again
    (the factor rose meanwhile); the flush that follows must not send the one token since."""
    core = ScriptedCore()
    frontend = Frontend(FrontendConfig(stream_interval=4))
    frontend.core = core
    frontend.worker_state(SCRIPTED_INFO, True)
    completions = frontend.submit("r", [65, 66], params(32, ignore_eos=True))
    handle = core.specs[0].handle

    def step(token: int) -> None:
        outputs = StepOutputs()
        outputs.add(handle, token, None)
        frontend.send(outputs)

    for token in range(97, 101):
        step(token)
    assert completions.ready.is_set()  # four pending: woken at factor 1
    frontend.pacer.factor = 2
    step(101)  # due again (five pending): held, its step is odd
    assert [chunk.token_ids for _, chunk in completions.take()] == [[97, 98, 99, 100, 101]]
    step(102)  # the held stream's flush step: one token pending
    assert not completions.ready.is_set()
    for token in range(103, 106):
        step(token)
    frontend.pacer.flush()
    assert completions.ready.is_set()
    assert [chunk.token_ids for _, chunk in completions.take()] == [[102, 103, 104, 105]]
