"""TLS on both links, the API key, and where the worker listens: against live processes with
certificates made for the test (one CA for the deployment, another one an attacker holds)."""

from __future__ import annotations

import datetime
import ipaddress
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from scheduler_svc.process import cli as scheduler_cli
from stepahead.processes import (
    Service,
    open_channel,
    serving_pair,
    spawn_scheduler,
    spawn_scheduler_in_process,
    spawn_worker,
    wait_serving,
)
from stepahead.v1 import generation_pb2 as pb
from stepahead.v1 import generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.live import CALL_TIMEOUT_S, wait_until
from worker_svc import cli as worker_cli
from worker_svc.backends import sim_continuation as sim_expected

SIM = ["--model", "sim", "--sim-step-ms", "2", "--check-invariants", "--kv-slots", "4096"]
API_KEY = "s3cret-key-for-tests"
Metadata = tuple[tuple[str, str], ...]


# ---- a small PKI ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Issuer:
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(
    subject: str, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


def make_ca(common_name: str) -> Issuer:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _builder(common_name, _name(common_name), key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .sign(key, hashes.SHA256())
    )
    return Issuer(key, cert)


def issue(ca: Issuer, common_name: str, *, server: bool) -> Issuer:
    """A leaf for 127.0.0.1 and localhost (server) or for a client."""
    key = ec.generate_private_key(ec.SECP256R1())
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (
        _builder(common_name, ca.cert.subject, key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    )
    if server:
        names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return Issuer(key, builder.sign(ca.key, hashes.SHA256()))


def cert_pem(issuer: Issuer) -> bytes:
    return issuer.cert.public_bytes(serialization.Encoding.PEM)


def key_pem(issuer: Issuer) -> bytes:
    return issuer.key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


@dataclass(frozen=True)
class Pki:
    """PEM files: `ca` signs the deployment's certificates; `rogue_ca` signs nothing it trusts."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_ca: Path
    rogue_client_cert: Path
    rogue_client_key: Path


def write_pki(folder: Path) -> Pki:
    ca, rogue = make_ca("stepahead test CA"), make_ca("rogue CA")
    server = issue(ca, "stepahead server", server=True)
    client = issue(ca, "stepahead scheduler", server=False)
    rogue_client = issue(rogue, "rogue scheduler", server=False)
    files = {
        "ca": cert_pem(ca),
        "server_cert": cert_pem(server),
        "server_key": key_pem(server),
        "client_cert": cert_pem(client),
        "client_key": key_pem(client),
        "rogue_ca": cert_pem(rogue),
        "rogue_client_cert": cert_pem(rogue_client),
        "rogue_client_key": key_pem(rogue_client),
    }
    for name, pem in files.items():
        (folder / f"{name}.pem").write_bytes(pem)
    return Pki(**{name: folder / f"{name}.pem" for name in files})


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return write_pki(tmp_path_factory.mktemp("pki"))


def server_auth(pki: Pki, ca: Path | None = None) -> grpc.ChannelCredentials:
    """What a client of the scheduler holds: the CA to trust."""
    return grpc.ssl_channel_credentials(root_certificates=(ca or pki.ca).read_bytes())


def mutual(pki: Pki, cert: Path, key: Path) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(pki.ca.read_bytes(), key.read_bytes(), cert.read_bytes())


def worker_tls_flags(pki: Pki) -> list[str]:
    return ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key), "--tls-ca", str(pki.ca)]


def scheduler_tls_flags(pki: Pki) -> list[str]:
    return [
        "--tls-cert",
        str(pki.server_cert),
        "--tls-key",
        str(pki.server_key),
        "--worker-tls-ca",
        str(pki.ca),
        "--worker-tls-cert",
        str(pki.client_cert),
        "--worker-tls-key",
        str(pki.client_key),
    ]


@pytest.fixture(scope="module")
def secure_pair(pki: Pki) -> Iterator[tuple[Service, Service]]:
    """TLS on both links (mutual to the worker), an API key on the client API."""
    with serving_pair(
        [*SIM, *worker_tls_flags(pki)],
        scheduler_tls_flags(pki),
        worker_credentials=mutual(pki, pki.client_cert, pki.client_key),
        scheduler_credentials=server_auth(pki),
        api_key=API_KEY,
    ) as pair:
        yield pair


# ---- client helpers ------------------------------------------------------------------------------


def bearer(key: str) -> Metadata:
    return (("authorization", f"Bearer {key}"),)


def request(text: str, max_new_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        text=text, sampling=pb.SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    )


def generate(address: str, credentials: grpc.ChannelCredentials | None, metadata: Metadata = ()) -> list[int]:
    with open_channel(address, credentials) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        replies = stub.Generate(request("over TLS", 4), metadata=metadata, timeout=CALL_TIMEOUT_S)
        return [t for r in replies for t in r.token_ids]


def status_of(call: Callable[[], object]) -> grpc.StatusCode:
    """The status `call` raised (OK when it returned)."""
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def every_method_status(
    address: str, credentials: grpc.ChannelCredentials | None, metadata: Metadata
) -> set[grpc.StatusCode]:
    with open_channel(address, credentials) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        calls = [
            lambda: list(stub.Generate(request("no entry", 2), metadata=metadata, timeout=CALL_TIMEOUT_S)),
            lambda: stub.Abort(pb.AbortRequest(request_id="x"), metadata=metadata, timeout=CALL_TIMEOUT_S),
            lambda: stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=metadata, timeout=CALL_TIMEOUT_S),
        ]
        return {status_of(call) for call in calls}


def health(address: str, credentials: grpc.ChannelCredentials | None) -> int:
    with open_channel(address, credentials) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=CALL_TIMEOUT_S)  # type: ignore[attr-defined]
        return int(reply.status)


def wait_for_output(service: Service, text: str) -> str:
    def printed() -> list[str]:
        return [line for line in list(service.output) if text in line]

    try:
        wait_until(lambda: bool(printed()), f"{text!r} printed by the {service.name}")
    except AssertionError as exc:
        raise AssertionError(f"{exc}:\n{''.join(service.output)}") from None
    return printed()[0]


# ---- the client API ------------------------------------------------------------------------------


def test_served_with_the_key_over_tls(secure_pair: tuple[Service, Service], pki: Pki) -> None:
    _, scheduler = secure_pair
    assert generate(scheduler.address, server_auth(pki), bearer(API_KEY)) == sim_expected(b"over TLS", 4)
    assert every_method_status(scheduler.address, server_auth(pki), bearer(API_KEY)) == {grpc.StatusCode.OK}


@pytest.mark.parametrize(
    "metadata",
    [
        (),
        bearer("wrong"),
        bearer(API_KEY[:-1]),
        bearer(API_KEY + "x"),
        (("authorization", f"Basic {API_KEY}"),),
        (("authorization", API_KEY),),
        (("x-api-key", API_KEY),),
    ],
    ids=["missing", "wrong", "prefix", "longer", "basic scheme", "no scheme", "other header"],
)
def test_missing_or_wrong_key_is_unauthenticated_on_every_method(
    secure_pair: tuple[Service, Service], pki: Pki, metadata: Metadata
) -> None:
    _, scheduler = secure_pair
    codes = every_method_status(scheduler.address, server_auth(pki), metadata)
    assert codes == {grpc.StatusCode.UNAUTHENTICATED}


def test_scheme_is_case_insensitive(secure_pair: tuple[Service, Service], pki: Pki) -> None:
    _, scheduler = secure_pair
    metadata = (("authorization", f"bearer {API_KEY}"),)
    assert generate(scheduler.address, server_auth(pki), metadata) == sim_expected(b"over TLS", 4)


@pytest.mark.parametrize("trust", ["plaintext", "rogue CA"])
def test_without_the_ca_the_client_api_is_refused(
    secure_pair: tuple[Service, Service], pki: Pki, trust: str
) -> None:
    _, scheduler = secure_pair
    credentials = None if trust == "plaintext" else server_auth(pki, pki.rogue_ca)
    codes = every_method_status(scheduler.address, credentials, bearer(API_KEY))
    assert codes == {grpc.StatusCode.UNAVAILABLE}


def test_health_and_reflection_need_no_key(secure_pair: tuple[Service, Service], pki: Pki) -> None:
    _, scheduler = secure_pair
    assert health(scheduler.address, server_auth(pki)) == health_pb2.HealthCheckResponse.SERVING
    with open_channel(scheduler.address, server_auth(pki)) as channel:
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        ask = reflection_pb2.ServerReflectionRequest(list_services="")
        replies = list(reflect.ServerReflectionInfo(iter([ask]), timeout=CALL_TIMEOUT_S))  # type: ignore[operator]
    names = {s.name for s in replies[0].list_services_response.service}
    assert {"stepahead.v1.Generation", "grpc.health.v1.Health"} <= names


def test_cli_client_with_key_and_ca(secure_pair: tuple[Service, Service], pki: Pki) -> None:
    _, scheduler = secure_pair
    base = [sys.executable, "-m", "stepahead_client", "Hi", "--max-new-tokens", "3", "--ignore-eos"]
    base += ["--server", scheduler.address, "--tls-ca", str(pki.ca)]
    served = subprocess.run(
        [*base, "--api-key", API_KEY], capture_output=True, text=True, timeout=CALL_TIMEOUT_S
    )
    assert served.returncode == 0, served.stderr
    assert "FINISH_REASON_LENGTH; 2 prompt + 3 completion tokens" in served.stderr
    refused = subprocess.run(base, capture_output=True, text=True, timeout=CALL_TIMEOUT_S)
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr


def test_client_certificates_required_when_the_api_has_a_ca(pki: Pki) -> None:
    flags = ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key), "--tls-ca", str(pki.ca)]
    scheduler = spawn_scheduler_in_process(SIM, flags)
    try:
        with_cert = mutual(pki, pki.client_cert, pki.client_key)
        wait_serving(scheduler.address, credentials=with_cert)
        assert generate(scheduler.address, with_cert) == sim_expected(b"over TLS", 4)
        assert status_of(lambda: generate(scheduler.address, server_auth(pki))) == grpc.StatusCode.UNAVAILABLE
        rogue = mutual(pki, pki.rogue_client_cert, pki.rogue_client_key)
        assert status_of(lambda: generate(scheduler.address, rogue)) == grpc.StatusCode.UNAVAILABLE
    finally:
        scheduler.stop()


# ---- the worker link -----------------------------------------------------------------------------


def worker_stats(address: str, credentials: grpc.ChannelCredentials | None) -> worker_pb2.WorkerStats:
    with open_channel(address, credentials) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        return stub.GetStats(worker_pb2.GetStatsRequest(), timeout=CALL_TIMEOUT_S)


@pytest.mark.parametrize("client", ["plaintext", "no client certificate", "rogue client certificate"])
def test_worker_refuses_clients_without_a_certificate_from_its_ca(
    secure_pair: tuple[Service, Service], pki: Pki, client: str
) -> None:
    worker, _ = secure_pair
    epoch = worker_stats(worker.address, mutual(pki, pki.client_cert, pki.client_key)).epoch
    credentials = {
        "plaintext": None,
        "no client certificate": server_auth(pki),
        "rogue client certificate": mutual(pki, pki.rogue_client_cert, pki.rogue_client_key),
    }[client]
    code = status_of(lambda: worker_stats(worker.address, credentials))
    assert code == grpc.StatusCode.UNAVAILABLE
    assert worker_stats(worker.address, mutual(pki, pki.client_cert, pki.client_key)).epoch == epoch


@pytest.mark.parametrize("certificate", ["missing", "from another CA"])
def test_scheduler_without_a_valid_client_certificate_gets_no_session(
    secure_pair: tuple[Service, Service], pki: Pki, certificate: str
) -> None:
    worker, scheduler = secure_pair
    epoch = worker_stats(worker.address, mutual(pki, pki.client_cert, pki.client_key)).epoch
    # Its handshake fails on the certificate, never on the watchdog's clock (a hang guard here).
    flags = ["--worker-tls-ca", str(pki.ca), "--worker-step-timeout", str(CALL_TIMEOUT_S)]
    if certificate == "from another CA":
        flags += [
            "--worker-tls-cert",
            str(pki.rogue_client_cert),
            "--worker-tls-key",
            str(pki.rogue_client_key),
        ]
    intruder = spawn_scheduler(worker.address, flags)
    try:
        refused = wait_for_output(intruder, "waiting for the worker")
        assert "UNAVAILABLE" in refused
        assert health(intruder.address, None) == health_pb2.HealthCheckResponse.NOT_SERVING
        with open_channel(intruder.address) as channel:
            info = generation_pb2_grpc.GenerationStub(channel).GetServerInfo(
                pb.GetServerInfoRequest(), timeout=CALL_TIMEOUT_S
            )
        assert not info.worker_connected
    finally:
        intruder.stop()
    # The worker never opened a session for it: the legitimate one still serves.
    assert worker_stats(worker.address, mutual(pki, pki.client_cert, pki.client_key)).epoch == epoch
    assert generate(scheduler.address, server_auth(pki), bearer(API_KEY)) == sim_expected(b"over TLS", 4)


# ---- flags and binding ---------------------------------------------------------------------------


def test_incomplete_tls_flags_are_usage_errors(pki: Pki) -> None:
    cert, key, ca = str(pki.server_cert), str(pki.server_key), str(pki.ca)
    for worker_flags in (["--tls-cert", cert, "--tls-key", key], ["--tls-cert", cert], ["--tls-ca", ca]):
        with pytest.raises(SystemExit):
            worker_cli.parse_args(worker_flags)
    for scheduler_flags in (
        ["--tls-key", key],
        ["--tls-ca", ca],
        ["--worker-tls-cert", cert, "--worker-tls-key", key],
        ["--worker-tls-ca", ca, "--worker-tls-cert", cert],
        ["--tls-cert", "/nonexistent.pem", "--tls-key", key],
    ):
        with pytest.raises(SystemExit):
            scheduler_cli.parse_args(scheduler_flags)


def test_api_key_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPAHEAD_API_KEY", "from-env")
    assert scheduler_cli.parse_args([]).api.api_key == "from-env"
    assert scheduler_cli.parse_args(["--api-key", "from-flag"]).api.api_key == "from-flag"
    monkeypatch.delenv("STEPAHEAD_API_KEY")
    assert scheduler_cli.parse_args([]).api.api_key is None


def listening_addresses(port: int) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """Local addresses of the TCP sockets listening on `port`, from the kernel's tables."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            hex_address, _, hex_port = local.rpartition(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(kernel_address(hex_address))
    return found


def kernel_address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """The kernel writes an address as 32-bit words, each in host (little-endian) byte order."""
    words = [bytes.fromhex(hex_address[i : i + 8])[::-1] for i in range(0, len(hex_address), 8)]
    return ipaddress.ip_address(b"".join(words))


def is_loopback(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def test_worker_binds_loopback_unless_told() -> None:
    worker = spawn_worker(SIM)
    try:
        assert any(line.startswith(f"worker listening on 127.0.0.1:{worker.port}") for line in worker.output)
        if Path("/proc/net/tcp").exists():  # Linux: what the socket is really bound to
            addresses = listening_addresses(worker.port)
            assert addresses and all(is_loopback(address) for address in addresses), addresses
    finally:
        worker.stop()
