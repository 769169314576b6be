"""Logits processing and log-probabilities in the worker engine, under overlap, against a dense
host reference.

The reference runs the whole model densely on each step's full sequence, then applies
transformers' RepetitionPenaltyLogitsProcessor, OpenAI's presence/frequency formula, the
min_tokens mask and logit_bias, and picks greedily (or with the repo's sampler at the same seed
and position); its log-probabilities are the log-softmax of the same raw logits. The engine is
driven as the overlap scheduler drives it: each launch is submitted before the previous launch's
result is read, and decode rows take their input from the FutureMap.
"""

from __future__ import annotations

import importlib
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

import worker_svc.backends
from stepahead.protocol import (
    Launch,
    LogitsProcessing,
    NewRequest,
    StepResult,
    result_from_proto,
    result_to_proto,
)
from tests.test_device_transfers import RecordingStreams, expected_transfers
from tests.test_model import reference_logits
from tests.transfer_guard import guard_engine, scripted_launches
from worker_svc import sampler
from worker_svc.backends import LlamaBackend, load_backend
from worker_svc.device_streams import CpuStreams
from worker_svc.engine import EngineConfig, WorkerEngine
from worker_svc.gguf import GGUFModel
from worker_svc.loading import BYTE_TOKENIZER
from worker_svc.logits_processors import TokenHistory
from worker_svc.model import LlamaForCausalLM

CPU = torch.device("cpu")
KV_SLOTS = 2048
REQUEST_SLOTS = 8
LOGPROB_ATOL = 1e-5
# NOTE: smollm2 runs in float32 on both sides, the same operations up to the order of some
# reductions: its logits differ by up to ~1e-4 (tests/test_gguf.py), and so its log-probabilities.
SMOLLM2_LOGPROB_ATOL = 1e-3
EOS = 257  # tiny's


def engine_of(backend: Any, check_invariants: bool = True, streams: CpuStreams | None = None) -> WorkerEngine:
    config = EngineConfig(KV_SLOTS, REQUEST_SLOTS, check_invariants)
    engine = WorkerEngine(backend, config, streams or CpuStreams())
    engine.begin_session().result()
    return engine


@pytest.fixture
def engine() -> Iterator[WorkerEngine]:
    # float64: the engine's pooled forward and the dense reference agree to ~1e-15, so greedy
    # choices cannot differ by rounding.
    e = engine_of(load_backend("tiny", CPU, torch.float64, 1.0, 0.0))
    yield e
    e.shutdown()


def model_of(engine: WorkerEngine) -> LlamaForCausalLM:
    backend = engine.backend
    assert isinstance(backend, LlamaBackend)
    return backend.model


# ---- the reference -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """One request: prompt, sampling constants and processing."""

    prompt: list[int]
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    processing: LogitsProcessing | None = None

    def new(self, slot: int) -> NewRequest:
        return NewRequest(slot, self.temperature, self.top_p, self.top_k, self.seed, self.processing)

    @property
    def top_logprobs(self) -> int | None:
        p = self.processing
        return p.top_logprobs if p is not None and p.logprobs else None


def processing(prompt: Sequence[int], **fields: Any) -> LogitsProcessing:
    return LogitsProcessing(prompt_len=len(prompt), **fields)


@dataclass(frozen=True)
class RefToken:
    id: int
    logprobs: torch.Tensor  # [V] float64: log-softmax of the raw logits it was sampled from


def reference(model: LlamaForCausalLM, spec: Spec, steps: int) -> list[RefToken]:
    seq = list(spec.prompt)
    out: list[RefToken] = []
    for _ in range(steps):
        logits = reference_logits(model, seq)[-1]
        processed = reference_processing(logits, spec.processing, seq, len(spec.prompt))
        token = reference_pick(processed, spec, len(seq))
        out.append(RefToken(token, logits.double().log_softmax(-1)))
        seq.append(token)
    return out


