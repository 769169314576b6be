"""The client-facing half of the scheduler: validation, tokenization, incremental
detokenization, stop strings, client streams.

A frontend runs in its own process (`--frontends N`) or inside the core's (`--frontends 0`).
It reaches the core through a `CoreClient` and is reached by it as a `FrontendLink`
(`send` per step, `worker_state` on every session change). A stop string found here
ends the request for the client at once and aborts it in the core; tokens the core
generated after it are dropped here, never streamed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import itertools
import logging
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from scheduler_svc.contract import (
    DEFAULT_MODE,
    CoreClient,
    CoreRequestSpec,
    FinishReason,
    Mode,
    SamplingParams,
    StepOutputs,
    TokenLogprob,
)
from scheduler_svc.frontend.chat import ChatTemplate, ChatTemplateError
from scheduler_svc.frontend.pacing import StreamPacer
from scheduler_svc.frontend.reasoning import ReasoningSplit, thinks
from scheduler_svc.frontend.streams import ClientRequest, Completions, OutputStream
from scheduler_svc.frontend.telemetry import FrontendTelemetry
from scheduler_svc.frontend.text import RequestText
from scheduler_svc.frontend.tokenizer import Tokenizer, load_tokenizer
from scheduler_svc.frontend.tools import CallFormat, CallStream
from scheduler_svc.frontend.validation import (
    InvalidRequest,
    NoChatTemplate,
    RequestLimits,
    ValidRequest,
    needs_compiling,
    prompt_ids,
    validate_request,
)
from stepahead.protocol import WorkerInfo
from stepahead.v1 import generation_pb2

log = logging.getLogger("stepahead.frontend")

# Requests this large (serialized) are checked and tokenized on a thread: ~10 ms of a fast
# tokenizer's time; smaller ones cost less than the hop to the thread and back (unless their
# constraint needs compiling).
OFF_LOOP_INPUT_BYTES = 16 << 10
TOKENIZER_THREADS = 2  # large inputs tokenized at once; more wait their turn


@dataclass(frozen=True)
class FrontendConfig:
    mode: Mode = DEFAULT_MODE  # the core's, for the metrics' label
    limits: RequestLimits = field(default_factory=RequestLimits)
    stream_interval: int = 1  # wake a client's stream every N tokens (and at its finish)
    index: int = 0  # which frontend process (0 for the one inside the core)
    chat_template: str | None = None  # overrides the model's own (--chat-template)


class ApiError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.field = field  # the offending request field, for INVALID_ARGUMENT


NO_WORKER = "no worker is connected (starting, or lost and reconnecting); retry later"


_SEEDS = random.Random(random.SystemRandom().getrandbits(128))  # this process's own stream


def random_seed() -> int:
    """An unseeded request's seed: drawn from a generator seeded once from the OS (a system
    call per request cost more than the rest of its admission)."""
    return _SEEDS.getrandbits(63)


UINT64_MASK = (1 << 64) - 1


def completion_seed(seed: int, index: int) -> int:
    """Completion `index`'s seed: the request's own for the first (n = 1 and n > 1 agree on
    it), a 64-bit mix of (seed, index) for the others."""
    if index == 0:
        return seed
    x = (seed ^ (index * 0x9E3779B97F4A7C15)) & UINT64_MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & UINT64_MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & UINT64_MASK
    return x ^ (x >> 31)


def _cheap(request: generation_pb2.GenerateRequest) -> bool:
    """Whether checking `request` costs less than the hop to a thread and back."""
    return request.ByteSize() < OFF_LOOP_INPUT_BYTES and not needs_compiling(request)


class Frontend:
    def __init__(self, config: FrontendConfig, telemetry: FrontendTelemetry | None = None) -> None:
        self.config = config
        self.telemetry = telemetry or FrontendTelemetry(config.mode)
        self.core: CoreClient | None = None  # set by whoever links this frontend to a core
        self.clients: dict[int, ClientRequest] = {}
        self._by_rid: dict[str, Completions] = {}
        self._handles = itertools.count(1)
        self.info: WorkerInfo | None = None
        self.tokenizer: Tokenizer | None = None
        self.chat: ChatTemplate | None = None
        self.connected = False
        self.on_ready: Callable[[bool], None] = lambda ready: None
        self._tokenizer_threads: concurrent.futures.ThreadPoolExecutor | None = None  # made on first use
        self.pacer = StreamPacer(self.telemetry.held_steps.inc)
        self._due: list[OutputStream] = []  # streams with tokens due, in this step

    @property
    def name(self) -> str:
        return str(self.config.index)

    @property
    def ready(self) -> bool:
        return self.connected and self.tokenizer is not None

    # ---- requests from clients -----------------------------------------------------------

    async def admit(
        self,
        request: generation_pb2.GenerateRequest,
        open_ended: bool = False,
        check: Callable[[ValidRequest], None] | None = None,
        ready: asyncio.Event | None = None,
        capped: bool = False,
    ) -> Completions:
        """Validate and tokenize, then hand the request's completions to the core; raises
        ApiError. With `open_ended`, max_new_tokens 0 asks for the rest of the context (the HTTP
        API's default); with `capped`, max_new_tokens is at most the rest. `check`, the caller's
        own, may refuse the valid request before it is submitted (it raises). A large input is
        tokenized (the tokenizer lets go of the GIL), and a constraint not in the cache compiled,
        on a thread, so that the streams this frontend serves keep flowing meanwhile."""
        while True:
            info, tokenizer, chat = self.info, self.tokenizer, self.chat
            if info is None or tokenizer is None:
                raise ApiError(grpc.StatusCode.UNAVAILABLE, NO_WORKER)
            limits = self.config.limits
            validate = functools.partial(
                validate_request, request, tokenizer, info, random_seed(), limits, chat, open_ended, capped
            )
            try:
                if _cheap(request):
                    valid = validate()
                else:
                    valid = await asyncio.get_running_loop().run_in_executor(self._tokenizing(), validate)
            except InvalidRequest as exc:
                raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, str(exc), exc.field) from exc
            except NoChatTemplate as exc:
                raise ApiError(grpc.StatusCode.FAILED_PRECONDITION, str(exc), "input.messages") from exc
            self.telemetry.compiled(valid.compiled)
            if self.info is info:  # else the worker changed meanwhile: check against the new one
                if check is not None:
                    check(valid)
                rid = request.request_id or uuid.uuid4().hex
                completions = self.submit(
                    rid, valid.prompt_ids, valid.params, valid.n, valid.calls, ready, valid.reasoning
                )
                self.telemetry.admitted(valid.params)
                return completions

    def _tokenizing(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._tokenizer_threads is None:
            self._tokenizer_threads = concurrent.futures.ThreadPoolExecutor(
                TOKENIZER_THREADS, thread_name_prefix="tokenize"
            )
        return self._tokenizer_threads

    def submit(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        n: int = 1,
        calls: CallFormat | None = None,
        ready: asyncio.Event | None = None,
        reasoning: bool | None = None,
    ) -> Completions:
        """A validated request: `n` completions, fanned out into one core request each (with
        seeds of their own); the core may still refuse one (the call then fails). With `calls`,
        each completion's text is parsed for tool calls in that format; `ready`: the event its
        reader waits on, when several requests are read as one (an HTTP list of prompts);
        `reasoning` (None: not split): each completion's thinking is split from its text, the
        reply starting inside it if True (`scheduler_svc/frontend/reasoning.py`)."""
        if rid in self._by_rid:
            raise ApiError(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {rid!r} is already live")
        completions = Completions(rid, prompt_ids, ready or asyncio.Event())
        self._by_rid[rid] = completions
        for index in range(n):
            seeded = dataclasses.replace(params, seed=completion_seed(params.seed, index))
            completions.clients.append(self._submit_one(completions, index, seeded, calls, reasoning))
        return completions

    def _submit_one(
        self,
        completions: Completions,
        index: int,
        params: SamplingParams,
        calls: CallFormat | None,
        reasoning: bool | None,
    ) -> ClientRequest:
        assert self.core is not None and self.tokenizer is not None
        rid, prompt_ids = completions.rid, completions.prompt_ids
        stream = OutputStream(self.config.stream_interval, completions.ready)
        text = RequestText(self.tokenizer, params.stop, params.skip_special_tokens, params.include_stop_str)
        client = ClientRequest(next(self._handles), rid, prompt_ids, params, text, stream, index)
        client.calls = None if calls is None else CallStream(calls)
        client.reasoning = None if reasoning is None else ReasoningSplit(reasoning)
        if client.calls is None and client.reasoning is None and not text.has_stops:
            stream.decode_later(text.push_ids)
        self.clients[client.handle] = client
        self.pacer.watch()
        self.core.add(CoreRequestSpec(client.handle, rid, prompt_ids, params, client.arrival_time, index))
        return client

    def cancel(self, completions: Completions) -> None:
        """The client went away (cancelled, disconnected, past its deadline), or one of its
        completions failed: the others end too."""
        for client in completions.clients:
            if not client.finished:
                self._end(client, FinishReason.ABORT)
                self._abort_in_core(client)
        self._forget_call(completions)

    def tokenize(self, request: generation_pb2.GenerateRequest) -> list[int]:
        """The prompt ids `request`'s input gives, as `admit` would make them; raises ApiError."""
        info, tokenizer = self.info, self.tokenizer
        if info is None or tokenizer is None:
            raise ApiError(grpc.StatusCode.UNAVAILABLE, NO_WORKER)
        try:
            return prompt_ids(request, tokenizer, info, self.config.limits, self.chat)
        except InvalidRequest as exc:
            raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, str(exc), exc.field) from exc
        except NoChatTemplate as exc:
            raise ApiError(grpc.StatusCode.FAILED_PRECONDITION, str(exc), "input.messages") from exc

    async def abort(self, rid: str) -> bool:
        completions = self._by_rid.get(rid)
        if completions is None:
            assert self.core is not None
            return await self.core.abort_request(rid)
        self.cancel(completions)
        return True

    # ---- from the core ---------------------------------------------------------------------

    def worker_state(self, info: WorkerInfo | None, connected: bool) -> None:
        if info is not None and info != self.info:
            self._load_tokenizer(info)
        self.connected = connected
        self.on_ready(self.ready)

    def _load_tokenizer(self, info: WorkerInfo) -> None:
        spec = info.tokenizer
        try:
            self.tokenizer = load_tokenizer(
                spec.kind, spec.hf_json, info.vocab_size, info.bos_token_id, info.eos_token_ids
            )
            self.info = info
        except Exception:
            log.exception("cannot load the tokenizer of worker session %d; not serving", info.epoch)
            self.info, self.tokenizer = None, None
            return
        self.chat = self._chat_template(self.tokenizer, self.config.chat_template or spec.chat_template)

    def _chat_template(self, tokenizer: Tokenizer, source: str) -> ChatTemplate | None:
        if not source:
            return None
        try:
            return ChatTemplate(source, tokenizer.special_tokens(), thinks(source, tokenizer))
        except ChatTemplateError:
            log.exception("the chat template does not compile; serving without chat")
            return None

    def send(self, outputs: StepOutputs) -> None:
        """One step's rows of this frontend's requests."""
        now = time.time()
        clients = self.clients
        streamed = 0
        for entry, cached in zip(outputs.cached_entries, outputs.cached_tokens, strict=True):
            if (client := clients.get(outputs.handles[entry])) is not None:
                client.cached_tokens = cached
        for entry, prompt in zip(outputs.prompt_entries, outputs.prompt_logprobs, strict=True):
            if (client := clients.get(outputs.handles[entry])) is not None:
                client.stream.put_prompt_logprobs(prompt)
        logprobs = outputs.entry_logprobs() if outputs.logprobs else None
        ttft, itl, due = self.telemetry.ttft, self.telemetry.itl, self._due
        # The rows whose last token came in one message share its time: their gaps are observed
        # as one value, a run of rows at a time.
        run_last, run_length = 0.0, 0
        for i, (handle, token, finish) in enumerate(
            zip(outputs.handles, outputs.token_ids, outputs.finish_reasons, strict=True)
        ):
            client = clients.get(handle)
            if client is None:  # ended here already: a stop string, or the client left
                continue
            if token < 0:
                if finish:
                    self._end(client, FinishReason(finish))
                continue
            streamed += 1
            stream = client.stream
            logprob = None if logprobs is None else logprobs[i]
            if finish or not stream.decodes_later:
                self._on_token(client, token, FinishReason(finish) if finish else None, now, logprob)
                continue
            # The common token: no finish, its text made when its message is taken.
            last = client.last_token_time
            if last is None:
                ttft.observe(now - client.arrival_time)
            elif last == run_last:
                run_length += 1
            else:
                if run_length:
                    itl.observe_many(now - run_last, run_length)
                run_last, run_length = last, 1
            client.last_token_time = now
            client.num_generated += 1
            if stream.put_id(token, logprob):
                if client.num_generated == 1:
                    stream.ready.set()  # a first token is never held
                else:
                    due.append(stream)
        if run_length:
            itl.observe_many(now - run_last, run_length)
        for handle, code, message in outputs.errors:
            client = clients.get(handle)
            if client is not None:
                self._fail(client, grpc.StatusCode[code], message)
        if streamed:
            self.telemetry.generation_tokens.inc(streamed)
        due, self._due = self._due, []
        self.pacer.release(due)

    def fail_all(self, code: grpc.StatusCode, message: str) -> None:
        for client in list(self.clients.values()):
            self._fail(client, code, message)

    def _on_token(
        self,
        client: ClientRequest,
        token: int,
        finish: FinishReason | None,
        now: float,
        logprob: TokenLogprob | None = None,
    ) -> None:
        self._note_token_time(client, now)
        client.num_generated += 1
        client.stream.catch_up()
        if finish == FinishReason.STOP and self._stop_token(client, token):
            # EOS or a stop token: kept in token_ids, not in text. (A grammar's last token,
            # which also ends its request with STOP, is text.)
            client.stream.put(token, "", logprob)
            self._end(client, finish, None if self._eos(client, token) else token)
            return
        match_stops = client.params.stop_finishes(client.num_generated - 1)
        text, stopped = client.text.push(token, match_stops)
        if client.stream.put(token, self._content(client, text, token=True), logprob):
            if client.num_generated == 1:
                client.stream.ready.set()  # a first token is never held
            else:
                self._due.append(client.stream)
        if stopped:
            self._end(client, FinishReason.STOP, client.text.stop_string)
            if finish is None:
                self._abort_in_core(client)
        elif finish is not None:
            self._end(client, finish)

    def _stop_token(self, client: ClientRequest, token: int) -> bool:
        return token in client.params.stop_token_ids or self._eos(client, token)

    def _eos(self, client: ClientRequest, token: int) -> bool:
        """Whether `token` ends `client`'s text as an end of sequence (not with ignore_eos)."""
        eos = self.info.eos_token_ids if self.info is not None else ()
        return not client.params.ignore_eos and token in eos

    def _note_token_time(self, client: ClientRequest, now: float) -> None:
        t = self.telemetry
        if client.last_token_time is None:
            t.ttft.observe(now - client.arrival_time)
        else:
            t.itl.observe(now - client.last_token_time)
        client.last_token_time = now

    # ---- endings ---------------------------------------------------------------------------

    def _content(self, client: ClientRequest, text: str, token: bool = False) -> str:
        """Of a completion's new text (with `token`: a token's), what is content; its reasoning
        and its calls' pieces go to the stream. A token is the thinking's while the reply is
        inside its reasoning before or after it (the tags' tokens count)."""
        split = client.reasoning
        if split is not None:
            before = split.thinking
            thought, text = split.push(text)
            client.stream.put_reasoning(thought)
            client.stream.reasoning_tokens += token and (before or split.thinking)
        return self._calls_of(client, text)

    def _calls_of(self, client: ClientRequest, text: str) -> str:
        """Of a completion's content, what is not its calls' (whose pieces go to the stream)."""
        if client.calls is None:
            return text
        content, deltas = client.calls.push(text)
        client.stream.put_calls(deltas)
        return content

    def _end(self, client: ClientRequest, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        client.stream.catch_up()  # the text of tokens put before, ahead of what the finish flushes
        if not (reason == FinishReason.STOP and client.text.stopped):
            client.stream.put_text(self._content(client, client.text.finish()))
        if client.reasoning is not None:
            thought, rest = client.reasoning.finish()
            client.stream.put_reasoning(thought)
            client.stream.put_text(self._calls_of(client, rest))
        if client.calls is not None:
            client.stream.put_text(client.calls.finish())
            if reason == FinishReason.STOP and client.calls.complete:
                reason = FinishReason.TOOL_CALLS  # its calls are whole: the reply ended after them
        client.finish_reason = reason
        self._forget(client)
        client.stream.close(reason, stop_reason if reason == FinishReason.STOP else None)
        self.telemetry.finished[reason.name.lower()].inc()
        self.telemetry.e2e.observe(time.time() - client.arrival_time)

    def _fail(self, client: ClientRequest, code: grpc.StatusCode, message: str) -> None:
        self._forget(client)
        client.stream.fail(code, message)
        self.telemetry.finished["error"].inc()

    def _forget(self, client: ClientRequest) -> None:
        self.clients.pop(client.handle, None)
        if not self.clients:
            self.pacer.stop()
        completions = self._by_rid.get(client.rid)
        if completions is not None and client in completions.clients and completions.finished:
            self._forget_call(completions)

    def _forget_call(self, completions: Completions) -> None:
        if self._by_rid.get(completions.rid) is completions:
            del self._by_rid[completions.rid]

    def _abort_in_core(self, client: ClientRequest) -> None:
        assert self.core is not None
        self.core.abort(client.handle)
