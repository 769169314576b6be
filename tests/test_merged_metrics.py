"""The HTTP API's /metrics under `stepahead serve`: the scheduler's series and the worker's
fetched exposition merged into one valid exposition (scheduler_svc/process/frontend_metrics.py)."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from scheduler_svc.process.frontend_metrics import Merged, RemoteExposition
from tests.live import unused_port


def scheduler_side() -> CollectorRegistry:
    r = CollectorRegistry()
    Gauge("shared_gauge", "Shared.", ["service"], registry=r).labels("scheduler").set(1)
    Histogram("clash", "A histogram here.", registry=r).observe(0.5)
    return r


def worker_exposition() -> bytes:
    r = CollectorRegistry()
    Gauge("shared_gauge", "Shared.", ["service"], registry=r).labels("worker").set(2)
    Counter("clash", "A counter there.", registry=r).inc(3)
    Counter("worker_only", "Only the worker's.", registry=r).inc(4)
    return generate_latest(r)


@pytest.fixture
def worker_url() -> Iterator[str]:
    body = worker_exposition()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", unused_port()), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    finally:
        server.shutdown()


def exposition(*collectors: object) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    view = CollectorRegistry(auto_describe=False)
    view.register(Merged(*collectors))  # type: ignore[arg-type]
    families = list(text_string_to_metric_families(generate_latest(view).decode()))
    names = [f.name for f in families]
    assert len(names) == len(set(names)), names  # every family once: a valid exposition
    return {f.name: [(s.name, s.labels, s.value) for s in f.samples] for f in families}


def test_same_name_same_type_merge_and_a_clash_of_types_is_left_out(worker_url: str) -> None:
    got = exposition(scheduler_side(), RemoteExposition(worker_url))
    assert sorted((labels["service"], value) for _, labels, value in got["shared_gauge"]) == [
        ("scheduler", 1.0),
        ("worker", 2.0),
    ]
    assert ("worker_only_total", {}, 4.0) in got["worker_only"]
    assert all(not name.startswith("clash_total") for name, _, _ in got["clash"])  # the histogram's
    assert "worker_only_created" not in got  # creation times are the worker's own business


def test_a_worker_that_does_not_answer_leaves_the_scheduler_s_series() -> None:
    got = exposition(scheduler_side(), RemoteExposition(f"http://127.0.0.1:{unused_port()}/metrics", 1.0))
    assert set(got) >= {"shared_gauge", "clash"} and "worker_only" not in got
