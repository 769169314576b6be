"""The worker's torch work runs on its forward thread alone (worker_svc/forward_thread.py): a
second OpenMP pool (the main thread's, from loading the model) would put more OpenMP threads
than cores on the machine and slow every forward. Shown in a fresh process through the OS's
thread names, which libgomp's helper threads inherit from the thread that made them: after the
worker's engine is built and has run a step, the main thread has made no helper, and the
forward thread has made `--threads` - 1 of them."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest

from worker_svc.forward_thread import COPY, FORWARD

# Builds smollm2's engine as the worker does, runs one step, and prints every thread's OS name.
SCRIPT = """
import json, os, sys
from worker_svc.forward_thread import name_os_thread
name_os_thread("test-main")
from stepahead.protocol import Launch, NewRequest
from worker_svc import cli
from worker_svc.app import build_engine
engine = build_engine(cli.parse_args(["--model", "smollm2", "--threads", sys.argv[1], "--kv-slots", "256"]))
prompt = list(range(100, 140))
launch = Launch(step_id=1, new_requests=[NewRequest(req_slot=0, temperature=0.0, top_p=1.0, top_k=0, seed=0)],
                row_req_slots=[0], row_start_pos=[0], row_num_tokens=[len(prompt)], row_from_future=[False],
                row_sample=[True], prompt_ids=prompt, kv_slots=list(range(len(prompt))))
engine.begin_session().result(timeout=600)
engine.submit(launch).result(timeout=600)
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
engine.shutdown()
print(json.dumps(names))
"""


@pytest.mark.parametrize("threads", [1, 2])
def test_only_the_forward_thread_runs_openmp_helpers(threads: int) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(threads)], capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    names = Counter(json.loads(done.stdout.strip().splitlines()[-1]))
    assert names["test-main"] == 1, names  # the main thread, and no helper of its own
    assert names[FORWARD] == threads, names  # the forward thread and its helpers
    assert names[COPY] == 1, names
