"""Where a run's results go: `<UTC date-time>.json`, `.md` and `-sweep.png`, plus `latest` copies.
Other benchmarks add their name: `<UTC date-time>-<name>.{json,md}` and `latest-<name>.{json,md}`."""

from __future__ import annotations

import json
import math
import shlex
import shutil
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.harness import RunResult
from bench.plot import plot_sweep
from bench.report import to_json, to_markdown

RESULTS = Path(__file__).resolve().parent / "results"
DOCS_SWEEP_IMAGE = Path(__file__).resolve().parent.parent / "docs" / "images" / "sweep.png"


@dataclass(frozen=True)
class Saved:
    json: Path
    markdown: Path
    sweep_image: Path | None


def stamp(run: RunResult) -> str:
    return stamp_of(run.started_at)


def stamp_of(started_at: datetime) -> str:
    return f"{started_at:%Y%m%dT%H%M%SZ}"


def save(run: RunResult, command: str, out: Path = RESULTS, docs_image: Path | None = None) -> Saved:
    """Writes the run's files under `out` (and the sweep plot to `docs_image` too, when given);
    `latest.json` and `latest.md` become copies of this run's."""
    out.mkdir(parents=True, exist_ok=True)
    name = stamp(run)
    sweep_image = _save_sweep_image(run, out / f"{name}-sweep.png", docs_image)
    json_path, markdown_path = out / f"{name}.json", out / f"{name}.md"
    json_path.write_text(json.dumps(finite(to_json(run, command)), indent=2, allow_nan=False) + "\n")
    image_link = None if sweep_image is None else sweep_image.name
    markdown_path.write_text(to_markdown(run, command, image_link))
    shutil.copyfile(json_path, out / "latest.json")
    shutil.copyfile(markdown_path, out / "latest.md")
    return Saved(json_path, markdown_path, sweep_image)


def _save_sweep_image(run: RunResult, path: Path, docs_image: Path | None) -> Path | None:
    if not run.sweep:
        return None
    plot_sweep(run.sweep, run.plan.busy_target, path)
    if docs_image is not None:
        docs_image.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, docs_image)
    return path


def finite(value: Any) -> Any:
    """The document with every NaN or infinity replaced by None, so the file is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite(item) for item in value]
    return value


def save_named(
    name: str, started_at: datetime, document: dict[str, Any], markdown: str, out: Path = RESULTS
) -> Saved:
    """Another benchmark's files: `<stamp>-<name>.{json,md}`, copied to `latest-<name>.{json,md}`."""
    out.mkdir(parents=True, exist_ok=True)
    base = f"{stamp_of(started_at)}-{name}"
    json_path, markdown_path = out / f"{base}.json", out / f"{base}.md"
    json_path.write_text(json.dumps(finite(document), indent=2, allow_nan=False) + "\n")
    markdown_path.write_text(markdown)
    shutil.copyfile(json_path, out / f"latest-{name}.json")
    shutil.copyfile(markdown_path, out / f"latest-{name}.md")
    return Saved(json_path, markdown_path, None)


def command_line(module: str, argv: list[str] | None) -> str:
    """How the benchmark was invoked, for its report."""
    return shlex.join(["python", "-m", module, *(sys.argv[1:] if argv is None else argv)])


def publish(name: str, started_at: datetime, document: dict[str, Any], markdown: str, out: Path) -> None:
    """Save a benchmark's files (`save_named`), print its markdown and where the files went."""
    saved = save_named(name, started_at, document, markdown, out)
    print(markdown)
    print(f"wrote {saved.json} and {saved.markdown}", file=sys.stderr)
