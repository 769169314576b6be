"""Chrome trace-event JSON (opens in Perfetto and chrome://tracing).

Each service writes its own file; timestamps are Unix microseconds, so files
from one host line up as they are, and the scheduler records the worker's
clock offset (estimated in the handshake) for files from two hosts.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import IO, Any

MAX_EVENTS = 500_000


class Tracer:
    """Appends events as they happen; `close()` ends the JSON array.

    NOTE: thread-safe (the worker writes from its copy thread); after
    MAX_EVENTS further events are dropped, so a long-running server cannot
    grow the file without bound.
    """

    def __init__(self, path: Path | None, process_name: str) -> None:
        self._file: IO[str] | None = path.open("w") if path is not None else None
        self._pid = os.getpid()
        self._lanes: dict[str, int] = {}
        self._count = 0
        self._lock = threading.Lock()
        if self._file is not None:
            self._file.write("[")
            self._emit({"ph": "M", "name": "process_name", "pid": self._pid, "args": {"name": process_name}})

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def span(
        self, lane: str, name: str, start: float, end: float, args: dict[str, Any] | None = None
    ) -> None:
        """A complete event from `start` to `end` (Unix seconds) on `lane`."""
        if self._file is None:
            return
        event = {
            "ph": "X",
            "name": name,
            "ts": start * 1e6,
            "dur": max(end - start, 0.0) * 1e6,
            "pid": self._pid,
            "tid": self._lane(lane),
        }
        if args:
            event["args"] = args
        self._emit(event)

    def counter(self, name: str, at: float, values: dict[str, float]) -> None:
        if self._file is None:
            return
        self._emit({"ph": "C", "name": name, "ts": at * 1e6, "pid": self._pid, "args": values})

    def metadata(self, name: str, args: dict[str, Any]) -> None:
        if self._file is None:
            return
        self._emit({"ph": "M", "name": name, "pid": self._pid, "args": args})

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.write("\n]\n")
                self._file.close()
                self._file = None

    def _lane(self, lane: str) -> int:
        tid = self._lanes.get(lane)
        if tid is None:
            tid = self._lanes[lane] = len(self._lanes) + 1
            self._emit(
                {"ph": "M", "name": "thread_name", "pid": self._pid, "tid": tid, "args": {"name": lane}}
            )
            self._emit(
                {
                    "ph": "M",
                    "name": "thread_sort_index",
                    "pid": self._pid,
                    "tid": tid,
                    "args": {"sort_index": tid},
                }
            )
        return tid

    def _emit(self, event: dict[str, Any]) -> None:
        with self._lock:
            if self._file is None or self._count >= MAX_EVENTS:
                return
            self._file.write(("\n" if self._count == 0 else ",\n") + json.dumps(event))
            self._count += 1


NO_TRACE = Tracer(None, "")
