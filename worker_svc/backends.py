"""What computes a batch's next tokens: a Llama model, or the `sim` device."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from stepahead.protocol import TokenizerSpec
from worker_svc.device_streams import DeviceStreams, SimDevice, SimStreams, make_streams
from worker_svc.forward_batch import ForwardBatch
from worker_svc.grammar import allowed, apply_bitmask
from worker_svc.layers import KVCache
from worker_svc.loading import BYTE_TOKENIZER, TINY_CONFIG, load_llama_with_blocks
from worker_svc.logits_processors import RowProcessing, Sampled, TokenLogprobs, process_logits, token_logprobs
from worker_svc.model import LlamaForCausalLM, prepare_for_serving
from worker_svc.quantization import Int4Blocks
from worker_svc.ranks import TensorParallelRanks
from worker_svc.sampler import sample
from worker_svc.tensor_parallel import shard_model


@dataclass(frozen=True)
class RowSampling:
    """Sampling inputs of each sampling row, gathered from the slot table."""

    temperature: torch.Tensor  # [R] float32
    top_p: torch.Tensor  # [R] float32
    top_k: torch.Tensor  # [R] int64
    min_p: torch.Tensor  # [R] float32
    seeds: torch.Tensor  # [R] int64
    positions: torch.Tensor  # [R] int64, position of the token being sampled
    # Known on the host, so the sampler needs no device read to choose its path.
    all_greedy: bool
    any_filter: bool
    processing: RowProcessing | None = None  # None: the model's logits are sampled as they are
    top_logprobs: int | None = None  # None: no log-probabilities; else that many alternatives a row
    # Per row, on the host (for a subset's `all_greedy` / `any_filter`); empty: not known.
    row_greedy: tuple[bool, ...] = ()
    row_filtered: tuple[bool, ...] = ()

    def subset(self, rows: list[int], index: torch.Tensor) -> RowSampling:
        """Rows `rows` (on the device: `index`) of these, for a draw of their own (their
        processing is in the logits already)."""
        greedy = tuple(self.row_greedy[i] for i in rows) if self.row_greedy else ()
        filtered = tuple(self.row_filtered[i] for i in rows) if self.row_filtered else ()
        return RowSampling(
            self.temperature.index_select(0, index),
            self.top_p.index_select(0, index),
            self.top_k.index_select(0, index),
            self.min_p.index_select(0, index),
            self.seeds.index_select(0, index),
            self.positions.index_select(0, index),
            all_greedy=all(greedy) if greedy else self.all_greedy,
            any_filter=any(filtered) if filtered else self.any_filter,
            row_greedy=greedy,
            row_filtered=filtered,
        )


class Draw(Protocol):
    """A step's next-token distributions, computed (on the device) and ready to draw from."""

    def sample(self) -> torch.Tensor:
        """[R] ids, one per sampling row, drawn with no grammar mask."""
        ...

    def sample_masked(self, rows: list[int], index: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        """[C] ids of sampling rows `rows` (on the device: `index`), each drawn among the tokens
        its row of `bitmask` [C, words] int32 allows, with its own parameters: the same draw as
        `sample` would make over those tokens alone."""
        ...

    def logprobs(self, ids: torch.Tensor) -> TokenLogprobs | None:
        """Of the drawn `ids` [R], when the rows asked for them."""
        ...

    def scores(self, targets: torch.Tensor, top_n: int) -> TokenLogprobs:
        """The scored prompt positions' (`ForwardBatch.score_token_index`): the log-probability
        of `targets` [S], each the prompt token after its position, and `top_n` alternatives."""
        ...


class ModelBackend(Protocol):
    name: str
    vocab_size: int
    max_context_len: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    tokenizer: TokenizerSpec  # with the model's chat template, when its files have one
    kv_bytes_per_slot: int  # one token's K and V over all layers, as this rank holds them; 0: no KV

    def allocate_kv(self, num_slots: int) -> None: ...

    def make_streams(self, device: torch.device) -> DeviceStreams:
        """The forward and copy streams this backend runs on."""
        ...

    def compute(self, batch: ForwardBatch, sampling: RowSampling) -> Draw:
        """The batch's forward, queued on the device; its sampling rows' draws follow."""
        ...


def draw(logits: torch.Tensor, sampling: RowSampling) -> Sampled:
    """Every row drawn with no mask, with log-probabilities when asked (tests, references)."""
    rows = LogitsDraw(logits, sampling)
    ids = rows.sample()
    return Sampled(ids, rows.logprobs(ids))


SCORE_SLICE = 256  # scored prompt positions whose logits are made at once (`LogitsDraw.scores`)


class LogitsDraw:
    """Draws from the processed logits [R, V] (penalties and logit_bias applied, then a row's
    grammar mask, then temperature and top-k/top-p); log-probabilities from the raw ones."""

    def __init__(
        self,
        logits: torch.Tensor,
        sampling: RowSampling,
        scored: torch.Tensor | None = None,
        head: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """`logits`: the sampling rows' [R, V]; `scored`: the scored prompt positions' final
        hidden states [S, hidden], and `head` their float32 logits (the model's `head`)."""
        self._scored, self._head = scored, head
        self._logits = logits
        self._sampling = sampling
        self._processed = (
            logits if sampling.processing is None else process_logits(logits, sampling.processing)
        )

    def sample(self) -> torch.Tensor:
        return _sample(self._processed, self._sampling)

    def sample_masked(self, rows: list[int], index: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        logits = self._processed.index_select(0, index)
        apply_bitmask(logits, bitmask)
        processing = self._sampling.processing
        if processing is not None and processing.stop_mask is not None:
            # NOTE: min_tokens holds back stop ids; where the grammar allows nothing else, the
            # grammar wins: the row draws from its mask over the unprocessed logits (no device
            # read decides it), and the stop id it may draw is then an ordinary token.
            fallback = self._logits.index_select(0, index)
            apply_bitmask(fallback, bitmask)
            nothing_left = (logits == float("-inf")).all(dim=1, keepdim=True)
            logits = torch.where(nothing_left, fallback, logits)
        return _sample(logits, self._sampling.subset(rows, index))

    def logprobs(self, ids: torch.Tensor) -> TokenLogprobs | None:
        top = self._sampling.top_logprobs
        return None if top is None else token_logprobs(self._logits, ids, top)

    def scores(self, targets: torch.Tensor, top_n: int) -> TokenLogprobs:
        """SCORE_SLICE positions' logits at a time: a step's memory for them stays bounded."""
        assert self._scored is not None and self._head is not None, "no scored positions"
        head, hidden = self._head, self._scored
        parts = [
            token_logprobs(head(hidden[i : i + SCORE_SLICE]).float(), targets[i : i + SCORE_SLICE], top_n)
            for i in range(0, hidden.shape[0], SCORE_SLICE)
        ]
        return TokenLogprobs(
            torch.cat([p.chosen for p in parts]),
            torch.cat([p.top_ids for p in parts]),
            torch.cat([p.top_logprobs for p in parts]),
        )


def _sample(logits: torch.Tensor, s: RowSampling) -> torch.Tensor:
    return sample(
        logits,
        s.temperature,
        s.top_p,
        s.top_k,
        s.seeds,
        s.positions,
        all_greedy=s.all_greedy,
        any_filter=s.any_filter,
        min_p=s.min_p,
    )


class LlamaBackend:
    def __init__(
        self,
        model: LlamaForCausalLM,
        tokenizer: TokenizerSpec,
        quantization: str = "none",
        int4_blocks: Mapping[str, Int4Blocks] | None = None,
    ) -> None:
        """`model` as loaded (and sharded): it is laid out for serving here (`prepare_for_serving`)."""
        config = model.config
        prepare_for_serving(model, quantization, int4_blocks)
        self.model = model
        self.name = config.name
        self.vocab_size = config.vocab_size
        self.max_context_len = config.max_context_len
        self.eos_token_ids = config.eos_token_ids
        self.bos_token_id = config.bos_token_id
        self.tokenizer = tokenizer
        self.kv_bytes_per_slot = 2 * config.num_layers * config.kv_size * model.dtype.itemsize
        self._kv: KVCache | None = None

    def make_streams(self, device: torch.device) -> DeviceStreams:
        return make_streams(device)

    def allocate_kv(self, num_slots: int) -> None:
        self._kv = KVCache.allocate(self.model.config, num_slots, self.model.dtype, self.model.device)

    def compute(self, batch: ForwardBatch, sampling: RowSampling) -> Draw:
        assert self._kv is not None, "allocate_kv() first"
        if batch.score_token_index is None:
            return LogitsDraw(self.model(batch, self._kv), sampling)
        logits, scored = self.model.logits_and_scored(batch, self._kv)
        return LogitsDraw(logits, sampling, scored, self.model.head)


SIM_EOS_EVERY = 61  # the sim emits EOS for about one token in 61


def _mix32(x: torch.Tensor) -> torch.Tensor:
    mask = 0xFFFFFFFF
    x = ((x >> 16) ^ x) * 0x45D9F3B & mask
    x = ((x >> 16) ^ x) * 0x45D9F3B & mask
    return (x >> 16) ^ x


def sim_next_token(last_token: int, position: int) -> int:
    """The sim's next token, as plain Python: the reference the tests check against."""
    h = int(_mix32(torch.tensor([last_token * 65536 + position]))[0])
    return TINY_CONFIG.eos_token_ids[0] if h % SIM_EOS_EVERY == 0 else 32 + h % 95


def sim_continuation(prompt: Sequence[int], n: int) -> list[int]:
    """The n tokens the sim produces after `prompt`, ignoring stops: the tests' reference."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(sim_next_token(seq[-1], len(seq)))
    return seq[len(prompt) :]


SIM_UNLIKELY_LOGPROB = -9999.0  # the sim's alternatives to its (certain) token


def sim_logprobs(ids: torch.Tensor, top_n: int, vocab: int) -> TokenLogprobs:
    """The sim's log-probabilities: its token is certain (0.0, listed first), the next ids
    after it are the alternatives, at SIM_UNLIKELY_LOGPROB."""
    offsets = torch.arange(top_n, device=ids.device)
    top = torch.full((ids.shape[0], top_n), SIM_UNLIKELY_LOGPROB, device=ids.device)
    top[:, :1].zero_()
    chosen = torch.zeros(ids.shape[0], device=ids.device)
    return TokenLogprobs(chosen, (ids[:, None] + offsets) % vocab, top)


class SimBackend:
    """A device for scheduler benchmarks: a step takes `step_ms + token_us x tokens`
    on a simulated timeline (the CPU is free meanwhile, as with a GPU) and yields
    deterministic printable tokens (EOS about one in 61) that depend on each row's
    last input token and position, so the FutureMap relay is exercised.

    It has no logits: penalties, logit_bias and min_tokens are ignored, but grammar masks
    are honoured (`SimDraw`) and log-probabilities come back when asked (`sim_logprobs`), of
    the shape a model's have, so that benchmarks carry them end to end."""

    def __init__(self, step_ms: float, token_us: float) -> None:
        self.name = "sim"
        self.vocab_size = TINY_CONFIG.vocab_size
        self.max_context_len = 8192
        self.eos_token_ids = TINY_CONFIG.eos_token_ids
        self.bos_token_id = TINY_CONFIG.bos_token_id
        self.tokenizer = BYTE_TOKENIZER
        self.kv_bytes_per_slot = 0
        self._step_s = step_ms / 1e3
        self._token_s = token_us / 1e6
        self._device = SimDevice()

    def make_streams(self, device: torch.device) -> DeviceStreams:
        return SimStreams(self._device)

    def allocate_kv(self, num_slots: int) -> None:
        """The sim keeps no KV: only the scheduler's slot accounting matters."""

    def compute(self, batch: ForwardBatch, sampling: RowSampling) -> Draw:
        self._device.run(self._step_s + self._token_s * batch.num_tokens)
        last = batch.input_ids[batch.sample_token_index]
        scored = None
        if batch.score_token_index is not None:  # what the sim would draw after each position
            index = batch.score_token_index
            scored = _mix32(batch.input_ids[index] * 65536 + batch.positions[index] + 1)
        h = _mix32(last * 65536 + sampling.positions)
        return SimDraw(h, sampling, self.eos_token_ids[0], self.vocab_size, scored)


class SimDraw:
    """The sim's tokens: a hash `h` of each row's last token and position picks a printable
    byte, or EOS when h % SIM_EOS_EVERY is 0. Under a grammar mask a row takes that token when
    the mask allows it, else the allowed id at h modulo the count of allowed ids."""

    def __init__(
        self,
        h: torch.Tensor,
        sampling: RowSampling,
        eos: int,
        vocab_size: int,
        scored: torch.Tensor | None = None,
    ) -> None:
        """`scored`: the hash of each scored prompt position, as `h` is each sampling row's."""
        self._h, self._sampling, self._eos, self._vocab = h, sampling, eos, vocab_size
        self._scored = h[:0] if scored is None else scored

    def sample(self) -> torch.Tensor:
        return self._token(self._h)

    def _token(self, h: torch.Tensor) -> torch.Tensor:
        return torch.where(h % SIM_EOS_EVERY == 0, self._eos, 32 + h % 95)

    def sample_masked(self, rows: list[int], index: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        ok = allowed(bitmask, self._vocab)
        free = self.sample().index_select(0, index)
        h = self._h.index_select(0, index)
        count = ok.sum(dim=1).clamp_(min=1)
        # The (h mod count)-th allowed id, 0-based: where the running count of allowed ids
        # first exceeds it.
        nth = (ok.cumsum(dim=1) > (h % count)[:, None]) & ok
        fallback = nth.int().argmax(dim=1)
        return torch.where(ok.gather(1, free[:, None])[:, 0], free, fallback)

    def logprobs(self, ids: torch.Tensor) -> TokenLogprobs | None:
        top = self._sampling.top_logprobs
        return None if top is None else sim_logprobs(ids, top, self._vocab)

    def scores(self, targets: torch.Tensor, top_n: int) -> TokenLogprobs:
        """The sim's own next token is certain: a target that is it scores 0.0, any other
        SIM_UNLIKELY_LOGPROB; the alternatives are `sim_logprobs`' of the sim's token."""
        own = self._token(self._scored)
        likely = sim_logprobs(own, top_n, self._vocab)
        chosen = torch.where(targets == own, 0.0, SIM_UNLIKELY_LOGPROB)
        return TokenLogprobs(chosen, likely.top_ids, likely.top_logprobs)


def load_backend(
    model: str,
    device: torch.device,
    dtype: torch.dtype,
    sim_step_ms: float,
    sim_token_us: float,
    ranks: TensorParallelRanks | None = None,
    tokenizer: Path | None = None,
    max_model_len: int | None = None,
    quantization: str = "none",
) -> ModelBackend:
    """`tiny`, `sim`, `smollm2`, a `.gguf` file, or a Hugging Face checkpoint directory of the
    Llama family; with `ranks`, this rank's shard of it (loaded on the CPU, then sliced);
    `tokenizer` instead of the model's own; `max_model_len`: the context served, at most the
    model's; `quantization`: its weights kept as `int8` or `int4` (a GGUF's 4-bit weights as
    stored), see worker_svc.quantization."""
    backend: ModelBackend
    if model == "sim":
        if ranks is not None:
            raise ValueError("--tp: the sim device has no weights to shard (run it with --tp 1)")
        backend = SimBackend(sim_step_ms, sim_token_us)
    else:
        load_on = device if ranks is None else torch.device("cpu")
        # NOTE: a model to be sharded is loaded whole, then sliced (--quantization serves one rank).
        quantized = quantization if ranks is None else "none"
        llama, spec, blocks = load_llama_with_blocks(model, load_on, dtype, tokenizer, quantized)
        if ranks is not None:
            llama = shard_model(llama, ranks.place.rank, ranks.size, ranks.all_reduce).to(device)
        backend = LlamaBackend(llama, spec, quantization, blocks)
    if max_model_len is not None:
        if max_model_len > backend.max_context_len:
            context = backend.max_context_len
            raise ValueError(f"--max-model-len {max_model_len}: above {backend.name}'s context, {context}")
        backend.max_context_len = max_model_len
    return backend
