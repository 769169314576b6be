"""The worker's tensor-parallel ranks: one process a rank, one torch.distributed group.

Rank 0 serves the Connect stream. Its forward thread hands every engine command (a session
reset, a launch, the stop) to the other ranks before it runs it itself, in launch order, by a
broadcast over a CPU (gloo) group; each other rank runs the same command on its own engine
(`follow`). So every rank applies the same slot deltas, runs the same batch through its shard
(the row-parallel all-reduces over the model group: gloo on CPU, NCCL on CUDA), samples the
same ids from the same full logits with the same counter-based randomness, and keeps the same
FutureMap. Only rank 0 copies results to the host.

A rank whose peer is gone fails its next collective; that group cannot go on, so the rank exits
(`GroupBroken`) and its supervisor (`worker_svc.launcher`, torchrun, or the pod) starts a new
group; the scheduler sees the session end and recomputes, as for a worker crash.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import enum
import logging
import os
import sys
from collections.abc import Iterator
from typing import NoReturn

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

from stepahead.protocol import (
    Launch,
    launch_from_proto,
    launch_to_proto,
    speculative_from_hello,
    speculative_to_proto,
)
from stepahead.speculative import SpeculativeConfig
from stepahead.v1 import worker_pb2

log = logging.getLogger("stepahead.worker")

# Set by worker_svc.launcher for its ranks: the TCPStore it hosts, and which start of the group
# this is (each start rendezvouses under its own prefix). Without them, torchrun's env:// is used.
STORE_ENV = "STEPAHEAD_TP_STORE"
ATTEMPT_ENV = "STEPAHEAD_TP_ATTEMPT"

STEP_TIMEOUT = datetime.timedelta(minutes=5)  # a collective of a step: a hung peer fails the group
IDLE_TIMEOUT = datetime.timedelta(days=365)  # a follower waits for the next command while idle
GROUP_BROKEN_EXIT = 70  # a rank's exit code once its group lost a peer
FRAME_BYTES = 16384  # a command's broadcast: kind and size (two int64), then the payload
HEADER_BYTES = 16
UP_KEY = "up"  # set by rank 0 in its start's store prefix once it serves


class GroupBroken(RuntimeError):
    """A collective failed: a peer is gone, and this group cannot run another step."""


class Command(enum.IntEnum):
    SESSION = 1  # payload: a serialized worker.proto Hello (its max_batch_tokens and speculative)
    LAUNCH = 2  # payload: a serialized worker.proto Launch
    STOP = 3


@dataclasses.dataclass(frozen=True)
class RankPlace:
    """Where this process stands in the group, from the environment torchrun or the launcher set."""

    rank: int
    size: int
    local_rank: int

    @classmethod
    def from_env(cls) -> RankPlace:
        return cls(
            int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0"))
        )

    def device(self, device_type: str) -> torch.device:
        """One GPU a rank (by local rank); the CPU is shared."""
        return torch.device(f"cuda:{self.local_rank}") if device_type == "cuda" else torch.device("cpu")


class TensorParallelRanks:
    """This rank's groups: the model's collectives, and the command broadcast from rank 0."""

    def __init__(
        self,
        place: RankPlace,
        model_group: dist.ProcessGroup,
        bus: dist.ProcessGroup,
        store: Store | None = None,
    ) -> None:
        self.place = place
        self.store = store  # the launcher's, under this start's prefix; None under torchrun
        self._model_group = model_group
        self._bus = bus
        self._posted: collections.deque[tuple[dist.Work, torch.Tensor]] = collections.deque()

    @property
    def is_leader(self) -> bool:
        return self.place.rank == 0

    @property
    def size(self) -> int:
        return self.place.size

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
        """Reduces `tensor` over the ranks in place (a sum: the model's row-parallel layers)."""
        with _collective("all-reduce"):
            dist.all_reduce(tensor, op=op, group=self._model_group)

    def share_ids(self, ids: torch.Tensor) -> None:
        """Rank 0's `ids` into every rank's `ids` (the constrained rows, which only rank 0's
        matchers mask): one small broadcast on the model's group, on the device's stream."""
        with _collective("grammar ids broadcast"):
            dist.broadcast(ids, src=0, group=self._model_group)

    def check_same_ids(self, ids: torch.Tensor) -> None:
        """--check-invariants: every rank sampled the same ids (synchronises the device)."""
        low, high = ids.clone(), ids.clone()
        self.all_reduce(low, dist.ReduceOp.MIN)
        self.all_reduce(high, dist.ReduceOp.MAX)
        if not torch.equal(low, high):
            raise GroupBroken(f"rank {self.place.rank}: the ranks sampled different ids")

    def hand_session(
        self, max_batch_tokens: int | None, speculative: SpeculativeConfig | None = None
    ) -> None:
        hello = worker_pb2.Hello(max_batch_tokens=max_batch_tokens or 0)
        if speculative is not None:
            hello.speculative.CopyFrom(speculative_to_proto(speculative))
        self._send(Command.SESSION, hello.SerializeToString())

    def hand_launch(self, launch: Launch) -> None:
        self.hand_launch_bytes(launch_to_proto(launch).SerializeToString())

    def hand_launch_bytes(self, launch: bytes) -> None:
        """A serialized worker.proto Launch."""
        self._send(Command.LAUNCH, launch)

    def hand_stop(self) -> None:
        self._send(Command.STOP, b"")
        self._flush()

    def receive(self) -> tuple[Command, bytes]:
        """The next command from rank 0 (followers only); waits while the worker is idle."""
        frame = torch.empty(FRAME_BYTES, dtype=torch.uint8)
        self._broadcast(frame)
        header = frame[:HEADER_BYTES].view(torch.int64)
        kind, size = Command(int(header[0])), int(header[1])
        if size <= FRAME_BYTES - HEADER_BYTES:
            return kind, frame[HEADER_BYTES : HEADER_BYTES + size].numpy().tobytes()
        rest = torch.empty(size, dtype=torch.uint8)
        self._broadcast(rest)
        return kind, rest.numpy().tobytes()

    def barrier(self) -> None:
        """Until every rank has its engine (rank 0 serves only then)."""
        dist.barrier(group=self._bus)

    def mark_up(self) -> None:
        """Rank 0 serves: from now on, the loss of a rank is worth starting the group again."""
        if self.store is not None:
            self.store.set(UP_KEY, "1")

    def close(self) -> None:
        dist.destroy_process_group()

    def _send(self, kind: Command, payload: bytes) -> None:
        """One broadcast of a fixed frame for most commands (a launch of a few hundred rows
        fits); a larger payload follows in a second one."""
        if not self.is_leader:
            return
        frame = torch.zeros(FRAME_BYTES, dtype=torch.uint8)
        frame[:HEADER_BYTES].view(torch.int64).copy_(torch.tensor([int(kind), len(payload)]))
        inline = len(payload) <= FRAME_BYTES - HEADER_BYTES
        if inline and payload:
            frame[HEADER_BYTES : HEADER_BYTES + len(payload)] = torch.frombuffer(
                bytearray(payload), dtype=torch.uint8
            )
        self._post(frame)
        if not inline:
            self._post(torch.frombuffer(bytearray(payload), dtype=torch.uint8))

    def _post(self, tensor: torch.Tensor) -> None:
        """Rank 0's broadcast, without waiting for the others to take it.

        NOTE: a rank takes a command once it has finished the previous one; waiting for that
        here would put the followers' lag on rank 0's forward thread before every step (1.4 ms
        a step at TP 2 on two shared cores). Rank 0 goes on to its forward instead, whose first
        all-reduce meets the others anyway. The tensors stay referenced until sent.
        """
        with _collective("command broadcast"):
            work = dist.broadcast(tensor, src=0, group=self._bus, async_op=True)
        assert work is not None
        self._posted.append((work, tensor))
        while self._posted and self._posted[0][0].is_completed():
            self._check_sent(self._posted.popleft()[0])

    def _flush(self) -> None:
        """Until every command posted has reached the other ranks (before the stop)."""
        while self._posted:
            self._check_sent(self._posted.popleft()[0])

    def _check_sent(self, work: dist.Work) -> None:
        with _collective("command broadcast"):
            work.wait()

    def _broadcast(self, tensor: torch.Tensor) -> None:
        with _collective("command broadcast"):
            dist.broadcast(tensor, src=0, group=self._bus)


@contextlib.contextmanager
def _collective(what: str) -> Iterator[None]:
    """A collective's failure (a peer is gone) as GroupBroken."""
    try:
        yield
    except RuntimeError as exc:
        raise GroupBroken(f"{what} failed: {exc}") from exc


def join_group(place: RankPlace, device_type: str) -> TensorParallelRanks:
    """Rendezvous with the other ranks: NCCL for the model on CUDA, gloo on the CPU; the
    command broadcast always over gloo (it carries host bytes)."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(place.local_rank)
    store = _launcher_store(place)
    if store is not None:
        dist.init_process_group(
            backend, store=store, rank=place.rank, world_size=place.size, timeout=STEP_TIMEOUT
        )
    else:  # torchrun: MASTER_ADDR / MASTER_PORT
        dist.init_process_group(backend, init_method="env://", timeout=STEP_TIMEOUT)
    bus = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    world = dist.group.WORLD
    assert bus is not None and isinstance(world, dist.ProcessGroup)
    return TensorParallelRanks(place, world, bus, store)


def _launcher_store(place: RankPlace) -> Store | None:
    """The store worker_svc.launcher hosts, under this start's prefix; None without one."""
    address = os.environ.get(STORE_ENV)
    if not address:
        return None
    host, port = address.rsplit(":", 1)
    client = TCPStore(host, int(port), place.size, is_master=False, timeout=STEP_TIMEOUT)
    return attempt_store(client, int(os.environ.get(ATTEMPT_ENV, "0")))


def attempt_store(store: Store, attempt: int) -> Store:
    """The keys of one start of the group (each start rendezvouses afresh)."""
    return PrefixStore(f"attempt{attempt}", store)


def fail_stop(exc: GroupBroken) -> NoReturn:
    """Ends this rank's process at once: a group that lost a peer cannot run another step, and
    its pending collectives would never return (the supervisor starts a new group)."""
    log.critical("tensor-parallel group broken, stopping this rank: %s", exc)
    logging.shutdown()
    sys.stderr.flush()
    os._exit(GROUP_BROKEN_EXIT)


def decode_session(payload: bytes) -> tuple[int | None, SpeculativeConfig | None]:
    """The session's step budget (None: none announced) and speculative decoding."""
    hello = worker_pb2.Hello.FromString(payload)
    return hello.max_batch_tokens or None, speculative_from_hello(hello)


def decode_launch(payload: bytes) -> Launch:
    return launch_from_proto(worker_pb2.Launch.FromString(payload))
