"""`stepahead serve MODEL`: a whole server in one command (stepahead_cli/serve.py), and the
`stepahead` command's subcommands (stepahead_cli/commands.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from scheduler_svc.process.cli import parse_args as scheduler_config
from stepahead.v1 import generation_pb2 as pb
from stepahead.v1 import generation_pb2_grpc
from stepahead_cli.serve import FlagError, plan, split
from tests.live import CALL_TIMEOUT_S, SETTLE_TIMEOUT_S, unused_port, wait_until
from worker_svc.cli import build_parser as worker_parser

START_TIMEOUT_S = 300.0  # hang guard: the model loads in seconds
STOP_TIMEOUT_S = 120.0  # hang guard: both drain in well under a second when idle


def command() -> list[str]:
    """The installed console script (the package's `stepahead` entry point)."""
    script = Path(sys.executable).with_name("stepahead")
    assert script.exists(), f"{script}: the package is not installed (pip install -e .)"
    return [str(script)]


# ---- the command line -------------------------------------------------------------------------


def test_flags_go_to_the_service_that_has_them() -> None:
    argv = ["smollm2", "--tp", "2", "--frontends=2", "--check-invariants", "--log-level", "debug"]
    argv += ["--tls-cert", "c.pem", "--tls-key", "k.pem", "--port", "9000", "--dtype", "float32"]
    own, worker, scheduler = split(argv)
    assert own == ["smollm2", "--port", "9000"]
    assert worker == ["--tp", "2", "--check-invariants", "--log-level", "debug", "--dtype", "float32"]
    assert scheduler == ["--frontends=2", "--log-level", "debug", "--tls-cert", "c.pem", "--tls-key", "k.pem"]


def test_a_vllm_command_line_serves_as_it_is() -> None:
    """vLLM's spellings of the flags both have: each reaches its service and means the same."""
    argv = ["tiny", "--tensor-parallel-size", "2", "--max-num-seqs", "8", "--max-num-batched-tokens", "512"]
    argv += ["--no-enable-prefix-caching", "--dtype", "half", "--trust-remote-code"]
    argv += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    _, worker, scheduler = split(argv)
    assert worker == ["--tensor-parallel-size", "2", "--dtype", "half", "--trust-remote-code"]
    assert scheduler[-3:] == ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    policy = scheduler_config(["--worker", "127.0.0.1:1", *scheduler]).core.policy
    assert (policy.max_running, policy.max_batch_tokens, policy.prefix_cache) == (8, 512, False)
    parsed = worker_parser().parse_args(["--model", "tiny", *worker])
    assert (parsed.tp, parsed.dtype) == (2, "float16")
    assert worker_parser().parse_args(["--model", "tiny", "-tp", "3", "--dtype", "auto"]).tp == 3
    assert worker_parser().parse_args(["--model", "tiny", "--dtype", "auto"]).dtype is None  # the default's
    assert scheduler_config(["--worker", "127.0.0.1:1", "--enable-prefix-caching"]).core.policy.prefix_cache
    with pytest.raises(SystemExit):  # a format it does not write: refused by argparse, naming the flag
        scheduler_config(["--worker", "127.0.0.1:1", "--tool-call-parser", "mistral"])


def test_the_plan_wires_the_worker_to_the_scheduler_on_loopback(tmp_path: Path) -> None:
    argv = ["tiny", "--port", "9000", "--grpc-port", "9001", "--worker-port", "9002", "--grace", "3"]
    served = plan(argv, tmp_path)
    assert served.worker[:8] == (
        "-m",
        "worker_svc",
        "--model",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        "9002",
    )
    s, w = served.scheduler, served.worker
    # The link is the worker's framed socket in the run's directory; its gRPC port stays on loopback.
    assert s[s.index("--worker") + 1] == f"unix:{tmp_path / 'worker.sock'}"
    assert w[w.index("--link-socket") + 1] == str(tmp_path / "worker.sock")
    assert (s[s.index("--port") + 1], s[s.index("--http-port") + 1]) == ("9001", "9000")
    assert served.grace_s == 3.0 and "--grace" in served.worker and len(served.worker_token) >= 24
    assert plan(["--model", "sim"], tmp_path).worker[3] == "sim"
    assert plan([], tmp_path).worker[3] == "smollm2"
    deep = tmp_path / ("d" * 120)  # no room for a socket's address: the gRPC port instead
    long_way = plan(["tiny", "--worker-port", "9002"], deep).scheduler
    assert long_way[long_way.index("--worker") + 1] == "127.0.0.1:9002" and "--link-socket" not in long_way


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--no-such-flag"], "--no-such-flag"),
        (["--tp"], "--tp: expects a value"),
        (["--worker", "1.2.3.4:5"], "--worker: stepahead serve sets it"),
        (["--worker-token", "x"], "--worker-token: stepahead serve sets it"),
        (["--http-port", "1"], "--http-port: stepahead serve sets it"),
        (["--link-socket", "/tmp/s"], "--link-socket: stepahead serve sets it"),
        (["--worker-metrics-url", "http://x"], "--worker-metrics-url: stepahead serve sets it"),
    ],
)
def test_a_bad_flag_is_named(argv: list[str], named: str) -> None:
    with pytest.raises(FlagError, match=named):
        split(argv)


