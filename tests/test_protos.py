"""stepahead/v1/ is generated from protos/ and kept in the tree, so that `pip install` needs no
build step: it must be what `make proto` makes from the .proto files as they are."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ROOT / "stepahead" / "v1"


def test_the_kept_stubs_are_what_the_protos_generate(tmp_path: Path) -> None:
    protos = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "protos").rglob("*.proto"))
    outputs = [f"--{kind}_out={tmp_path}" for kind in ("python", "mypy", "grpc_python", "mypy_grpc")]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-Iprotos", *outputs, *protos],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
    )
    made = {
        p.relative_to(tmp_path / "stepahead" / "v1"): p.read_bytes()
        for p in (tmp_path / "stepahead" / "v1").glob("*.py*")
    }
    kept = {
        p.relative_to(GENERATED): p.read_bytes() for p in GENERATED.glob("*.py*") if p.name != "__init__.py"
    }
    assert sorted(made) == sorted(kept), "run `make proto`: the generated files differ in name"
    stale = [str(name) for name in sorted(made) if made[name] != kept[name]]
    assert stale == [], f"run `make proto`: {stale} differ from what protos/ generates"