def reference_processing(
    logits: torch.Tensor, p: LogitsProcessing | None, seq: list[int], prompt_len: int
) -> torch.Tensor:
    if p is None:
        return logits
    out = logits.clone()
    outputs = seq[prompt_len:]
    if len(outputs) < p.min_tokens:
        out[list(p.stop_ids)] = float("-inf")
    for token, bias in p.logit_bias:
        out[token] += bias
    if p.repetition_penalty != 1.0:
        processors: Any = importlib.import_module("transformers.generation.logits_process")
        penalty = processors.RepetitionPenaltyLogitsProcessor(p.repetition_penalty)
        out = penalty(torch.tensor([seq]), out[None])[0]
    for token, count in Counter(outputs).items():
        out[token] -= p.frequency_penalty * count + p.presence_penalty
    return out


def reference_pick(processed: torch.Tensor, spec: Spec, position: int) -> int:
    if spec.temperature <= 0:
        return int(processed.argmax())
    token = sampler.sample(
        processed[None],
        torch.tensor([spec.temperature]),
        torch.tensor([spec.top_p]),
        torch.tensor([spec.top_k]),
        torch.tensor([spec.seed & (2**63 - 1)]),
        torch.tensor([position]),
    )
    return int(token[0])


# ---- a driver that launches as the overlap scheduler does --------------------------------------


@dataclass
class Live:
    """A request on the engine, and what the host has read of it."""

    spec: Spec
    slot: int
    fed: int = 0  # tokens in its KV
    tokens: list[int] = field(default_factory=list)
    logprobs: list[tuple[float, list[int], list[float]] | None] = field(default_factory=list)

    @property
    def known(self) -> list[int]:
        """What its prefill rows carry: the prompt, then the outputs read back."""
        return self.spec.prompt + self.tokens


@dataclass(frozen=True)
class Row:
    live: Live
    start: int
    ids: list[int] | None  # None: a decode row, its input read from the FutureMap
    sample: bool


def prefill(live: Live, n: int, sample: bool = True) -> Row:
    """The next n known tokens: a prompt chunk, a replay, or (as the serial loop sends a decode)
    the last token read back."""
    ids = live.known[live.fed : live.fed + n]
    assert len(ids) == n
    row = Row(live, live.fed, ids, sample)
    live.fed += n
    return row


def decode(live: Live) -> Row:
    row = Row(live, live.fed, None, True)
    live.fed += 1
    return row


class Driver:
    """Each launch is submitted before the previous launch's result is read (one step ahead)."""

    def __init__(self, engine: WorkerEngine, ahead: bool = True) -> None:
        self.engine = engine
        self.ahead = ahead  # False: each result is read before the next launch (the serial loop)
        self.launches: list[Launch] = []
        self.results: list[StepResult] = []
        self._in_flight: deque[tuple[Future[StepResult], list[Row]]] = deque()
        self._steps = 0
        self._next_kv = 0

    def start(self, spec: Spec, slot: int) -> Live:
        return Live(spec, slot)

    def recompute(self, live: Live) -> None:
        """Preempted: replay the prompt and every output read so far (none may be in flight)."""
        assert all(row.live is not live for _, rows in self._in_flight for row in rows)
        live.fed = 0

    def launch(
        self, rows: Sequence[Row] = (), new: Sequence[Live] = (), released: Sequence[int] = ()
    ) -> None:
        self._steps += 1
        tokens = sum(1 if r.ids is None else len(r.ids) for r in rows)
        kv = list(range(self._next_kv, self._next_kv + tokens))
        self._next_kv += tokens
        launch = Launch(
            self._steps,
            released_slots=list(released),
            new_requests=[live.spec.new(live.slot) for live in new],
            row_req_slots=[r.live.slot for r in rows],
            row_start_pos=[r.start for r in rows],
            row_num_tokens=[1 if r.ids is None else len(r.ids) for r in rows],
            row_from_future=[r.ids is None for r in rows],
            row_sample=[r.sample for r in rows],
            prompt_ids=[i for r in rows for i in r.ids or ()],
            kv_slots=kv,
        )
        self.launches.append(launch)
        self._in_flight.append((self.engine.submit(launch), [r for r in rows if r.sample]))
        if len(self._in_flight) > int(self.ahead):
            self._read()

    def finish(self) -> None:
        while self._in_flight:
            self._read()

    def _read(self) -> None:
        future, rows = self._in_flight.popleft()
        result = future.result(timeout=120)
        self.results.append(result)
        assert len(result.token_ids) == len(rows)
        for i, (row, token) in enumerate(zip(rows, result.token_ids, strict=True)):
            row.live.tokens.append(token)
            lp = result.logprobs
            row.live.logprobs.append(None if lp is None else lp.row(i, lp.top_n))


