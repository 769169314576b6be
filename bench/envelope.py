"""The frame of every benchmark's report, written once: how it was run (the command and the plan),
when it started (UTC), the machine and commit it ran on (`bench.machine`) and the 1-minute load
average around it. A report's JSON starts with these fields and its markdown with a heading and a
line that says them; `bench.save.publish` writes the files, `<UTC date-time>-<name>.{json,md}`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any, ClassVar, Protocol

from bench.machine import Machine, describe_machine, measured_on

LoadAfter = float | dict[str, float]  # one reading, or one after each named part of the run
PACKAGES = ("python", "torch")


class NamedPlan(Protocol):
    """A benchmark's plan: a dataclass with a name."""

    __dataclass_fields__: ClassVar[dict[str, Any]]

    @property
    def name(self) -> str: ...


def begin() -> tuple[datetime, Machine]:
    """When a run starts (UTC) and what it runs on (whose load average is the reading before it)."""
    return datetime.now(UTC), describe_machine()


def load_clause(before: object, after: LoadAfter | None = None) -> str:
    """'1-minute load average 0.4 before, 1.5 after' ('1.5 after tiny, 1.2 after sim' for named
    parts); with no reading after, the one reading alone."""
    if after is None:
        return f"1-minute load average {before}"
    if isinstance(after, dict):
        afters = ", ".join(f"{load} after {part}" for part, load in after.items())
    else:
        afters = f"{after} after"
    return f"1-minute load average {before} before, {afters}"


@dataclass(frozen=True)
class Envelope:
    """What every report carries, whatever it measured."""

    title: str  # the markdown's heading, before the date
    command: str  # how it was invoked (`bench.save.command_line`)
    plan: Any  # as the JSON holds it: the plan's fields (`asdict`), or just its name
    plan_name: str | None  # named in the markdown's first line; None: a run without a named plan
    started_at: datetime  # UTC
    machine: Machine  # described at the start (`begin`): its `load_average_1m` is the reading before
    packages: tuple[str, ...] = PACKAGES  # whose versions the first line names
    load_after: LoadAfter | None = None  # `load_average_1m_after`, and the markdown's "after"
    clauses: tuple[str, ...] = ()  # what else the first line says, before the load average
    plan_key: str = "plan"  # the plan's key in the JSON

    @classmethod
    def planned(
        cls,
        title: str,
        command: str,
        plan: NamedPlan,
        started_at: datetime,
        machine: Machine,
        packages: tuple[str, ...] = PACKAGES,
        load_after: LoadAfter | None = None,
        clauses: tuple[str, ...] = (),
    ) -> Envelope:
        """A run under a named plan: the JSON holds the plan's fields, the markdown its name."""
        return cls(
            title, command, asdict(plan), plan.name, started_at, machine, packages, load_after, clauses
        )

    def json(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """The report's JSON document: the frame's fields, then the benchmark's own."""
        head: dict[str, Any] = {
            "started_at": self.started_at.isoformat(timespec="seconds"),
            "command": self.command,
            self.plan_key: self.plan,
            "machine": self.machine,
        }
        if self.load_after is not None:
            head["load_average_1m_after"] = self.load_after
        return {**head, **body}

    def markdown(self, body: Iterable[str]) -> str:
        """The report's markdown: the heading and the measured-on line, then the benchmark's lines."""
        return "\n".join([self.heading, "", self.measured_line, "", *body]) + "\n"

    @property
    def heading(self) -> str:
        return f"# {self.title}, {self.started_at:%Y-%m-%d %H:%M} UTC"

    @property
    def measured_line(self) -> str:
        """How it was run, on what, at which commit, then the clauses and the load average."""
        clauses = list(self.clauses)
        if self.load_after is not None:
            clauses.append(load_clause(self.machine.get("load_average_1m"), self.load_after))
        first = measured_on(self.command, self.plan_name, self.machine, self.packages)
        return "; ".join([first, *clauses]) + "."
