"""The event loop every Stepahead process runs its asyncio code on.

uvloop (libuv) where it is installed, as uvicorn, vLLM's API server and SGLang do: the same
asyncio API, with the loop's own work per wakeup (ready callbacks, timers, socket readiness,
the wakeups gRPC's completion thread sends the loop) in C instead of Python. That work is paid
per step and per message by the core, the frontends and the worker, so it is a share of the
scheduler's CPU per token (docs/BENCHMARKS.md). `STEPAHEAD_EVENT_LOOP=asyncio` runs the
standard library's loop instead, e.g. to rule the loop out when chasing a problem.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any, Literal, TypeVar

EVENT_LOOP_ENV = "STEPAHEAD_EVENT_LOOP"
LoopName = Literal["uvloop", "asyncio"]
T = TypeVar("T")


def chosen() -> LoopName:
    """uvloop unless the environment asks for asyncio or uvloop cannot be imported."""
    wanted = os.environ.get(EVENT_LOOP_ENV, "uvloop")
    if wanted not in ("uvloop", "asyncio"):
        raise SystemExit(f"{EVENT_LOOP_ENV}={wanted!r}: expected 'uvloop' or 'asyncio'")
    if wanted == "asyncio":
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def loop_factory(name: LoopName) -> Callable[[], asyncio.AbstractEventLoop] | None:
    if name == "asyncio":
        return None
    import uvloop

    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run(main) on the chosen loop."""
    name = chosen()
    with asyncio.Runner(loop_factory=loop_factory(name)) as runner:
        return runner.run(main)


def running() -> LoopName:
    """The running loop's kind, as start-up logs say it."""
    return "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") else "asyncio"