def decodes(lives: Sequence[Live]) -> list[Row]:
    return [decode(live) for live in lives]


# ---- checks --------------------------------------------------------------------------------------


def check_against_reference(model: LlamaForCausalLM, live: Live, atol: float = LOGPROB_ATOL) -> None:
    expected = reference(model, live.spec, len(live.tokens))
    assert live.tokens == [t.id for t in expected]
    for got, ref in zip(live.logprobs, expected, strict=True):
        if live.spec.top_logprobs is None:
            if got is not None:  # another row of the step asked: this row has them too
                assert got[0] == pytest.approx(float(ref.logprobs[ref.id]), abs=atol)
            continue
        assert got is not None
        check_logprobs(got, ref, live.spec.top_logprobs, atol)


def check_logprobs(got: tuple[float, list[int], list[float]], ref: RefToken, asked: int, atol: float) -> None:
    chosen, top_ids, top_logprobs = got
    assert chosen == pytest.approx(float(ref.logprobs[ref.id]), abs=atol)
    assert len(top_ids) == len(top_logprobs) >= asked
    assert top_logprobs == sorted(top_logprobs, reverse=True)
    expected_ids = ref.logprobs.argsort(descending=True)[: len(top_ids)].tolist()
    assert top_ids == expected_ids
    expected_top = ref.logprobs[expected_ids].tolist()
    assert top_logprobs == pytest.approx(expected_top, abs=atol)


PROMPTS = {
    "a": [72, 101, 108, 108, 111, 32, 119],
    "b": [1, 2, 3, 4, 5, 6],
    "c": [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52],
    "d": [9, 8, 7, 6, 5],
    "e": [100, 200, 150, 99],
}


def first_greedy(model: LlamaForCausalLM, prompt: list[int]) -> int:
    return reference(model, Spec(prompt), 1)[0].id


def mixed_specs(model: LlamaForCausalLM) -> dict[str, Spec]:
    """Several features, one request each; b's min_tokens holds back the token it would pick first."""
    a, b, c, d, e = (PROMPTS[k] for k in "abcde")
    return {
        "a": Spec(a, processing=processing(a, repetition_penalty=1.3, logit_bias=((90, -5.0), (33, 4.0)))),
        "b": Spec(
            b,
            processing=processing(
                b,
                presence_penalty=0.5,
                frequency_penalty=0.7,
                min_tokens=4,
                stop_ids=(first_greedy(model, b), EOS),
                logprobs=True,
                top_logprobs=5,
            ),
        ),
        "c": Spec(
            c,
            temperature=0.9,
            top_k=40,
            seed=2**63 + 7,
            processing=processing(c, repetition_penalty=0.8, frequency_penalty=0.3, logprobs=True),
        ),
        "d": Spec(d),  # plain: processing None
        "e": Spec(e, processing=processing(e, logprobs=True, top_logprobs=3)),  # log-probabilities only
    }


# ---- 1. features mixed in batches, chunked prefill, a recompute ---------------------------------


