"""The load generator against a real worker + scheduler pair (sim model) on 127.0.0.1."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadgen import BenchmarkConfig, JsonlDataset, RandomDataset, run_benchmark
from loadgen.workload import RandomWorkload
from stepahead.processes import Service, serving_pair
from tests.live import CALL_TIMEOUT_S, unused_port, wait_all_free, wait_info, wait_until

pytestmark = pytest.mark.anyio
ROOT = Path(__file__).resolve().parent.parent
SIM = ["--model", "sim", "--sim-step-ms", "2"]
SIM_CONTEXT = 8192


@pytest.fixture(scope="module")
def scheduler() -> Iterator[Service]:
    with serving_pair(SIM) as (_, scheduler):
        yield scheduler


def scrape(url: str) -> dict[tuple[str, str], float]:
    """Samples by (name, reason label); the service's constant labels are left out."""
    with urllib.request.urlopen(url, timeout=CALL_TIMEOUT_S) as reply:
        text = reply.read().decode()
    return {
        (sample.name, sample.labels.get("reason", "")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def scrape_when_finished(service: Service, requests: int) -> dict[tuple[str, str], float]:
    """The scheduler counts a request right after its last message; wait for the count to land."""
    samples: dict[tuple[str, str], float] = {}

    def finished() -> bool:
        samples.update(scrape(service.metrics_url))
        return samples.get(("stepahead_requests_finished_total", "length")) == requests

    wait_until(finished, f"{requests} requests counted as finished")
    return samples


async def test_tokens_received_match_the_scheduler_metrics() -> None:
    dataset = RandomDataset(input_len=24, output_len=16, range_ratio=0.5)
    config = BenchmarkConfig(
        dataset=dataset, num_prompts=24, request_rate=200.0, max_concurrency=8, seed=3, ignore_eos=True
    )
    requested = [RandomWorkload(dataset, config.seed).prompt(i) for i in range(config.num_prompts or 0)]
    with serving_pair(SIM) as (_, scheduler):
        result = await run_benchmark(replace(config, server=scheduler.address))
        samples = scrape_when_finished(scheduler, len(requested))
    s = result.summary
    assert (s.completed, s.failed, s.errors) == (24, 0, {})
    assert s.total_output_tokens == sum(spec.output_len for spec in requested)
    assert s.total_input_tokens == sum(len(spec.prompt) for spec in requested)
    assert [r.output_len for r in result.records] == [spec.output_len for spec in requested]
    assert samples[("stepahead_generation_tokens_total", "")] == s.total_output_tokens
    assert samples[("stepahead_prompt_tokens_total", "")] == s.total_input_tokens
    assert samples[("stepahead_requests_finished_total", "length")] == s.completed
    assert 1 <= s.peak_concurrency <= 8 and s.finish_reasons == {"LENGTH": 24}
    assert s.ttft.count == 24 and s.e2el.p99 >= s.e2el.median > 0


async def test_a_request_the_server_refuses_is_counted_under_its_status(
    scheduler: Service, tmp_path: Path
) -> None:
    path = tmp_path / "prompts.jsonl"
    lines = [
        {"prompt": "short one", "output_len": 4},
        {"prompt": "too long", "output_len": SIM_CONTEXT + 1},
        {"prompt": "another", "output_len": 6},
        {"prompt": "last"},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    config = BenchmarkConfig(
        server=scheduler.address,
        dataset=JsonlDataset(path, default_output_len=5),
        num_prompts=4,
        ignore_eos=True,
    )
    result = await run_benchmark(config)
    s = result.summary
    assert (s.completed, s.failed, s.errors) == (3, 1, {"INVALID_ARGUMENT": 1})
    assert result.records[1].error_detail.startswith("sampling.max_new_tokens:")
    assert s.total_output_tokens == 4 + 6 + 5
    assert s.total_input_tokens == len("short one") + len("another") + len("last")


def loadgen_cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "loadgen", *args]


def test_cli_prints_the_table_and_saves_the_result(scheduler: Service, tmp_path: Path) -> None:
    saved = tmp_path / "result.json"
    out = subprocess.run(
        loadgen_cli(
            "--server",
            scheduler.address,
            "--num-prompts",
            "6",
            "--random-input-len",
            "12",
            "--random-output-len",
            "5",
            "--prompt-as-text",
            "--ignore-eos",
            "--warmup",
            "2",
            "--goodput",
            "e2el:60000",  # every request is good: they take milliseconds (a hang guard's SLO)
            "--save-result",
            str(saved),
            "--save-detailed",
        ),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=CALL_TIMEOUT_S,
    )
    assert out.returncode == 0, out.stderr
    assert "Successful requests:                    6" in out.stdout.splitlines()
    data = json.loads(saved.read_text())
    assert (data["completed"], data["failed"], data["errors"]) == (6, 0, {})
    assert data["connections"] == 8
    assert (data["total_input_tokens"], data["total_output_tokens"]) == (6 * 12, 6 * 5)
    assert data["request_goodput"] == pytest.approx(data["request_throughput"])
    assert data["output_lens"] == [5] * 6
    # One gap a message after the first: 4 when every token leaves alone; fewer (none) when a frontend
    # that runs late (a loaded machine) merges a stream's tokens into one message (pacing).
    assert all(len(itl) <= 4 for itl in data["itls"]), data["itls"]
    assert data["request_errors"] == [""] * 6


async def test_cli_ctrl_c_cancels_in_flight_requests_and_still_reports(scheduler: Service) -> None:
    """Ctrl-C once the server runs its requests (16 s each on the sim at least: only Ctrl-C
    ends them); they are cancelled there too."""
    proc = subprocess.Popen(
        loadgen_cli(
            "--server",
            scheduler.address,
            "--num-prompts",
            "4",
            "--random-input-len",
            "8",
            "--random-output-len",
            "8000",
            "--ignore-eos",
        ),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        assert proc.stderr.readline().startswith("Starting benchmark")  # Ctrl-C is handled from here
        await wait_info(scheduler.address, lambda i: i.requests_running > 0, "requests running")
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=CALL_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr
    lines = stdout.splitlines()
    assert "Successful requests:                    0" in lines
    assert any(line.startswith("Interrupted:") for line in lines)
    await wait_all_free(scheduler.address)


@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
async def test_the_http_backends_against_the_real_api_match_its_metrics(backend: str, tmp_path: Path) -> None:
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")  # the prompt as it is
    dataset = RandomDataset(input_len=24, output_len=12, as_text=True)
    config = BenchmarkConfig(
        dataset=dataset,
        num_prompts=16,
        max_concurrency=4,
        seed=5,
        ignore_eos=True,
        backend=backend,  # type: ignore[arg-type]
    )
    flags = ["--http-port", str(unused_port()), "--chat-template", str(template)]
    with serving_pair(SIM, flags) as (_, scheduler):
        result = await run_benchmark(replace(config, base_url=scheduler.http_url))
        samples = scrape_when_finished(scheduler, 16)
    s = result.summary
    assert (s.completed, s.failed, s.errors) == (16, 0, {})
    assert s.total_output_tokens == 16 * 12 == samples[("stepahead_generation_tokens_total", "")]
    # Text prompts of printable ASCII: one byte token each, whether sent as a prompt or a message.
    assert s.total_input_tokens == 16 * 24 == samples[("stepahead_prompt_tokens_total", "")]
    assert s.finish_reasons == {"LENGTH": 16} and result.model == "sim"
