"""What computes a batch's next tokens: a Llama model, or the `sim` device."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from stepahead.protocol import TokenizerSpec
from worker_svc.batch import ForwardBatch
from worker_svc.gguf import SMOLLM2_NAME, gguf_config, load_gguf, smollm2_path
from worker_svc.logits_processors import RowProcessing, Sampled, TokenLogprobs, process_logits, token_logprobs
from worker_svc.model import (
    TINY_CONFIG,
    KVCache,
    LlamaForCausalLM,
    ModelConfig,
    build_tiny,
    config_from_hf_dict,
    load_hf_checkpoint,
    store_weights_input_major,
)
from worker_svc.ranks import TensorParallelRanks
from worker_svc.sampler import sample
from worker_svc.streams import DeviceStreams, SimDevice, SimStreams, make_streams
from worker_svc.tensor_parallel import check_divisible, shard_model

BYTE_TOKENIZER = TokenizerSpec("byte")


@dataclass(frozen=True)
class RowSampling:
    """Sampling inputs of each sampling row, gathered from the slot table."""

    temperature: torch.Tensor  # [R] float32
    top_p: torch.Tensor  # [R] float32
    top_k: torch.Tensor  # [R] int64
    seeds: torch.Tensor  # [R] int64
    positions: torch.Tensor  # [R] int64, position of the token being sampled
    # Known on the host, so the sampler needs no device read to choose its path.
    all_greedy: bool
    any_filter: bool
    processing: RowProcessing | None = None  # None: the model's logits are sampled as they are
    top_logprobs: int | None = None  # None: no log-probabilities; else that many alternatives a row


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

    def compute(self, batch: ForwardBatch, sampling: RowSampling) -> Sampled:
        """Sampled ids [R] of the batch's sampling rows, on the device, with their
        log-probabilities when `sampling.top_logprobs` is set."""
        ...


def sample_rows(logits: torch.Tensor, sampling: RowSampling) -> Sampled:
    """Draws from the processed logits [R, V]; log-probabilities from the raw ones."""
    processed = logits if sampling.processing is None else process_logits(logits, sampling.processing)
    ids = sample(
        processed,
        sampling.temperature,
        sampling.top_p,
        sampling.top_k,
        sampling.seeds,
        sampling.positions,
        all_greedy=sampling.all_greedy,
        any_filter=sampling.any_filter,
    )
    if sampling.top_logprobs is None:
        return Sampled(ids)
    return Sampled(ids, token_logprobs(logits, ids, sampling.top_logprobs))


class LlamaBackend:
    def __init__(self, model: LlamaForCausalLM, tokenizer: TokenizerSpec) -> None:
        config = model.config
        weight = model.lm_head.weight
        if weight.device.type == "cpu" and weight.dtype == torch.float32:
            store_weights_input_major(model)
        self.model = model
        self.name = config.name
        self.vocab_size = config.vocab_size
        self.max_context_len = config.max_context_len
        self.eos_token_ids = config.eos_token_ids
        self.bos_token_id = config.bos_token_id
        self.tokenizer = tokenizer
        self.kv_bytes_per_slot = 2 * config.num_layers * config.kv_size * weight.element_size()
        self._kv: KVCache | None = None

    def make_streams(self, device: torch.device) -> DeviceStreams:
        return make_streams(device)

    def allocate_kv(self, num_slots: int) -> None:
        weight = self.model.lm_head.weight
        self._kv = KVCache.allocate(self.model.config, num_slots, weight.dtype, weight.device)

    def compute(self, batch: ForwardBatch, sampling: RowSampling) -> Sampled:
        assert self._kv is not None, "allocate_kv() first"
        return sample_rows(self.model(batch, self._kv), sampling)


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

    It has no logits: penalties, logit_bias and min_tokens are ignored, but
    log-probabilities come back when asked (`sim_logprobs`), of the shape a model's
    have, so that benchmarks carry them end to end."""

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

    def compute(self, batch: ForwardBatch, sampling: RowSampling) -> Sampled:
        self._device.run(self._step_s + self._token_s * batch.num_tokens)
        last = batch.input_ids[batch.sample_token_index]
        h = _mix32(last * 65536 + sampling.positions)
        printable = 32 + h % 95
        ids = torch.where(h % SIM_EOS_EVERY == 0, self.eos_token_ids[0], printable)
        if sampling.top_logprobs is None:
            return Sampled(ids)
        return Sampled(ids, sim_logprobs(ids, sampling.top_logprobs, self.vocab_size))


