"""The package layout's import rules (docs/ARCHITECTURE.md, "Layout"):

- `scheduler_svc/engine/` (the core loop, the policy, KV) imports neither the frontends nor the
  process wiring, and no client-facing library, not even through what it imports;
- `scheduler_svc/frontend/` (validation, text, the client APIs) does not import the engine or the
  process wiring: the two meet in `scheduler_svc/contract.py`, which imports neither;
- `stepahead/` (shared by both services) imports no service, nor the client or colocated runner;
- no module imports a `__main__` module: those only run `main`;
- configuration travels as frozen dataclasses: only a `cli.py` sees an `argparse.Namespace`.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CLIENT_FACING = ("fastapi", "uvicorn", "starlette", "jinja2", "tokenizers", "grpc", "pydantic", "httptools")
# Grammars are compiled by the frontends and run by the worker; the core only carries them.
NOT_IN_THE_ENGINE = (*CLIENT_FACING, "llguidance")
SERVICES = (
    "scheduler_svc",
    "worker_svc",
    "stepahead_client",
    "stepahead_colocated",
    "stepahead_cli",
    "loadgen",
    "bench",
)


def modules_imported(path: Path) -> set[str]:
    """Every module an `import` or `from ... import` in the file names (at any depth, type
    checking included), with `from package import module` counted as the module."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def files_under(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def breaking(folder: str, forbidden: tuple[str, ...]) -> list[str]:
    """`file: module` for each import under `folder` of a module within `forbidden`."""
    return [
        f"{path.relative_to(ROOT)}: {module}"
        for path in files_under(folder)
        for module in sorted(modules_imported(path))
        if any(module == f or module.startswith(f + ".") for f in forbidden)
    ]


def test_the_engine_imports_no_frontend_no_process_wiring_and_no_client_facing_library() -> None:
    assert files_under("scheduler_svc/engine")
    forbidden = ("scheduler_svc.frontend", "scheduler_svc.process", *NOT_IN_THE_ENGINE)
    assert breaking("scheduler_svc/engine", forbidden) == []


def test_the_engine_loads_no_client_facing_library_even_through_what_it_imports() -> None:
    modules = [
        ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for path in files_under("scheduler_svc/engine")
        if path.name != "__init__.py"
    ]
    code = (
        f"import sys\nfor m in {modules!r}: __import__(m)\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {NOT_IN_THE_ENGINE!r}))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert loaded.stdout.strip() == "[]", loaded.stdout


def test_the_frontends_import_neither_the_engine_nor_the_process_wiring() -> None:
    assert files_under("scheduler_svc/frontend")
    assert breaking("scheduler_svc/frontend", ("scheduler_svc.engine", "scheduler_svc.process")) == []


def test_the_contract_imports_neither_side() -> None:
    imported = modules_imported(ROOT / "scheduler_svc/contract.py")
    assert not [m for m in imported if m.startswith(("scheduler_svc.", "worker_svc"))], imported


@pytest.mark.parametrize("shared", ["stepahead", "stepahead_client"])
def test_shared_code_and_the_client_import_no_service(shared: str) -> None:
    forbidden = tuple(s for s in SERVICES if s != shared)
    assert breaking(shared, forbidden) == []


def test_no_module_imports_a_main_module() -> None:
    folders = [*SERVICES, "stepahead", "tests"]
    bad = [
        f"{path.relative_to(ROOT)}: {module}"
        for folder in folders
        for path in files_under(folder)
        for module in modules_imported(path)
        if module.endswith(".__main__")
    ]
    assert bad == []


def test_only_the_command_lines_see_an_argparse_namespace() -> None:
    """Configuration travels as frozen dataclasses: a `Namespace` stays in the `cli.py` that parsed it."""
    seen = [
        str(path.relative_to(ROOT))
        for folder in ("scheduler_svc", "worker_svc")
        for path in files_under(folder)
        if path.name != "cli.py" and "Namespace" in path.read_text()
    ]
    assert seen == []
