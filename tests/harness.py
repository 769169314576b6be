"""Drive an engine core and a frontend in this process and read what its clients receive."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from dataclasses import dataclass, field

import torch

from scheduler_svc.core import CoreConfig, EngineCore
from scheduler_svc.depth import DepthConfig
from scheduler_svc.frontend import Frontend, FrontendConfig
from scheduler_svc.late_pick import LatePickConfig
from scheduler_svc.link import LocalCore
from scheduler_svc.outputs import TokenLogprob
from scheduler_svc.policy import PolicyConfig
from scheduler_svc.request import FinishReason, SamplingParams
from scheduler_svc.streams import Completions, OutputChunk
from scheduler_svc.transport import WorkerSession, WorkerTransport
from stepahead.protocol import Launch, StepResult
from worker_svc.backends import load_backend
from worker_svc.engine import EngineConfig, WorkerEngine
from worker_svc.inprocess import InProcessTransport

CPU = torch.device("cpu")


@dataclass(frozen=True)
class WorkItem:
    """One request of a test workload."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    delay_s: float  # arrival after the previous item
    abort_after: int | None = None  # the client aborts once it holds this many tokens
    n: int = 1  # completions: views of completion i > 0 are keyed f"{rid}/{i}"


@dataclass
class ClientView:
    """Everything one client received."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    messages: int = 0
    completion_tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)


def make_engine(
    model: str,
    kv_slots: int,
    request_slots: int,
    dtype: torch.dtype = torch.float32,
    sim_step_ms: float = 1.0,
    device: torch.device = CPU,
) -> WorkerEngine:
    backend = load_backend(model, device, dtype, sim_step_ms, 0.0)
    config = EngineConfig(kv_slots, request_slots, check_invariants=True)
    return WorkerEngine(backend, config, backend.make_streams(device))


@dataclass
class Served:
    """An engine core with one frontend in this process (--frontends 0)."""

    core: EngineCore
    frontend: Frontend


class DelayedSession:
    """A worker session behind a link of `one_way_s` each way: each launch reaches the worker,
    and each result comes back, that much later, in launch order; results carry the link's
    round trip as the gRPC transport measures it."""

    def __init__(self, inner: WorkerSession, one_way_s: float) -> None:
        self.info = inner.info
        self._inner, self._one_way_s = inner, one_way_s
        self._queue: asyncio.Queue[tuple[float, Launch, asyncio.Future[StepResult]]] = asyncio.Queue()
        self._forwarder = asyncio.create_task(self._forward())
        self._returns: set[asyncio.Task[None]] = set()
        self.outstanding = 0
        self.max_outstanding = 0  # launches sent whose result had not come back, at most

    async def launch(self, launch: Launch) -> asyncio.Future[StepResult]:
        done: asyncio.Future[StepResult] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((time.monotonic(), launch, done))
        self.outstanding += 1
        self.max_outstanding = max(self.max_outstanding, self.outstanding)
        return done

    async def close(self) -> None:
        self._forwarder.cancel()
        for task in self._returns:
            task.cancel()
        await self._inner.close()

    async def _forward(self) -> None:
        while True:
            sent_at, launch, done = await self._queue.get()
            await asyncio.sleep(max(sent_at + self._one_way_s - time.monotonic(), 0.0))
            held = self._back(sent_at, time.monotonic(), await self._inner.launch(launch), done)
            task = asyncio.create_task(held)
            self._returns.add(task)
            task.add_done_callback(self._returns.discard)

    async def _back(
        self,
        sent_at: float,
        arrived_at: float,
        result: asyncio.Future[StepResult],
        done: asyncio.Future[StepResult],
    ) -> None:
        try:
            got = await result
        except Exception as exc:
            done.set_exception(exc)
            return
        held = time.monotonic() - arrived_at
        await asyncio.sleep(self._one_way_s)
        self.outstanding -= 1
        if not done.done():
            done.set_result(dataclasses.replace(got, link_rtt_s=time.monotonic() - sent_at - held))


class DelayedTransport:
    """`inner` behind a link of `one_way_s` each way (see DelayedSession)."""

    def __init__(self, inner: WorkerTransport, one_way_s: float) -> None:
        self._inner, self._one_way_s = inner, one_way_s
        self.sessions: list[DelayedSession] = []

    async def connect(self) -> DelayedSession:
        session = DelayedSession(await self._inner.connect(), self._one_way_s)
        self.sessions.append(session)
        return session

    async def close(self) -> None:
        await self._inner.close()


async def start_core(transport: WorkerTransport, config: CoreConfig) -> tuple[Served, asyncio.Task[None]]:
    core = EngineCore(transport, config)
    frontend = Frontend(FrontendConfig(config.mode))
    LocalCore(core, frontend)
    task = asyncio.create_task(core.run())
    while not frontend.ready:
        await asyncio.sleep(0.001)
    return Served(core, frontend), task


async def consume(frontend: Frontend, call: Completions, abort_after: int | None) -> list[ClientView]:
    """What each completion of the call received; with `abort_after`, the client aborts the call
    once its first completion holds that many tokens (0: a few milliseconds after it is sent,
    typically while its prompt is being prefilled)."""
    views = [ClientView() for _ in call.clients]
    if abort_after == 0:
        await asyncio.sleep(0.003)
        await frontend.abort(call.rid)
    while not call.done:
        await call.ready.wait()
        assert call.error is None, call.error
        for index, chunk in call.take():
            _add_chunk(views[index], chunk)
        first = views[0]
        if abort_after is not None and len(first.token_ids) >= abort_after and first.finish_reason is None:
            await frontend.abort(call.rid)
    return views


def _add_chunk(view: ClientView, chunk: OutputChunk) -> None:
    view.messages += 1
    view.token_ids += chunk.token_ids
    view.text += chunk.text
    view.logprobs += chunk.logprobs
    view.completion_tokens.append(chunk.completion_tokens)
    view.finish_reason = chunk.finish_reason


async def run_workload(frontend: Frontend, items: list[WorkItem]) -> dict[str, ClientView]:
    calls: dict[str, asyncio.Task[list[ClientView]]] = {}
    for item in items:
        await asyncio.sleep(item.delay_s)
        call = frontend.submit(item.rid, item.prompt_ids, item.params, item.n)
        calls[item.rid] = asyncio.create_task(consume(frontend, call, item.abort_after))
    views: dict[str, ClientView] = {}
    for rid, task in calls.items():
        for i, view in enumerate(await task):
            views[rid if i == 0 else f"{rid}/{i}"] = view
    return views


async def serve_workload(
    model: str,
    mode: str,
    items: list[WorkItem],
    *,
    kv_slots: int = 4096,
    request_slots: int = 64,
    max_batch_tokens: int = 128,
    dtype: torch.dtype = torch.float32,
    late_pick: bool = False,
    sim_step_ms: float = 1.0,
    device: torch.device = CPU,
    prefix_cache: bool = True,
    depth: int = 1,
    link_delay_s: float = 0.0,
    transport: list[WorkerTransport] | None = None,
) -> tuple[dict[str, ClientView], EngineCore, WorkerEngine]:
    """Serve the workload with the in-process transport (behind a link of `link_delay_s` each
    way when set; `transport` receives the one used), wait for the drain."""
    engine = make_engine(model, kv_slots, request_slots, dtype, sim_step_ms, device)
    config = CoreConfig(
        mode=mode,  # type: ignore[arg-type]
        policy=PolicyConfig(max_batch_tokens=max_batch_tokens, prefix_cache=prefix_cache),
        late_pick=LatePickConfig(enabled=late_pick),
        depth=DepthConfig(depth),
    )
    link: WorkerTransport = InProcessTransport(engine)
    if link_delay_s:
        link = DelayedTransport(link, link_delay_s)
    if transport is not None:
        transport.append(link)
    served, task = await start_core(link, config)
    try:
        views = await run_workload(served.frontend, items)
        await wait_drained(served.core)
    finally:
        await served.core.close()
        task.cancel()
        engine.shutdown()
    return views, served.core, engine


async def wait_drained(core: EngineCore) -> None:
    """Until nothing is live, in flight, or waiting to be released on the worker."""
    for _ in range(5000):
        if core.idle and not core.policy.requests:
            return
        await asyncio.sleep(0.002)
    raise AssertionError("the engine core did not drain")


def params(max_new_tokens: int, **kw: object) -> SamplingParams:
    base: dict[str, object] = dict(
        max_new_tokens=max_new_tokens,
        temperature=0.0,
        top_p=1.0,
        top_k=0,
        seed=0,
        stop_token_ids=frozenset(),
        stop=(),
        ignore_eos=False,
    )
    base.update(kw)
    return SamplingParams(**base)  # type: ignore[arg-type]


def mixed_workload(n: int, seed: int, *, sampled: bool, vocab: int = 256) -> list[WorkItem]:
    """Varied prompt and output lengths, EOS/stop-token/stop-string finishes,
    aborts, arrivals spread over time."""
    rng = random.Random(seed)
    items = []
    for i in range(n):
        prompt_len = rng.choice((rng.randint(1, 24), rng.randint(100, 300)))
        prompt = [rng.randrange(32, 127) for _ in range(prompt_len)]
        kind = rng.random()
        p = params(
            rng.randint(1, 48),
            temperature=rng.choice((0.7, 1.0, 1.3)) if sampled else 0.0,
            top_p=rng.choice((1.0, 0.9)) if sampled else 1.0,
            top_k=rng.choice((0, 0, 40)) if sampled else 0,
            seed=rng.getrandbits(63),
            ignore_eos=kind < 0.3,
            stop_token_ids=frozenset(rng.sample(range(32, 127), 3)) if 0.3 <= kind < 0.45 else frozenset(),
            stop=(chr(rng.randrange(65, 91)), "".join(chr(rng.randrange(97, 123)) for _ in range(2)))
            if 0.45 <= kind < 0.65
            else (),
        )
        abort_after = rng.randint(1, 6) if kind >= 0.9 else None
        items.append(WorkItem(f"r{i}", prompt, p, rng.expovariate(1 / 0.003), abort_after))
    return items
