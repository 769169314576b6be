"""`python -m worker_svc --tp N`: starts the N rank processes of one worker and keeps them up.

Each rank is `python -m worker_svc` with the same arguments and RANK / LOCAL_RANK / WORLD_SIZE
set, as torchrun would set them; they rendezvous at a TCPStore this process hosts, under a
prefix per start of the group. When a rank exits the group cannot go on: the others are
killed and, if the group had come up (rank 0 was serving) and restarts remain, a new group
starts on the same ports. SIGTERM or SIGINT goes to rank 0, which drains and then stops the
other ranks; this process exits with rank 0's code. The ranks die with it, however it dies.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from types import FrameType

from torch._C._distributed_c10d import TCPStore

from worker_svc.ranks import ATTEMPT_ENV, STORE_ENV, UP_KEY, attempt_store

log = logging.getLogger("stepahead.worker")

POLL_S = 0.05
STOP_GRACE_S = 15.0  # beyond --grace: how long the ranks may take to stop once rank 0 drained


class _Group:
    """One start of the N ranks."""

    def __init__(self, argv: list[str], size: int, store_port: int, attempt: int) -> None:
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-m", "worker_svc", *argv],
                env=_rank_env(r, size, store_port, attempt),
                preexec_fn=_die_with_parent(os.getpid()),
            )
            for r in range(size)
        ]

    def first_exit(self) -> tuple[int, int]:
        """(rank, exit code) of the first rank to exit."""
        while True:
            for rank, proc in enumerate(self.procs):
                code = proc.poll()
                if code is not None:
                    return rank, code
            time.sleep(POLL_S)

    def wait_all(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait()


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent(parent: int) -> Callable[[], None]:
    """Run in each rank before it starts: the kernel SIGKILLs it when this launcher dies, however
    (a `kill -9` included), so no rank outlives it holding the port; a launcher gone already
    (between the fork and this) ends it at once."""

    def arm() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0 or os.getppid() != parent:
            os._exit(1)

    return arm


def _rank_env(rank: int, size: int, store_port: int, attempt: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(size),
        LOCAL_WORLD_SIZE=str(size),
        **{STORE_ENV: f"127.0.0.1:{store_port}", ATTEMPT_ENV: str(attempt)},
    )
    return env


class Launcher:
    def __init__(self, argv: list[str], size: int, max_restarts: int, grace_s: float) -> None:
        self._argv, self._size, self._max_restarts = argv, size, max_restarts
        self._grace_s = grace_s
        self._store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self._group: _Group | None = None
        self._stopping = False

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        attempt = 0
        while not self._stopping:
            self._group = group = _Group(self._argv, self._size, self._store.port, attempt)
            rank, code = group.first_exit()
            if self._stopping:
                group.wait_all(self._grace_s + STOP_GRACE_S)
                return group.procs[0].returncode
            group.kill()
            came_up = attempt_store(self._store, attempt).check([UP_KEY])
            if not came_up or attempt >= self._max_restarts:
                log.error("rank %d exited with %d; not restarting the group", rank, code)
                return code or 1
            attempt += 1
            log.warning(
                "rank %d exited with %d: starting the group again (%d of %d)",
                *(rank, code, attempt, self._max_restarts),
            )
        return 0

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._stopping = True
        group = self._group
        if group is not None and group.procs[0].poll() is None:
            group.procs[0].send_signal(signal.SIGTERM)
