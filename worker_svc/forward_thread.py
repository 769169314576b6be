"""The forward thread: the one thread of a worker process that runs torch's parallel work.

On the CPU, torch runs an operator's parallel part on OpenMP (libgomp), which keeps a pool of
helper threads per thread that starts a parallel region. Two such pools (say, the main thread's
from loading the model, and the forward thread's) make more OpenMP threads than cores, and
libgomp then lets an idle helper spin only briefly before it sleeps: every one of a forward's
~2,000 parallel regions waits for a sleeping helper to be woken, and a decode step at batch 1
took 1.2-2.5x as long as the same forward run on the thread that loaded the model (smollm2,
2 cores). So the forward thread does everything: it builds the engine (loading, laying out
and quantizing the model, allocating the KV pool), then runs every launch, and on a
tensor-parallel rank other than 0 it runs the follow loop too. No other thread of the process
runs an operator big enough to go parallel.

The threads are named at the OS level (`top -H`, /proc/<pid>/task/*/comm); libgomp's helpers
inherit the name of the thread that made them.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import ctypes.util
import sys
import threading

import torch

FORWARD = "forward"  # the forward thread's OS name, and its OpenMP helpers'
COPY = "copy-wait"
PR_SET_NAME = 15  # prctl(2): the calling thread's name, at most 15 bytes
_LIBC = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True) if sys.platform == "linux" else None
_STATE = threading.local()


def name_os_thread(name: str) -> None:
    """Names the calling thread for the OS (Linux only; elsewhere nothing happens)."""
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def named(name: str) -> concurrent.futures.ThreadPoolExecutor:
    """A single-thread executor whose thread the OS knows by `name`."""
    return concurrent.futures.ThreadPoolExecutor(1, name, initializer=name_os_thread, initargs=(name,))


def _start_forward_thread() -> None:
    name_os_thread(FORWARD)
    # NOTE: OpenMP keeps the thread count per thread: a thread of our own starts at the
    # runtime's default, not at what `--threads` set in the main thread.
    torch.set_num_threads(torch.get_num_threads())


def forward_thread() -> concurrent.futures.ThreadPoolExecutor:
    """A new forward thread; `enter_inference_mode` once what it builds is built."""
    return concurrent.futures.ThreadPoolExecutor(1, FORWARD, initializer=_start_forward_thread)


def enter_inference_mode() -> None:
    """For the calling thread's whole life: no autograd bookkeeping, and no per-step enter/exit
    between two forwards (it shows in the device gap). Run on the forward thread after the
    engine is built: tensors made under it could not be updated in place outside it."""
    if getattr(_STATE, "inference_mode", None) is None:
        # NOTE: inference mode lasts as long as its guard object: it is kept for the thread's life.
        guard = torch.inference_mode()
        guard.__enter__()
        _STATE.inference_mode = guard