def load_backend(
    model: str,
    device: torch.device,
    dtype: torch.dtype,
    sim_step_ms: float,
    sim_token_us: float,
    ranks: TensorParallelRanks | None = None,
) -> ModelBackend:
    """`tiny`, `sim`, `smollm2`, a `.gguf` file, or a Hugging Face Llama-style checkpoint
    directory; with `ranks`, this rank's shard of it (loaded on the CPU, then sliced)."""
    if model == "sim":
        if ranks is not None:
            raise ValueError("--tp: the sim device has no weights to shard (run it with --tp 1)")
        return SimBackend(sim_step_ms, sim_token_us)
    load_on = device if ranks is None else torch.device("cpu")
    llama, tokenizer = _load_llama(model, load_on, dtype)
    if ranks is not None:
        llama = shard_model(llama, ranks.place.rank, ranks.size, ranks.all_reduce).to(device)
    return LlamaBackend(llama, tokenizer)


def check_shardable(model: str, size: int) -> None:
    """ValueError, before any rank starts, where `model` cannot run over `size` ranks: the sim
    device, or head counts that do not divide. Reads the model's config only, not its weights."""
    if model == "sim":
        raise ValueError("--tp: the sim device has no weights to shard (run it with --tp 1)")
    check_divisible(model_config(model), size)


def model_config(model: str) -> ModelConfig:
    """The config of `tiny`, `smollm2`, a `.gguf` file or a checkpoint directory, weights unread."""
    if model == "tiny":
        return TINY_CONFIG
    path = smollm2_path() if model == SMOLLM2_NAME else Path(model)
    if path.suffix == ".gguf" and path.is_file():
        return gguf_config(path, SMOLLM2_NAME if model == SMOLLM2_NAME else path.stem)
    if not (path / "config.json").is_file():
        raise ValueError(
            f"--model: {model!r} is not tiny, sim, {SMOLLM2_NAME}, a .gguf file or a checkpoint directory"
        )
    return config_from_hf_dict(json.loads((path / "config.json").read_text()), name=path.name)


def _load_llama(
    model: str, device: torch.device, dtype: torch.dtype
) -> tuple[LlamaForCausalLM, TokenizerSpec]:
    if model == "tiny":
        return build_tiny(dtype, device), BYTE_TOKENIZER
    if model == SMOLLM2_NAME:
        return _load_gguf(smollm2_path(), dtype, device, SMOLLM2_NAME)
    path = Path(model)
    if path.suffix == ".gguf" and path.is_file():
        return _load_gguf(path, dtype, device, path.stem)
    if not path.is_dir():
        raise ValueError(
            f"--model: {model!r} is not tiny, sim, {SMOLLM2_NAME}, a .gguf file or a checkpoint directory"
        )
    llama = load_hf_checkpoint(path, dtype, device)
    return llama, _checkpoint_tokenizer(path, llama.config.vocab_size)


def _load_gguf(
    path: Path, dtype: torch.dtype, device: torch.device, name: str
) -> tuple[LlamaForCausalLM, TokenizerSpec]:
    loaded = load_gguf(path, dtype, device, name)
    return loaded.model, TokenizerSpec("hf", loaded.tokenizer_json, loaded.chat_template or "")


def checkpoint_chat_template(path: Path) -> str:
    """A checkpoint's chat template: chat_template.jinja, else tokenizer_config.json's."""
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    config = path / "tokenizer_config.json"
    template = json.loads(config.read_text()).get("chat_template") if config.is_file() else None
    return template if isinstance(template, str) else ""


def _checkpoint_tokenizer(path: Path, vocab_size: int) -> TokenizerSpec:
    tokenizer_json = path / "tokenizer.json"
    if tokenizer_json.is_file():
        return TokenizerSpec("hf", tokenizer_json.read_bytes(), checkpoint_chat_template(path))
    if vocab_size < 256:
        raise ValueError(f"{path}: no tokenizer.json and a vocabulary too small for bytes")
    return BYTE_TOKENIZER