def test_mixed_features_under_overlap_equal_the_dense_reference(engine: WorkerEngine) -> None:
    model = model_of(engine)
    specs = mixed_specs(model)
    drive = Driver(engine)
    live = {name: drive.start(spec, slot) for slot, (name, spec) in enumerate(specs.items())}
    a, b, c, d, e = (live[k] for k in "abcde")
    drive.launch([prefill(a, 7), prefill(d, 5), prefill(c, 6, sample=False)], new=[a, d, c])
    drive.launch([decode(a), decode(d), prefill(c, 7), prefill(b, 6), prefill(e, 4)], new=[b, e])
    for _ in range(4):
        drive.launch(decodes([a, b, c, d, e]))
    drive.launch(decodes([a, c, d, e]))  # b is preempted: not scheduled while its result is read
    drive.recompute(b)
    replay = len(b.known)
    assert replay == 6 + 5
    drive.launch([*decodes([a, c, d, e]), prefill(b, 6, sample=False)], new=[b], released=[b.slot])
    drive.launch([*decodes([a, c, d, e]), prefill(b, replay - 6)])
    for _ in range(4):
        drive.launch(decodes([a, b, c, d, e]))
    drive.finish()
    assert [len(x.tokens) for x in (a, b, c, d, e)] == [13, 10, 12, 13, 12]
    for x in (a, b, c, d, e):
        check_against_reference(model, x)
    assert b.tokens[0] != first_greedy(model, b.spec.prompt)  # min_tokens held it back


def test_a_recompute_on_another_slot_continues_identically(engine: WorkerEngine) -> None:
    model = model_of(engine)
    spec = mixed_specs(model)["b"]
    drive = Driver(engine)
    b = drive.start(spec, 2)
    drive.launch([prefill(b, 6)], new=[b])
    for _ in range(3):
        drive.launch([decode(b)])
    drive.finish()
    drive.recompute(b)
    b.slot = 5
    drive.launch([prefill(b, len(b.known))], new=[b], released=[2])
    for _ in range(5):
        drive.launch([decode(b)])
    drive.finish()
    check_against_reference(model, b)


def test_tokens_fed_back_as_known_are_counted_once(engine: WorkerEngine) -> None:
    # The serial loop sends each decode's input as a known token (a 1-token prefill row at a
    # position past the prompt); the overlap loop does so for a request that skipped a step.
    model = model_of(engine)
    specs = mixed_specs(model)
    a = PROMPTS["a"]
    # Counted once, a repeat costs nothing (-1 + 1): tiny's greedy loop repeats (period 4).
    loops = Spec(a, processing=processing(a, presence_penalty=-1.0, frequency_penalty=1.0))
    drive = Driver(engine, ahead=False)
    lives = [drive.start(spec, slot) for slot, spec in enumerate([specs["b"], specs["c"], loops])]
    drive.launch([prefill(x, len(x.known)) for x in lives], new=lives)
    for _ in range(5):
        drive.launch([prefill(x, 1) for x in lives])
    drive.ahead = True
    for step in range(6):
        drive.launch([decode(x) for x in lives[: 2 + step % 2]])
        drive.finish()
        drive.launch([prefill(lives[2], 1)] if step % 2 == 0 else [])
    drive.finish()
    assert [len(x.tokens) for x in lives] == [12, 12, 12]
    for x in lives:
        check_against_reference(model, x)
    assert len(set(lives[2].tokens)) < 12


# ---- 2. the history sees the token sampled one step before, under overlap -----------------------


def never_repeat(prompt: list[int]) -> LogitsProcessing:
    """Greedy can never pick a seen token again: a seen token's logit falls to about 1 or less
    (the prompt's) or below 0 (an output's), under many unseen ones; unpenalized, the top of
    the bias ladder (100) would win every step, and with a history one step late, every other."""
    ladder = tuple((200 + i, 100.0 - 10.0 * i) for i in range(10))
    return processing(
        prompt, repetition_penalty=100.0, presence_penalty=2.0, frequency_penalty=2.0, logit_bias=ladder
    )


def test_under_overlap_no_token_is_picked_twice(engine: WorkerEngine) -> None:
    model = model_of(engine)
    drive = Driver(engine)
    prompts = [PROMPTS["a"], PROMPTS["d"]]
    lives = [drive.start(Spec(p, processing=never_repeat(p)), slot) for slot, p in enumerate(prompts)]
    drive.launch([prefill(x, len(x.known)) for x in lives], new=lives)
    for _ in range(11):
        drive.launch(decodes(lives))
    drive.finish()
    for x in lives:
        assert len(x.tokens) == 12
        assert all(t0 != t1 for t0, t1 in zip(x.tokens, x.tokens[1:], strict=False)), x.tokens
        assert len(set(x.tokens)) == len(x.tokens), x.tokens
        assert not set(x.tokens) & set(x.spec.prompt)
        check_against_reference(model, x)


