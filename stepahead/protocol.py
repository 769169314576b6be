"""Typed messages between scheduler and worker, and their protobuf forms.

The scheduler and the worker speak these dataclasses; only the gRPC transport
converts them to and from `stepahead.v1.worker_pb2`. The in-process transport
hands them over as they are, which is what makes it the baseline for the cost
of the process boundary.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, MutableSequence, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from stepahead.packed import I32, U8, U32, pack, unpack, unpack_flags
from stepahead.speculative import SpeculativeConfig
from stepahead.v1 import worker_pb2

PROTOCOL_VERSION = 6  # 2: Keepalive messages while a step computes; 3: grammar constraints;
# 4: speculative decoding (verify rows, token counts); 5: packed columns (stepahead/packed.py);
# 6: prompt log-probabilities (Launch.row_score, StepResult.prompt_logprobs)
MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # the Welcome carries a tokenizer.json
# No HTTP/2 BDP probing: it pings with every burst of data to size the flow-control window for
# bulk transfers, and these streams carry small messages every step, where each ping and its
# ack is one more write and wakeup on both ends (about a tenth of the core's and a frontend's
# CPU per step, measured).
NO_BDP_PROBE = ("grpc.http2.bdp_probe", 0)
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    NO_BDP_PROBE,
]


@dataclass(frozen=True)
class TokenizerSpec:
    kind: str  # "byte" or "hf"
    hf_json: bytes = b""
    chat_template: str = ""  # the model's Jinja template over `messages`; empty: none


@dataclass(frozen=True)
class WorkerInfo:
    """What the handshake tells the scheduler about the worker."""

    model: str
    vocab_size: int
    max_context_len: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    kv_slots: int
    request_slots: int
    device: str
    tokenizer: TokenizerSpec
    epoch: int = 0
    worker_unix_time: float = 0.0
    tensor_parallel_size: int = 1  # ranks the model is sharded over (kv_slots is each rank's pool)
    structured_outputs_unavailable: str = ""  # why grammars cannot be served ("": they can)


@dataclass(frozen=True)
class LogitsProcessing:
    """What a request asks of its logits and log-probabilities (see worker.proto)."""

    prompt_len: int
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    stop_ids: tuple[int, ...] = ()  # masked below min_tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    logprobs: bool = False
    top_logprobs: int = 0

    @property
    def penalized(self) -> bool:
        """Whether it reads the request's token counts."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


ConstraintKind = Literal["json", "regex", "choice", "grammar", "thinking"]
CONSTRAINT_KINDS: tuple[ConstraintKind, ...] = ("json", "regex", "choice", "grammar")  # a client's
# On the worker link also "thinking": a client's constraint after a reasoning model's thinking
# (`stepahead.grammars.thinking_constraint`), its text that constraint's behind a short header.
WIRE_CONSTRAINT_KINDS: tuple[ConstraintKind, ...] = (*CONSTRAINT_KINDS, "thinking")
MAX_CONSTRAINT_BYTES = 64 * 1024  # a constraint's text (a schema, regex, choices or grammar)
MAX_THINKING_HEADER_BYTES = 64


@dataclass(frozen=True)
class Constraint:
    """A structured-output constraint. `text`: a JSON Schema (JSON), a regex, the choices (a JSON
    list of strings), or a Lark grammar. Compiled by `stepahead.grammars`."""

    kind: ConstraintKind
    text: str


@dataclass(frozen=True)
class GrammarConstraint:
    """A slot's constraint, and the output tokens a recompute replays into its fresh matcher."""

    constraint: Constraint
    replay_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class NewRequest:
    """Per-request constants, sent once with the launch that first uses the slot."""

    req_slot: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    processing: LogitsProcessing | None = None  # None: plain sampling
    prefix_kv_slots: tuple[int, ...] = ()  # KV of positions 0.. computed already (prefix cache)
    grammar: GrammarConstraint | None = None  # None: unconstrained
    min_p: float = 0.0  # 0: off

    @property
    def cuts_vocab(self) -> bool:
        """Whether top-k, top-p or min-p may leave tokens out of this request's draws."""
        return self.top_p < 1.0 or self.top_k > 0 or self.min_p > 0.0


NOT_SCORED = -2  # Launch.row_score: the row's positions are not scored
IN_ROW = -1  # Launch.row_score: scored within the row only (its last position samples, or is the last asked)