def test_bad_command_lines_exit_2_naming_what_is_wrong() -> None:
    for argv, named in (
        (["serve", "--bogus"], "--bogus"),
        (["serve", "tiny", "--model", "sim"], "differ"),
        (["nosuch"], "unknown command 'nosuch'"),
    ):
        done = subprocess.run([*command(), *argv], capture_output=True, text=True, timeout=CALL_TIMEOUT_S)
        assert done.returncode == 2 and named in done.stderr, (argv, done.stderr)


def test_every_subcommand_answers_help() -> None:
    for sub in ("serve", "worker", "scheduler", "client", "loadgen"):
        done = subprocess.run(
            [*command(), sub, "--help"], capture_output=True, text=True, timeout=CALL_TIMEOUT_S
        )
        assert done.returncode == 0 and "usage:" in done.stdout, (sub, done.stderr)
    done = subprocess.run([*command(), "--version"], capture_output=True, text=True, timeout=CALL_TIMEOUT_S)
    assert done.returncode == 0 and done.stdout.startswith("stepahead ")


# ---- serving ----------------------------------------------------------------------------------


def children(pid: int) -> set[int]:
    """Every descendant of `pid` (from /proc)."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                kids = {int(k) for k in (task / "children").read_text().split()}
            except OSError:
                continue
            todo += sorted(kids - found)
            found |= kids
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def command_line(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []


def http_json(url: str) -> object:
    with urllib.request.urlopen(url, timeout=CALL_TIMEOUT_S) as reply:
        return json.loads(reply.read())


@contextmanager
def served(model: str, *flags: str) -> Iterator[tuple[subprocess.Popen[bytes], int, int]]:
    http_port, grpc_port = unused_port(), unused_port()
    # Every port given: another server on the machine may hold a default one (9400, /metrics).
    ports = ["--port", str(http_port), "--grpc-port", str(grpc_port), "--metrics-port", str(unused_port())]
    proc = subprocess.Popen(
        [*command(), "serve", model, *ports, *flags],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:

        def up() -> bool:
            assert proc.poll() is None, f"stepahead serve exited with {proc.returncode}"
            try:
                return bool(http_json(f"http://127.0.0.1:{http_port}/v1/models"))
            except OSError:
                return False

        wait_until(up, "serving /v1/models", START_TIMEOUT_S)
        wait_until(lambda: worker_connected(grpc_port), "connected to its worker", START_TIMEOUT_S)
        yield proc, http_port, grpc_port
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def worker_connected(grpc_port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        try:
            info = generation_pb2_grpc.GenerationStub(channel).GetServerInfo(
                pb.GetServerInfoRequest(), timeout=CALL_TIMEOUT_S
            )
        except grpc.RpcError:
            return False
    return bool(info.worker_connected)


def test_serve_smollm2_answers_the_openai_client_and_grpc_then_sigterm_leaves_nothing() -> None:
    with served("smollm2") as (proc, http_port, grpc_port):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=16,
            temperature=0,
        )
        assert "Paris" in (reply.choices[0].message.content or "")
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            request = pb.GenerateRequest(
                input_ids=pb.TokenIds(ids=[504, 3575, 282]),
                sampling=pb.SamplingParams(max_new_tokens=4, ignore_eos=True),  # four, whatever is sampled
            )
            stream = generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=CALL_TIMEOUT_S)
            assert sum(len(r.token_ids) for r in stream) == 4
        # The API port's /metrics: the scheduler's series and the worker's, in one exposition
        # (each family once), every series labelled with the served model.
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=CALL_TIMEOUT_S) as got:
            families = list(text_string_to_metric_families(got.read().decode()))
        names = [f.name for f in families]
        assert len(names) == len(set(names))
        assert {"stepahead_requests_running", "stepahead_device_busy_seconds"} <= set(names)
        assert all(s.labels.get("model_name") == "smollm2" for f in families for s in f.samples)
        services = children(proc.pid)
        assert len(services) >= 3  # worker, scheduler, its frontend process
        # The scheduler reached the worker over the worker's link socket, in the run's directory.
        sockets = {a for p in services for a in command_line(p) if a.endswith("/worker.sock")}
        assert len(sockets) == 2 and {a for a in sockets if a.startswith("unix:")}, sockets
        run_dir = Path(min(sockets, key=len)).parent
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(STOP_TIMEOUT_S) == 0
        wait_until(lambda: not any(alive(p) for p in services), "every service gone", SETTLE_TIMEOUT_S)
        assert not run_dir.exists()


def test_serve_killed_outright_takes_its_services_with_it() -> None:
    if sys.platform != "linux":
        pytest.skip("the services' parent-death signal is Linux's")
    with served("sim", "--sim-step-ms", "1") as (proc, _, _):
        services = children(proc.pid)
        assert len(services) >= 3
        proc.kill()
        proc.wait()
        wait_until(lambda: not any(alive(p) for p in services), "every service gone", STOP_TIMEOUT_S)


def test_a_service_that_fails_stops_the_other_and_the_command_fails() -> None:
    """The worker cannot load the model and exits: the scheduler, left waiting for it, is
    stopped, and the command exits with the worker's failure."""
    ports = ["--port", str(unused_port()), "--grpc-port", str(unused_port())]
    proc = subprocess.Popen(
        [*command(), "serve", "/no/such/model.gguf", *ports], stderr=subprocess.PIPE, text=True
    )
    _, stderr = proc.communicate(timeout=START_TIMEOUT_S)
    assert proc.returncode not in (0, None), stderr
    assert "/no/such/model.gguf" in stderr