# ---- 3. a reused slot starts from nothing --------------------------------------------------------


def run_alone(spec: Spec, steps: int) -> list[int]:
    fresh = engine_of(load_backend("tiny", CPU, torch.float64, 1.0, 0.0))
    try:
        drive = Driver(fresh)
        live = drive.start(spec, 0)
        drive.launch([prefill(live, len(live.known))], new=[live])
        for _ in range(steps - 1):
            drive.launch([decode(live)])
        drive.finish()
        return live.tokens
    finally:
        fresh.shutdown()


@pytest.mark.parametrize("same_launch", [False, True], ids=["released then registered", "in one launch"])
def test_a_reused_slot_keeps_nothing_of_its_previous_request(engine: WorkerEngine, same_launch: bool) -> None:
    # A biased, penalized companion on slot 0 runs throughout, so every step gathers slot 3's
    # constants, bias entries and (penalized rows) history too.
    prompt = PROMPTS["a"]
    first = Spec(prompt, processing=never_repeat(prompt))
    plain = Spec(prompt)
    second = Spec(prompt, processing=processing(prompt, frequency_penalty=1.5, presence_penalty=0.5))
    companion_prompt = PROMPTS["d"]
    companion = processing(
        companion_prompt, repetition_penalty=1.2, logit_bias=((7, 2.0), (8, 1.0), (9, 0.5))
    )
    drive = Driver(engine)
    other, x = drive.start(Spec(companion_prompt, processing=companion), 0), drive.start(first, 3)
    drive.launch([prefill(other, 5), prefill(x, len(prompt))], new=[other, x])
    for _ in range(7):
        drive.launch([decode(other), decode(x)])
    for spec in (plain, second):
        previous, x = x, drive.start(spec, 3)
        if not same_launch:
            drive.launch([decode(other)], released=[previous.slot])
        released = [previous.slot] if same_launch else []
        drive.launch([decode(other), prefill(x, len(prompt))], new=[x], released=released)
        for _ in range(7):
            drive.launch([decode(other), decode(x)])
        drive.finish()
        assert x.tokens == run_alone(spec, 8)
    check_against_reference(model_of(engine), other)


# ---- 4. log-probabilities ------------------------------------------------------------------------


def test_logprobs_come_for_every_row_of_a_step_where_one_asks(engine: WorkerEngine) -> None:
    model = model_of(engine)
    d, e = PROMPTS["d"], PROMPTS["e"]
    asks4 = Spec(d, processing=processing(d, logprobs=True, top_logprobs=4))
    asks0 = Spec(e, processing=processing(e, logprobs=True))
    plain = Spec(PROMPTS["b"], temperature=0.7, seed=3)
    drive = Driver(engine)
    x, y, z = drive.start(asks4, 0), drive.start(asks0, 1), drive.start(plain, 2)
    drive.launch([prefill(x, 5), prefill(z, 6)], new=[x, z])  # top_n 4
    drive.launch([decode(x), decode(z), prefill(y, 4)], new=[y])  # 4: the most of the askers
    drive.launch([decode(z), decode(y)])  # 0: only y asks, for none
    drive.launch([decode(z)])  # nobody asks
    drive.finish()
    top_ns = [r.logprobs.top_n if r.logprobs is not None else None for r in drive.results]
    assert top_ns == [4, 4, 0, None]
    for result in drive.results[:3]:
        lp = result.logprobs
        assert lp is not None
        assert len(lp.chosen) == len(result.token_ids)
        assert len(lp.top_ids) == len(lp.top_logprobs) == lp.top_n * len(result.token_ids)
        assert result_from_proto(result_to_proto(result)) == result  # float32-exact on the wire
    for live in (x, y, z):
        check_against_reference(model, live)
    assert z.logprobs[:3] != [None] * 3 and z.logprobs[3] is None


