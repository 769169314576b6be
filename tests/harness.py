"""Drive an engine core and a frontend in this process and read what its clients receive."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from scheduler_svc.contract import FinishReason, SamplingParams, TokenLogprob
from scheduler_svc.engine.batch import ScheduledBatch
from scheduler_svc.engine.core import CoreConfig, EngineCore, StepHandle
from scheduler_svc.engine.depth import DepthConfig
from scheduler_svc.engine.late_pick import LatePickConfig
from scheduler_svc.engine.policy import PolicyConfig
from scheduler_svc.engine.transport import WorkerSession, WorkerTransport
from scheduler_svc.frontend.frontend import Frontend, FrontendConfig
from scheduler_svc.frontend.streams import Completions, OutputChunk
from scheduler_svc.process.link.local import LocalCore
from stepahead.protocol import Launch, StepResult
from stepahead.speculative import SpeculativeConfig
from tests.live import SETTLE_TIMEOUT_S
from worker_svc.backends import load_backend
from worker_svc.device_streams import CpuStreams
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
    after: str | None = None  # sent once the client of this earlier call has seen it end
    after_first_token: bool = False  # ... or, with this, once it has seen its first token


@dataclass
class ClientView:
    """Everything one client received."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    messages: int = 0
    completion_tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[tuple[TokenLogprob, ...]] = field(default_factory=list)  # each message's


def make_engine(
    model: str,
    kv_slots: int,
    request_slots: int,
    dtype: torch.dtype = torch.float32,
    sim_step_ms: float = 1.0,
    device: torch.device = CPU,
    host_reads_free: bool = True,
) -> WorkerEngine:
    """`host_reads_free`: False keeps a CPU engine's streams to a GPU's rule
    (`GpuShapedCpuStreams`)."""
    backend = load_backend(model, device, dtype, sim_step_ms, 0.0)
    config = EngineConfig(kv_slots, request_slots, check_invariants=True)
    streams = backend.make_streams(device)
    if not host_reads_free:
        streams = GpuShapedCpuStreams() if isinstance(streams, CpuStreams) else streams
    return WorkerEngine(backend, config, streams)


class GpuShapedCpuStreams(CpuStreams):
    """CPU streams under a GPU's rule: the forward thread reads no device value back, so a
    step's rows keep the shapes the scheduler sent (speculative decoding's verify rows are
    not resolved on the host, as on CUDA)."""

    host_reads_free = False


@dataclass
class Served:
    """An engine core with one frontend in this process (--frontends 0). The clients of the
    calls in `abort_at_launch` abort them right after the core launches their first prefill
    chunk, before any token of theirs is processed (see abort_when_launched)."""

    core: EngineCore
    frontend: Frontend
    abort_at_launch: set[str] = field(default_factory=set)


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

    @property
    def last_heard(self) -> float:
        return self._inner.last_heard

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


class SkewedSession:
    """`inner` whose results' forward stamps read `skew_s` later than the worker's clock said
    at the handshake: to the scheduler each in-flight forward seems to end that much later."""

    def __init__(self, inner: WorkerSession, skew_s: float) -> None:
        self.info = inner.info
        self._inner, self._skew_s = inner, skew_s

    @property
    def last_heard(self) -> float:
        return self._inner.last_heard

    async def launch(self, launch: Launch) -> asyncio.Future[StepResult]:
        done = await self._inner.launch(launch)
        skewed: asyncio.Future[StepResult] = asyncio.get_running_loop().create_future()
        done.add_done_callback(lambda f: _skew(f, skewed, self._skew_s))
        return skewed

    async def close(self) -> None:
        await self._inner.close()


def _skew(done: asyncio.Future[StepResult], skewed: asyncio.Future[StepResult], skew_s: float) -> None:
    if skewed.done():
        return
    if done.cancelled() or done.exception() is not None:
        skewed.set_exception(done.exception() or asyncio.CancelledError())
        return
    got = done.result()
    if got.forward_end > 0:  # a launch that only released slots has no timing to shift
        got = dataclasses.replace(
            got, forward_start=got.forward_start + skew_s, forward_end=got.forward_end + skew_s
        )
    skewed.set_result(got)


