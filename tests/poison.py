"""A worker with a fault that only some requests meet: the poison requests of the quarantine's
tests (docs/RELIABILITY.md).

A request whose seed is `poison_seed(p)` makes every step fail that computes its position `p` or
a later one (from its first step with `p` 0), as a fault in a path only it takes would; every other
request is served as usual. `python -m tests.poison` is the worker (`python -m worker_svc`) with
that fault.
"""

from __future__ import annotations

from stepahead.protocol import Launch
from worker_svc.cli import main
from worker_svc.engine import WorkerEngine, _Ran

POISON_SEED = 0x5EED_0000_0000  # poison_seed(p) = POISON_SEED + p
MAX_POSITION = 1 << 20


def poison_seed(position: int) -> int:
    """The seed of a request whose steps fail from the one computing `position` on."""
    assert 0 <= position < MAX_POSITION
    return POISON_SEED + position


class PoisonRows:
    """The poisoned request slots of a worker, and the position each may not reach."""

    def __init__(self) -> None:
        self.limits: dict[int, int] = {}  # request slot -> the first position that fails
        self.failed_steps = 0

    def check(self, launch: Launch) -> None:
        """Raises for a launch with a row that reaches its request's poisoned position."""
        for slot in launch.released_slots:
            self.limits.pop(slot, None)
        for new in launch.new_requests:
            if POISON_SEED <= new.seed < POISON_SEED + MAX_POSITION:
                self.limits[new.req_slot] = new.seed - POISON_SEED
            else:
                self.limits.pop(new.req_slot, None)
        for slot, start, n in zip(
            launch.row_req_slots, launch.row_start_pos, launch.row_num_tokens, strict=True
        ):
            limit = self.limits.get(slot)
            if limit is not None and start + n > limit:
                self.failed_steps += 1
                raise RuntimeError(f"poisoned row: request slot {slot} at position {start + n - 1}")


def poison(engine: WorkerEngine) -> PoisonRows:
    """`engine`'s steps fail where a poison request's rows reach their position (checked on the
    forward thread, with the launch's slot deltas, in step order)."""
    rows = PoisonRows()
    run = engine._run

    def checked(launch: Launch) -> _Ran:
        if launch.num_rows or launch.new_requests or launch.released_slots:
            rows.check(launch)
        return run(launch)

    engine._run = checked  # type: ignore[method-assign]
    return rows


def install() -> None:
    """Every WorkerEngine of this process is poisoned (one PoisonRows each)."""
    init = WorkerEngine.__init__

    def poisoned_init(self: WorkerEngine, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)  # type: ignore[arg-type]
        poison(self)

    WorkerEngine.__init__ = poisoned_init  # type: ignore[method-assign]


if __name__ == "__main__":
    install()
    main()