@dataclass
class Launch:
    """One batch, as deltas against the worker's per-slot state.

    Row i brings row_num_tokens[i] tokens at positions row_start_pos[i]...;
    a row_from_future row is one decode token read from the FutureMap on the
    device, the other rows take their ids from prompt_ids in row order.
    kv_slots holds one KV pool slot per token, in row order.
    """

    step_id: int
    released_slots: list[int] = field(default_factory=list)
    new_requests: list[NewRequest] = field(default_factory=list)
    row_req_slots: list[int] = field(default_factory=list)
    row_start_pos: list[int] = field(default_factory=list)
    row_num_tokens: list[int] = field(default_factory=list)
    row_from_future: list[bool] = field(default_factory=list)
    row_sample: list[bool] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)
    kv_slots: list[int] = field(default_factory=list)
    # Prompt log-probabilities (`row_scores`): empty, or one per row: NOT_SCORED, IN_ROW (each
    # position but the row's last is scored against the row's next token), or the token id its
    # last position is scored against too (the next chunk's first); `score_top_n` alternatives.
    row_score: list[int] = field(default_factory=list)
    score_top_n: int = 0

    @property
    def num_rows(self) -> int:
        return len(self.row_req_slots)

    def rows(self) -> Iterator[tuple[int, int, int, bool, bool]]:
        """Each row's (request slot, start position, tokens, from the FutureMap, samples)."""
        return zip(
            self.row_req_slots,
            self.row_start_pos,
            self.row_num_tokens,
            self.row_from_future,
            self.row_sample,
            strict=True,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.kv_slots)

    def row_scores(self) -> Iterator[tuple[int, int]]:
        """Each row's scored positions: (how many, the last one's target or IN_ROW), from its
        first position on; (0, NOT_SCORED) for a row not scored."""
        if not self.row_score:  # most launches: no per-row work
            return itertools.repeat((0, NOT_SCORED), self.num_rows)
        return (
            (0, NOT_SCORED) if score == NOT_SCORED else ((n - 1 if score == IN_ROW else n), score)
            for n, score in zip(self.row_num_tokens, self.row_score, strict=True)
        )

    @property
    def num_scored(self) -> int:
        """Prompt positions scored by this launch, in row order (`StepResult.prompt_logprobs`)."""
        return sum(count for count, _ in self.row_scores())

    @property
    def forward_mode(self) -> str:
        """ "decode" (every row reads the FutureMap), "prefill" (none does) or "mixed"."""
        decode_rows = sum(self.row_from_future)
        if decode_rows == self.num_rows:
            return "decode"
        return "prefill" if decode_rows == 0 else "mixed"


@dataclass(frozen=True)
class StepLogprobs:
    """Per sampling row, in row order: the sampled token's log-probability, and the `top_n`
    most likely ids with theirs (row-major, most likely first)."""

    chosen: list[float]
    top_n: int = 0
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)

    def row(self, i: int, n: int) -> tuple[float, list[int], list[float]]:
        """Row i's log-probability and its first `n` (at most top_n) alternatives."""
        start = i * self.top_n
        end = start + min(n, self.top_n)
        return self.chosen[i], self.top_ids[start:end], self.top_logprobs[start:end]


@dataclass(frozen=True)
class StepResult:
    step_id: int
    token_ids: list[int]  # one per sampling row, in row order
    forward_start: float = 0.0  # worker clock, Unix seconds
    forward_end: float = 0.0
    epoch: int = 0  # the worker session that executed the step
    logprobs: StepLogprobs | None = None  # when any sampling row asked for them
    held_s: float = 0.0  # the worker's time from reading the launch to sending this result
    link_rtt_s: float | None = None  # set by the scheduler's transport: its wait minus held_s
    grammar_finished: tuple[int, ...] = ()  # sampling rows whose grammar this step's token finished
    # Tokens each sampling row emitted, token_ids holding them all in row order (a verify row
    # emits 1 to num_speculative_tokens + 1); empty: one each.
    token_counts: tuple[int, ...] = ()
    # With token_counts: whether prompt lookup found drafts for each sampling row's request at
    # this step (carried or not): the scheduler drafts for a request while it finds some.
    drafts_found: tuple[bool, ...] = ()
    # The launch's scored prompt positions (`Launch.row_scores`), in row order: each one's next
    # prompt token's log-probability, and the launch's score_top_n alternatives.
    prompt_logprobs: StepLogprobs | None = None

    @property
    def forward_seconds(self) -> float:
        return self.forward_end - self.forward_start


class WorkerStepError(RuntimeError):
    """The worker failed to execute a launched step."""

    def __init__(self, step_id: int, message: str) -> None:
        super().__init__(f"step {step_id}: {message}")
        self.step_id = step_id
        self.message = message