class SkewedTransport:
    """`inner` with a worker clock that runs `skew_s` ahead after the handshake (SkewedSession):
    late pick then holds every pick back (by a step at most), whatever the machine's speed."""

    def __init__(self, inner: WorkerTransport, skew_s: float) -> None:
        self._inner, self._skew_s = inner, skew_s

    async def connect(self) -> SkewedSession:
        return SkewedSession(await self._inner.connect(), self._skew_s)

    async def close(self) -> None:
        await self._inner.close()


async def start_core(
    transport: WorkerTransport, config: CoreConfig, instrument: Callable[[EngineCore], None] | None = None
) -> tuple[Served, asyncio.Task[None]]:
    core = EngineCore(transport, config)
    if instrument is not None:
        instrument(core)
    frontend = Frontend(FrontendConfig(config.mode))
    LocalCore(core, frontend)
    served = Served(core, frontend)
    abort_when_launched(served)
    task = asyncio.create_task(core.run())
    async with asyncio.timeout(SETTLE_TIMEOUT_S):
        while not frontend.ready:
            await asyncio.sleep(0.001)
    return served, task


async def consume(
    served: Served, call: Completions, abort_after: int | None, first_token: asyncio.Event | None = None
) -> list[ClientView]:
    """What each completion of the call received; with `abort_after`, the client aborts the call
    once its first completion holds that many tokens (0: see abort_when_launched). `first_token`
    is set once any token (or the end) has arrived."""
    frontend = served.frontend
    views = [ClientView() for _ in call.clients]
    while not call.done:
        await call.ready.wait()
        assert call.error is None, call.error
        for index, chunk in call.take():
            _add_chunk(views[index], chunk)
        if first_token is not None and any(v.token_ids for v in views):
            first_token.set()
        first = views[0]
        if abort_after is not None and len(first.token_ids) >= abort_after and first.finish_reason is None:
            await frontend.abort(call.rid)
    if first_token is not None:
        first_token.set()
    return views


def _add_chunk(view: ClientView, chunk: OutputChunk) -> None:
    view.messages += 1
    view.token_ids += chunk.token_ids
    view.text += chunk.text
    view.logprobs += chunk.logprobs
    if chunk.prompt_logprobs is not None:
        view.prompt_logprobs.append(chunk.prompt_logprobs)
    view.completion_tokens.append(chunk.completion_tokens)
    view.finish_reason = chunk.finish_reason


def abort_when_launched(served: Served) -> None:
    """Wrap the core's launch: once a launch has sent the first prefill chunk of a call in
    `served.abort_at_launch`, its client aborts it, before the core processes any result (in
    both loops the result of a launch is processed after the launch returns), so the call ends
    mid-prefill with no token, whatever the machine's speed."""
    core, launch_step = served.core, served.core.launch_step

    async def launching(batch: ScheduledBatch) -> StepHandle:
        handle = await launch_step(batch)
        for rid in list(served.abort_at_launch):
            req = core.policy.requests.get((rid, 0))
            if req is not None and req.req_slot is not None:  # admitted: its prefill is launched
                assert not req.output_ids, rid
                served.abort_at_launch.discard(rid)
                await served.frontend.abort(rid)
        return handle

    core.launch_step = launching  # type: ignore[method-assign]


