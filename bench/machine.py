"""What a result was measured on: CPUs, memory, versions, and the commit."""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import struct
import subprocess
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

Machine = dict[str, str | int | float | bool | None]


def describe_machine() -> Machine:
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_model": _proc_field("/proc/cpuinfo", "model name"),
        "memory": _proc_field("/proc/meminfo", "MemTotal"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "grpcio": _version("grpcio"),
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": _git_dirty(),
        "load_average_1m": load_average(),
        "cpuidle": cpuidle_driver(),
    }


def measured_on(
    command: str, plan: str | None, m: Machine, packages: tuple[str, ...] = ("python", "torch")
) -> str:
    """A report's first words: how it was run (and its plan, if named), on what, at which commit
    (no closing stop)."""
    versions = ", ".join(f"{'Python' if p == 'python' else p} {m.get(p)}" for p in packages)
    planned = "" if plan is None else f" (plan `{plan}`)"
    dirty = " (modified)" if m.get("git_dirty") else ""
    return (
        f"`{command}`{planned} on {m.get('nproc')} CPUs ({m.get('cpu_model')}), {versions}, "
        f"commit {str(m.get('git_commit'))[:10]}{dirty}"
    )


def loop_calibration() -> float:
    """Seconds a pure Python loop takes here (`for i in range(10**7): s += i*i`): machines of
    one kind differ in it up to four-fold, and CPU figures with them."""
    code = compile("s = 0\nfor i in range(10**7):\n    s += i * i\n", "<calibration>", "exec")
    start = time.perf_counter()
    exec(code, {})  # at a module's top level, as the loop is usually timed: names are globals
    return time.perf_counter() - start


CPU_DMA_LATENCY = Path("/dev/cpu_dma_latency")
CPUIDLE_DRIVER = Path("/sys/devices/system/cpu/cpuidle/current_driver")


def cpuidle_driver() -> str | None:
    """How this kernel idles a CPU (`haltpoll`: a virtual machine's vCPU, which halts, and the host
    may run something else on its core; `intel_idle`, `acpi_idle`: C-states), or None."""
    try:
        return CPUIDLE_DRIVER.read_text().strip() or None
    except OSError:
        return None


@contextlib.contextmanager
def cpu_wake_latency(us: int | None) -> Iterator[None]:
    """While the block runs, no CPU idles in a state it takes longer than `us` µs to wake from (the
    kernel's PM QoS request, `/dev/cpu_dma_latency`, as tuned's latency-performance profile holds
    it; at 0 an idle CPU polls). None: the host's own policy. A process that sleeps through a
    device step wakes on a CPU whose caches the halt and whatever the host ran meanwhile left
    cold (docs/BENCHMARKS.md, "The host's idle policy"); the request is dropped when the block
    ends. SystemExit where it cannot be made (it takes root)."""
    if us is None:
        yield
        return
    try:
        fd = os.open(CPU_DMA_LATENCY, os.O_WRONLY)
    except OSError as exc:
        raise SystemExit(f"--cpu-wake-latency-us: cannot open {CPU_DMA_LATENCY}: {exc.strerror}") from exc
    try:
        os.write(fd, struct.pack("i", us))
        yield
    finally:
        os.close(fd)


def add_wake_latency_argument(p: argparse.ArgumentParser) -> None:
    """A benchmark's `--cpu-wake-latency-us` (`cpu_wake_latency`)."""
    p.add_argument(
        "--cpu-wake-latency-us",
        type=int,
        metavar="US",
        help="keep the CPUs out of idle states slower than this to wake from, for the whole run "
        "(0: idle CPUs poll; /dev/cpu_dma_latency, root only): the CPU time without the cold "
        "wakes that a host which halts its idle CPUs adds to every sleep (default: the host's policy)",
    )


def idle_policy(wake_latency_us: int | None, driver: object) -> str:
    """A report's line on how the CPUs idled."""
    if wake_latency_us is None:
        return f"the host's policy (cpuidle driver {driver or 'unknown'})"
    return (
        f"held to states woken from within {wake_latency_us} µs for the whole run "
        f"(/dev/cpu_dma_latency; cpuidle driver {driver or 'unknown'})"
    )


def load_average() -> float:
    """Runnable processes, averaged over a minute: above 0 before a run, something else competes
    for the CPUs the run is about to share."""
    return round(os.getloadavg()[0], 2)


def _proc_field(path: str, name: str) -> str | None:
    """The first `name : value` line's value in a /proc file."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _git_dirty() -> bool | None:
    """Whether tracked files differ from the commit (the results directory does not count)."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    return None if status is None else bool(status)
