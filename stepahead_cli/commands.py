"""The `stepahead` command: `stepahead serve [MODEL]` runs a whole server (worker and
scheduler); `stepahead worker`, `stepahead scheduler`, `stepahead client` and `stepahead
loadgen` run one part (each takes its own `--help`)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence


def _serve(argv: list[str]) -> None:
    from stepahead_cli.serve import main

    main(argv)


def _worker(argv: list[str]) -> None:
    from worker_svc.cli import main

    main(argv)


def _scheduler(argv: list[str]) -> None:
    from scheduler_svc.process.cli import main

    main(argv)


def _client(argv: list[str]) -> None:
    from stepahead_client.client import main

    main(argv)


def _loadgen(argv: list[str]) -> None:
    from loadgen.cli import main

    main(argv)


COMMANDS: dict[str, tuple[Callable[[list[str]], None], str]] = {
    "serve": (_serve, "a whole server: worker and scheduler, OpenAI-compatible HTTP and gRPC APIs"),
    "worker": (_worker, "the worker alone: model, KV memory, forward (python -m worker_svc)"),
    "scheduler": (_scheduler, "the scheduler alone: engine core and frontends (python -m scheduler_svc)"),
    "client": (_client, "a command-line client of the gRPC Generation API"),
    "loadgen": (_loadgen, "the load generator"),
}


def usage() -> str:
    lines = ["usage: stepahead COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<10} {text}" for name, (_, text) in COMMANDS.items()]
    lines += ["", "`stepahead COMMAND --help` lists a command's flags."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        sys.exit(0 if args else 2)
    if args[0] in ("-V", "--version"):
        import stepahead

        print(f"stepahead {stepahead.__version__}")
        return
    command = COMMANDS.get(args[0])
    if command is None:
        print(f"stepahead: unknown command {args[0]!r}\n\n{usage()}", file=sys.stderr)
        sys.exit(2)
    command[0](args[1:])