def info_to_proto(info: WorkerInfo) -> worker_pb2.Welcome:
    welcome = worker_pb2.Welcome(
        protocol_version=PROTOCOL_VERSION,
        epoch=info.epoch,
        model=info.model,
        vocab_size=info.vocab_size,
        max_context_len=info.max_context_len,
        eos_token_ids=info.eos_token_ids,
        kv_slots=info.kv_slots,
        request_slots=info.request_slots,
        device=info.device,
        tokenizer=tokenizer_to_proto(info.tokenizer),
        worker_unix_time=info.worker_unix_time,
        tensor_parallel_size=info.tensor_parallel_size,
        structured_outputs_unavailable=info.structured_outputs_unavailable,
    )
    if info.bos_token_id is not None:
        welcome.bos_token_id = info.bos_token_id
    return welcome


def tokenizer_to_proto(spec: TokenizerSpec) -> worker_pb2.TokenizerSpec:
    return worker_pb2.TokenizerSpec(kind=spec.kind, hf_json=spec.hf_json, chat_template=spec.chat_template)


def info_from_proto(welcome: worker_pb2.Welcome) -> WorkerInfo:
    t = welcome.tokenizer
    return WorkerInfo(
        model=welcome.model,
        vocab_size=welcome.vocab_size,
        max_context_len=welcome.max_context_len,
        eos_token_ids=tuple(welcome.eos_token_ids),
        bos_token_id=welcome.bos_token_id if welcome.HasField("bos_token_id") else None,
        kv_slots=welcome.kv_slots,
        request_slots=welcome.request_slots,
        device=welcome.device,
        tokenizer=TokenizerSpec(t.kind, t.hf_json, t.chat_template),
        epoch=welcome.epoch,
        worker_unix_time=welcome.worker_unix_time,
        tensor_parallel_size=welcome.tensor_parallel_size or 1,
        structured_outputs_unavailable=welcome.structured_outputs_unavailable,
    )


def launch_to_proto(launch: Launch) -> worker_pb2.Launch:
    return worker_pb2.Launch(
        step_id=launch.step_id,
        released_slots=launch.released_slots,
        new_requests=[new_request_to_proto(r) for r in launch.new_requests],
        row_req_slots=pack(U32, launch.row_req_slots),
        row_start_pos=pack(U32, launch.row_start_pos),
        row_num_tokens=pack(U32, launch.row_num_tokens),
        row_from_future=pack(U8, launch.row_from_future),
        row_sample=pack(U8, launch.row_sample),
        prompt_ids=pack(U32, launch.prompt_ids),
        kv_slots=pack(U32, launch.kv_slots),
        row_score=pack(I32, launch.row_score),
        score_top_n=launch.score_top_n,
    )


def launch_from_proto(msg: worker_pb2.Launch) -> Launch:
    """ValueError naming the field for a column that is not a whole array."""
    return Launch(
        step_id=msg.step_id,
        released_slots=list(msg.released_slots),
        new_requests=[new_request_from_proto(r) for r in msg.new_requests],
        row_req_slots=unpack(U32, msg.row_req_slots, "row_req_slots"),
        row_start_pos=unpack(U32, msg.row_start_pos, "row_start_pos"),
        row_num_tokens=unpack(U32, msg.row_num_tokens, "row_num_tokens"),
        row_from_future=unpack_flags(msg.row_from_future, "row_from_future"),
        row_sample=unpack_flags(msg.row_sample, "row_sample"),
        prompt_ids=unpack(U32, msg.prompt_ids, "prompt_ids"),
        kv_slots=unpack(U32, msg.kv_slots, "kv_slots"),
        row_score=unpack(I32, msg.row_score, "row_score"),
        score_top_n=msg.score_top_n,
    )


def same_fields(source: object, names: tuple[str, ...]) -> dict[str, Any]:
    """The fields a dataclass and its message spell alike, read from either side: a wire form
    lists its scalar fields once, for both directions."""
    return {name: getattr(source, name) for name in names}


# LogitsProcessing's scalars, the same on the wire (the repeated and paired fields aside).
PROCESSING_FIELDS = (
    "prompt_len",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "min_tokens",
    "logprobs",
    "top_logprobs",
)


def new_request_to_proto(r: NewRequest) -> worker_pb2.NewRequest:
    msg = worker_pb2.NewRequest(
        req_slot=r.req_slot,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        seed=r.seed,
        prefix_kv_slots=r.prefix_kv_slots,
        min_p=r.min_p,
    )
    if r.grammar is not None:
        c = r.grammar.constraint
        msg.grammar.CopyFrom(
            worker_pb2.GrammarConstraint(kind=c.kind, text=c.text, replay_ids=r.grammar.replay_ids)
        )
    p = r.processing
    if p is not None:
        msg.processing.CopyFrom(
            worker_pb2.LogitsProcessing(
                **same_fields(p, PROCESSING_FIELDS),
                stop_ids=p.stop_ids,
                bias_ids=[token for token, _ in p.logit_bias],
                bias_values=[bias for _, bias in p.logit_bias],
            )
        )
    return msg


