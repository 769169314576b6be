"""A one-line progress display on a terminal, redrawn in place."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TextIO

from loadgen.records import RequestRecord

BAR_WIDTH = 30
REFRESH_S = 0.25


def render_progress(
    done: int, failed: int, total: int | None, elapsed_s: float, duration_s: float | None
) -> str:
    """`total` None: the run is bounded by `duration_s` and the bar follows time instead."""
    if total is not None:
        fraction, count = done / total, f"{done}/{total}"
    else:
        fraction, count = elapsed_s / (duration_s or 1.0), f"{done}"
    filled = round(BAR_WIDTH * min(1.0, fraction))
    rate = done / elapsed_s if elapsed_s > 0 else 0.0
    line = (
        f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {count} requests  {rate:.1f} req/s  "
        f"{_clock(elapsed_s)} elapsed"
    )
    return line + (f"  ({failed} failed)" if failed else "")


def _clock(seconds: float) -> str:
    minutes, secs = divmod(seconds, 60)
    return f"{int(minutes)}:{secs:04.1f}"


class ProgressBar:
    """An Observer of the measured run; `close` draws the last state and ends the line."""

    def __init__(self, stream: TextIO, total: int | None, duration_s: float | None) -> None:
        self.stream, self.total, self.duration_s = stream, total, duration_s
        self.done = self.failed = 0
        self.started = time.perf_counter()
        self.ticker: asyncio.Task[None] | None = None

    def on_start(self) -> None:
        self.started = time.perf_counter()
        self.ticker = asyncio.create_task(self._tick())

    def on_request_done(self, record: RequestRecord) -> None:
        self.done += 1
        self.failed += not record.ok

    async def _tick(self) -> None:
        while True:
            self.draw()
            await asyncio.sleep(REFRESH_S)

    def draw(self) -> None:
        elapsed = time.perf_counter() - self.started
        line = render_progress(self.done, self.failed, self.total, elapsed, self.duration_s)
        self.stream.write("\r" + line + "\x1b[K")
        self.stream.flush()

    async def close(self) -> None:
        if self.ticker is None:
            return
        self.ticker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.ticker
        self.draw()
        self.stream.write("\n")