async def run_workload(served: Served, items: list[WorkItem]) -> dict[str, ClientView]:
    """Submit the items in order: each `delay_s` after the previous one (at once, without
    yielding to the loop, when 0: a run of such items reaches the core together), and an item
    with `after` only once its client saw that call's first token or end; read every call."""
    frontend = served.frontend
    calls: dict[str, asyncio.Task[list[ClientView]]] = {}
    first_tokens: dict[str, asyncio.Event] = {}
    for item in items:
        if item.after is not None:
            await (
                first_tokens[item.after].wait()
                if item.after_first_token
                else asyncio.wait({calls[item.after]})
            )
        if item.delay_s:
            await asyncio.sleep(item.delay_s)
        call = frontend.submit(item.rid, item.prompt_ids, item.params, item.n)
        if item.abort_after == 0:  # before the core can pick it
            served.abort_at_launch.add(item.rid)
        first_tokens[item.rid] = asyncio.Event()
        calls[item.rid] = asyncio.create_task(consume(served, call, item.abort_after, first_tokens[item.rid]))
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
    clock_skew_s: float = 0.0,
    transport: list[WorkerTransport] | None = None,
    instrument: Callable[[EngineCore], None] | None = None,
    speculative: SpeculativeConfig | None = None,
    host_reads_free: bool = True,
    small_batch: int = PolicyConfig.small_batch,
) -> tuple[dict[str, ClientView], EngineCore, WorkerEngine]:
    """Serve the workload with the in-process transport (behind a link of `link_delay_s` each
    way when set, with a worker clock `clock_skew_s` ahead when set; `transport` receives the
    one used; `instrument` sees the core before it starts; `speculative`: decode rows verify
    drafts; `host_reads_free`: see `make_engine`), wait for the drain."""
    engine = make_engine(model, kv_slots, request_slots, dtype, sim_step_ms, device, host_reads_free)
    config = CoreConfig(
        mode=mode,  # type: ignore[arg-type]
        policy=PolicyConfig(
            max_batch_tokens=max_batch_tokens,
            prefix_cache=prefix_cache,
            speculative=speculative,
            small_batch=small_batch,
        ),
        late_pick=LatePickConfig(enabled=late_pick),
        depth=DepthConfig(depth),
    )
    link: WorkerTransport = InProcessTransport(engine, speculative)
    if link_delay_s:
        link = DelayedTransport(link, link_delay_s)
    if clock_skew_s:
        link = SkewedTransport(link, clock_skew_s)
    if transport is not None:
        transport.append(link)
    served, task = await start_core(link, config, instrument)
    try:
        views = await run_workload(served, items)
        await wait_drained(served.core)
    finally:
        await served.core.close()
        task.cancel()
        engine.shutdown()
    return views, served.core, engine


async def wait_drained(core: EngineCore) -> None:
    """Until nothing is live, in flight, or waiting to be released on the worker."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while not (core.idle and not core.policy.requests):
        if time.monotonic() > deadline:
            raise AssertionError(f"the engine core did not drain within {SETTLE_TIMEOUT_S:g}s")
        await asyncio.sleep(0.002)


def record_depth(core: EngineCore) -> list[int]:
    """The sizes of the core's result_queue after each launch (batches launched whose results
    are not processed yet), appended as the core runs: an `instrument` for serve_workload."""
    sizes: list[int] = []
    queue_result = core.queue_result

    def recording(batch: ScheduledBatch, handle: StepHandle) -> None:
        queue_result(batch, handle)
        sizes.append(len(core.result_queue))

    core.queue_result = recording  # type: ignore[method-assign]
    return sizes


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


def preempting_call(rid: str, kv_slots: int, *, sampled: bool, n: int = 8, prompt_len: int = 16) -> WorkItem:
    """One call of `n` completions that each fit the KV pool alone but together need more than
    all of it, so that the policy must preempt whatever the timing: its completions are admitted
    together (1..n-1 at the first pick after completion 0's prompt is cached; all at once without
    the cache) and decode side by side, ignoring EOS, until the pool runs out. Put it first
    (delay 0), before anything that could hold request slots."""
    max_new = kv_slots // n + 8  # prompt + n x max_new > kv_slots >= prompt + max_new
    assert prompt_len + n * max_new > kv_slots >= prompt_len + max_new
    prompt = [33 + (7 * i) % 90 for i in range(prompt_len)]
    temperature = 1.0 if sampled else 0.0
    return WorkItem(rid, prompt, params(max_new, ignore_eos=True, temperature=temperature, seed=5), 0.0, n=n)


def aborted_call(rid: str, after: int, delay_s: float = 0.0) -> WorkItem:
    """A request its client aborts once it holds `after` tokens: it ignores EOS and asks for far
    more tokens than the abort lets it reach, so it ends by the abort whatever the timing."""
    return WorkItem(rid, [70, 71, 72, 73], params(1000, ignore_eos=True), delay_s, abort_after=after)


def with_forced_scenarios(items: list[WorkItem], kv_slots: int, *, sampled: bool) -> list[WorkItem]:
    """`items` after a call that forces preemption (preempting_call), with two client aborts
    that land for sure (aborted_call: one before the first token, one after two tokens)."""
    middle = len(items) // 2
    aborts = [aborted_call("forced-abort-0", 0), aborted_call("forced-abort-2", 2)]
    return [
        preempting_call("forced-preempt", kv_slots, sampled=sampled),
        *items[:middle],
        *aborts,
        *items[middle:],
    ]