def new_request_from_proto(msg: worker_pb2.NewRequest) -> NewRequest:
    processing = None
    if msg.HasField("processing"):
        p = msg.processing
        processing = LogitsProcessing(
            **same_fields(p, PROCESSING_FIELDS),
            stop_ids=tuple(p.stop_ids),
            logit_bias=tuple(zip(p.bias_ids, p.bias_values, strict=True)),
        )
    prefix = tuple(msg.prefix_kv_slots)
    grammar = None
    if msg.HasField("grammar"):
        g = msg.grammar
        # NOTE: the kind is checked with the rest of the launch (worker_svc/launch_check.py).
        grammar = GrammarConstraint(Constraint(cast(ConstraintKind, g.kind), g.text), tuple(g.replay_ids))
    return NewRequest(
        msg.req_slot, msg.temperature, msg.top_p, msg.top_k, msg.seed, processing, prefix, grammar, msg.min_p
    )


def constraint_of(kind: str, text: str) -> Constraint:
    """A constraint read off the wire; ValueError for a kind it does not know."""
    if kind not in WIRE_CONSTRAINT_KINDS:
        raise ValueError(f"constraint kind {kind!r}: one of {', '.join(WIRE_CONSTRAINT_KINDS)}")
    return Constraint(kind, text)


def speculative_to_proto(config: SpeculativeConfig) -> worker_pb2.SpeculativeConfig:
    return worker_pb2.SpeculativeConfig(
        method=config.method,
        num_speculative_tokens=config.num_speculative_tokens,
        prompt_lookup_min=config.prompt_lookup_min,
        prompt_lookup_max=config.prompt_lookup_max,
    )


def speculative_from_hello(hello: worker_pb2.Hello) -> SpeculativeConfig | None:
    """The session's speculative decoding (None: none); ValueError naming the field."""
    if not hello.HasField("speculative"):
        return None
    m = hello.speculative
    try:
        return SpeculativeConfig(m.num_speculative_tokens, m.prompt_lookup_min, m.prompt_lookup_max, m.method)
    except ValueError as exc:
        raise ValueError(f"hello.speculative.{exc}") from None


def result_to_proto(result: StepResult) -> worker_pb2.StepResult:
    msg = worker_pb2.StepResult(
        step_id=result.step_id,
        token_ids=pack(U32, result.token_ids),
        forward_start_unix_s=result.forward_start,
        forward_end_unix_s=result.forward_end,
        epoch=result.epoch,
        held_s=result.held_s,
        grammar_finished=result.grammar_finished,
        token_counts=result.token_counts,
        drafts_found=result.drafts_found,
    )
    if result.logprobs is not None:
        msg.top_n = _put_logprobs(result.logprobs, msg.logprobs, msg.top_ids, msg.top_logprobs)
    if (scores := result.prompt_logprobs) is not None:
        msg.prompt_top_n = _put_logprobs(
            scores, msg.prompt_logprobs, msg.prompt_top_ids, msg.prompt_top_logprobs
        )
    return msg


def _put_logprobs(
    lp: StepLogprobs,
    chosen: MutableSequence[float],
    top_ids: MutableSequence[int],
    top: MutableSequence[float],
) -> int:
    """`lp` into a result's three repeated fields (sampled rows' or scored positions'); its top_n."""
    chosen.extend(lp.chosen)
    top_ids.extend(lp.top_ids)
    top.extend(lp.top_logprobs)
    return lp.top_n


def _logprobs_of(
    chosen: Sequence[float], top_n: int, top_ids: Sequence[int], top: Sequence[float]
) -> StepLogprobs | None:
    return StepLogprobs(list(chosen), top_n, list(top_ids), list(top)) if chosen else None


def result_from_proto(msg: worker_pb2.StepResult, link_rtt_s: float | None = None) -> StepResult:
    logprobs = _logprobs_of(msg.logprobs, msg.top_n, msg.top_ids, msg.top_logprobs)
    scores = _logprobs_of(msg.prompt_logprobs, msg.prompt_top_n, msg.prompt_top_ids, msg.prompt_top_logprobs)
    ids = unpack(U32, msg.token_ids, "token_ids")
    start, end = msg.forward_start_unix_s, msg.forward_end_unix_s
    finished = tuple(msg.grammar_finished)
    return StepResult(
        msg.step_id,
        ids,
        start,
        end,
        msg.epoch,
        logprobs,
        msg.held_s,
        grammar_finished=finished,
        link_rtt_s=link_rtt_s,
        token_counts=tuple(msg.token_counts),
        drafts_found=tuple(msg.drafts_found),
        prompt_logprobs=scores,
    )