def test_the_sim_returns_certain_logprobs_of_the_model_s_shape() -> None:
    sim = engine_of(load_backend("sim", CPU, torch.float32, 0.0, 0.0))
    try:
        drive = Driver(sim)
        p = PROMPTS["d"]
        x = drive.start(
            Spec(p, processing=processing(p, logprobs=True, top_logprobs=3, frequency_penalty=2.0)), 0
        )
        drive.launch([prefill(x, 5)], new=[x])
        drive.launch([decode(x)])
        drive.finish()
    finally:
        sim.shutdown()
    for token, lp in zip(x.tokens, x.logprobs, strict=True):
        assert lp is not None
        assert lp[0] == 0.0 and lp[1][0] == token and lp[2] == [0.0, -9999.0, -9999.0]
        assert len(set(lp[1])) == 3 and all(0 <= i < 258 for i in lp[1])


# ---- the plain path and the transfers -------------------------------------------------------------


def test_a_workload_without_processing_runs_none_of_it(
    engine: WorkerEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*_: object) -> None:
        raise AssertionError("processing ran for a plain workload")

    for name in ("add_tokens", "add_outputs"):
        monkeypatch.setattr(TokenHistory, name, refuse)
    monkeypatch.setattr(worker_svc.backends, "process_logits", refuse)
    monkeypatch.setattr(worker_svc.backends, "token_logprobs", refuse)
    results = [engine.submit(launch) for launch in scripted_launches().launches]
    assert all(r.result(timeout=120).logprobs is None for r in results)


def test_processing_moves_host_values_only_through_the_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    # No sentinel check: it reads the FutureMap back by design.
    streams = RecordingStreams()
    engine = engine_of(load_backend("tiny", CPU, torch.float64, 1.0, 0.0), False, streams)
    try:
        model = model_of(engine)
        guard = guard_engine(engine, monkeypatch)
        drive = Driver(engine)
        lives = [drive.start(spec, slot) for slot, spec in enumerate(mixed_specs(model).values())]
        drive.launch([prefill(x, len(x.known)) for x in lives], new=lives)
        for _ in range(3):
            drive.launch(decodes(lives))
        drive.finish()
    finally:
        engine.shutdown()
    assert not guard.violations, "\n".join(guard.violations)
    # As many transfers as without processing: its host columns ride in the same ones.
    assert len(streams.transfers) == sum(expected_transfers(launch) for launch in drive.launches)
    float_transfers = [t for t in streams.transfers if t.dtype == torch.float32]
    assert len(float_transfers) == sum(bool(launch.new_requests) for launch in drive.launches)
    assert len(streams.copied) == len(drive.launches)
    for x in lives:
        check_against_reference(model, x)


# ---- 5. smollm2 --------------------------------------------------------------------------------


def test_smollm2_greedy_with_penalties_and_logprobs_equals_the_reference(smollm2: GGUFModel) -> None:
    model = smollm2.model
    engine = engine_of(LlamaBackend(model, BYTE_TOKENIZER))
    try:
        prompts = [[1, 504, 3458, 282, 4649, 314], [1, 378, 1789, 2286, 282, 260, 3658, 1029, 314]]
        specs = [
            Spec(
                prompts[0],
                processing=processing(prompts[0], repetition_penalty=1.3, logprobs=True, top_logprobs=5),
            ),
            Spec(
                prompts[1],
                processing=processing(
                    prompts[1],
                    presence_penalty=0.6,
                    frequency_penalty=0.8,
                    logit_bias=((28, 3.0),),
                    logprobs=True,
                ),
            ),
        ]
        drive = Driver(engine)
        lives = [drive.start(spec, slot) for slot, spec in enumerate(specs)]
        drive.launch([prefill(x, len(x.known)) for x in lives], new=lives)
        for _ in range(7):
            drive.launch(decodes(lives))
        drive.finish()
    finally:
        engine.shutdown()
    for x in lives:
        assert len(x.tokens) == 8
        check_against_reference(model, x, SMOLLM2_LOGPROB_ATOL)
