"""python -m bench [--quick]: serial vs overlap, gRPC vs in-process, on `sim` and `tiny`, and a
concurrency sweep on `sim`; writes bench/results/<UTC date-time>.{json,md} and the sweep plot."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from bench.configs import FULL, QUICK
from bench.harness import run_plan
from bench.report import to_markdown
from bench.save import DOCS_SWEEP_IMAGE, RESULTS, save


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument("--quick", action="store_true", help="a first look: fewer requests, 3 sweep points")
    p.add_argument("--out", type=Path, default=RESULTS, help="results directory (default: bench/results)")
    p.add_argument(
        "--docs-image",
        type=Path,
        default=None,
        help="also write the sweep plot here (default: docs/images/sweep.png for the full run, "
        "nowhere with --quick)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    plan = QUICK if args.quick else FULL
    docs_image = args.docs_image if args.docs_image is not None or args.quick else DOCS_SWEEP_IMAGE
    command = shlex.join(["python", "-m", "bench", *(sys.argv[1:] if argv is None else argv)])
    run = run_plan(plan)
    saved = save(run, command, args.out, docs_image)
    print(to_markdown(run, command, None if saved.sweep_image is None else str(saved.sweep_image)))
    print(f"wrote {saved.json} and {saved.markdown}", file=sys.stderr)


if __name__ == "__main__":
    main()
