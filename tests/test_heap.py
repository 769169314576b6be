"""The garbage collector of a serving process (`stepahead.heap`): start-up's heap frozen, the
young generation's threshold raised, each as the environment says; collections counted."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from stepahead.heap import GC_THRESHOLD_ENV, GEN0_THRESHOLD, GcCollector, threshold

SETTLE_TIMEOUT_S = 60.0  # a hang guard: a fresh interpreter settles in well under a second

# Run in a fresh interpreter: freezing is for the life of the process.
SETTLE = """
import gc, json
from prometheus_client import CollectorRegistry, generate_latest
from stepahead import heap
before = gc.get_threshold()
heap.settle("test")
frozen = gc.get_freeze_count()
gc.get_freeze_count = None  # a scrape reads the count settle() took, never walks the list again
registry = CollectorRegistry()
registry.register(heap.GcCollector())
scraped = generate_latest(registry).decode()
print(json.dumps({"before": before, "after": gc.get_threshold(), "frozen": frozen, "scraped": scraped}))
"""


def settle_in_a_process(value: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != GC_THRESHOLD_ENV}
    if value is not None:
        env[GC_THRESHOLD_ENV] = value
    return subprocess.run(
        [sys.executable, "-c", SETTLE], capture_output=True, text=True, env=env, timeout=SETTLE_TIMEOUT_S
    )


def test_settle_freezes_start_up_objects_and_raises_the_young_threshold() -> None:
    done = settle_in_a_process(None)
    assert done.returncode == 0, done.stderr
    state = json.loads(done.stdout)
    assert state["after"] == [GEN0_THRESHOLD, *state["before"][1:]]
    assert state["frozen"] > 1000  # the interpreter's, prometheus_client's and this module's objects
    assert f"stepahead_gc_frozen_objects {float(state['frozen'])}" in state["scraped"].splitlines()


def test_a_threshold_from_the_environment_and_zero_leaves_python_s_collector() -> None:
    raised = json.loads(settle_in_a_process("12345").stdout)
    assert raised["after"][0] == 12345
    untouched = json.loads(settle_in_a_process("0").stdout)
    assert untouched["after"] == untouched["before"]
    assert untouched["frozen"] == 0


@pytest.mark.parametrize("bad", ["lots", "-1", "1.5"])
def test_a_bad_threshold_stops_the_process_naming_the_variable(
    bad: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(GC_THRESHOLD_ENV, bad)
    with pytest.raises(SystemExit, match=GC_THRESHOLD_ENV):
        threshold()
    done = settle_in_a_process(bad)
    assert done.returncode != 0 and GC_THRESHOLD_ENV in done.stderr


def gc_samples(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    return {
        (s.name, s.labels.get("generation", "")): s.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for s in family.samples
    }


def test_the_collector_counts_each_generation_s_collections_and_their_time() -> None:
    registry = CollectorRegistry()
    registry.register(GcCollector())
    before = gc_samples(registry)
    gc.collect(1)
    gc.collect(2)
    gc.collect(2)
    after = gc_samples(registry)
    # Collections of their own may run in between (this test allocates): at least these.
    assert after["stepahead_gc_collections_total", "1"] >= before["stepahead_gc_collections_total", "1"] + 1
    assert after["stepahead_gc_collections_total", "2"] >= before["stepahead_gc_collections_total", "2"] + 2
    assert after["stepahead_gc_seconds_total", "2"] > before["stepahead_gc_seconds_total", "2"]


def test_collectors_of_one_process_share_one_hook() -> None:
    hooks = len(gc.callbacks)
    GcCollector()
    GcCollector()
    assert len(gc.callbacks) <= hooks + 1  # the first one in this process installs it
