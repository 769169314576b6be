"""The TLS variants of deploy/ stay healthy: the health checks of docker-compose.tls.yml and the
exec probes of k8s/components/tls, run as written (paths, ports and names mapped to this
machine's) against a live worker and scheduler serving TLS on both links, answer SERVING; the
plaintext checks of the base files fail against the same services, which is why the TLS
variants need their own."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from stepahead import processes
from stepahead.processes import Service, serving_pair, spawn_worker, wait_serving
from tests.test_k8s import container
from tests.test_security import (
    SIM,
    Pki,
    mutual,
    scheduler_tls_flags,
    server_auth,
    worker_tls_flags,
    write_pki,
)

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_TLS = ROOT / "deploy" / "docker-compose.tls.yml"
COMPOSE = ROOT / "deploy" / "docker-compose.yml"
CHECK_TIMEOUT_S = 60.0  # hang guard: a check answers in well under a second


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return write_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_pair(pki: Pki) -> Iterator[tuple[Service, Service]]:
    with serving_pair(
        [*SIM, *worker_tls_flags(pki)],
        scheduler_tls_flags(pki),
        worker_credentials=mutual(pki, pki.client_cert, pki.client_key),
        scheduler_credentials=server_auth(pki),
    ) as pair:
        yield pair


def here(command: list[str], pki: Pki, ports: dict[str, str]) -> list[str]:
    """A deployed check's command, run on this machine: this Python and checkout, these
    services' addresses, the test CA's files, and the name its server certificate carries."""
    files = {"/tls/ca.pem": pki.ca, "/tls/client.pem": pki.client_cert, "/tls/client.key": pki.client_key}
    mapped: list[str] = []
    for i, arg in enumerate(command):
        if arg == "python":
            mapped.append(sys.executable)
        elif arg.endswith("deploy/healthcheck.py"):
            mapped.append(str(ROOT / "deploy" / "healthcheck.py"))
        elif arg in ports:
            mapped.append(ports[arg])
        elif arg in files:
            mapped.append(str(files[arg]))
        elif i > 0 and command[i - 1] == "--server-name":
            mapped.append("localhost")  # the test certificate's name (a deployment's: worker, stepahead)
        else:
            mapped.append(arg)
    return mapped


def status(command: list[str]) -> int:
    done = subprocess.run(command, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)
    return done.returncode


def compose_check(path: Path, service: str) -> list[str]:
    test = yaml.safe_load(path.read_text())["services"][service]["healthcheck"]["test"]
    assert test[0] == "CMD"
    return [str(arg) for arg in test[1:]]


@pytest.mark.parametrize("service", ["worker", "scheduler"])
def test_the_compose_tls_health_checks_pass_and_the_plaintext_ones_do_not(
    tls_pair: tuple[Service, Service], pki: Pki, service: str
) -> None:
    worker, scheduler = tls_pair
    ports = {"127.0.0.1:50061": worker.address, "127.0.0.1:50051": scheduler.address}
    assert status(here(compose_check(COMPOSE_TLS, service), pki, ports)) == 0
    assert status(here(compose_check(COMPOSE, service), pki, ports)) == 1


@pytest.mark.parametrize("name", ["worker", "scheduler"])
def test_the_kubernetes_tls_exec_probes_pass(tls_pair: tuple[Service, Service], pki: Pki, name: str) -> None:
    worker, scheduler = tls_pair
    ports = {"127.0.0.1:50061": worker.address, "127.0.0.1:50051": scheduler.address}
    c = container("cpu-tls", name)
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert status(here(c[kind]["exec"]["command"], pki, ports)) == 0, kind


def test_the_compose_tls_services_serve_tls_with_the_files_their_checks_trust() -> None:
    override = yaml.safe_load(COMPOSE_TLS.read_text())["services"]
    worker, scheduler = override["worker"]["command"], override["scheduler"]["command"]

    def flag(command: list[str], name: str) -> str:
        return str(command[command.index(name) + 1])

    assert flag(worker, "--tls-ca") == flag(compose_check(COMPOSE_TLS, "worker"), "--tls-ca")
    assert flag(scheduler, "--worker-tls-cert") == flag(compose_check(COMPOSE_TLS, "worker"), "--tls-cert")
    assert flag(scheduler, "--worker-tls-key") == flag(compose_check(COMPOSE_TLS, "worker"), "--tls-key")
    assert "--tls-cert" in scheduler and "--tls-ca" in compose_check(COMPOSE_TLS, "scheduler")
    base = yaml.safe_load(COMPOSE.read_text())["services"]
    # Everything else of each command is the base file's (an override replaces a command whole).
    for name, command in (("worker", worker), ("scheduler", scheduler)):
        tls_free = [a for a in command if not str(a).startswith(("/tls/", "--tls-", "--worker-tls-"))]
        assert tls_free == base[name]["command"], name


def test_a_service_that_never_answers_serving_fails_with_its_own_output(pki: Pki) -> None:
    """A plaintext health check cannot reach a TLS worker: the wait ends in an error that carries
    what the worker printed, which is what says why on a machine one cannot log into."""
    worker = spawn_worker([*SIM, *worker_tls_flags(pki)])
    try:
        with pytest.raises(TimeoutError) as failed, processes._output_on_timeout(worker):
            wait_serving(worker.address, timeout_s=1.0)
    finally:
        worker.stop()
    said = str(failed.value)
    assert "not SERVING after" in said
    assert "--- worker (running), last output:" in said
    assert (
        f"127.0.0.1:{worker.port}" in said.split("last output:", 1)[1]
    )  # its own line saying where it listens


def test_a_service_announces_its_port_in_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """The line a parent parses for the port reaches the pipe whole. print() writes the text and
    its newline apart; with PYTHONUNBUFFERED=1 (as services are started) a log line from another
    thread once landed between them, and its date ran into the port ("127.0.0.1:374672026")."""
    import io

    from stepahead.processes import LISTEN_RE
    from stepahead.serving import announce

    writes: list[str] = []

    class Pipe(io.StringIO):
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

    monkeypatch.setattr(sys, "stdout", Pipe())
    announce("worker listening on 127.0.0.1:37467")
    assert writes == ["worker listening on 127.0.0.1:37467\n"]
    match = LISTEN_RE.search(writes[0])
    assert match is not None and match.group(1) == "37467"
