"""The Llama model and its family (each member's features are ModelConfig's fields, read from
checkpoints by worker_svc.hf_config): its config, the decoder that runs a batch over the
token-slot KV pool, and filling its weights from named tensors (what every loader in
worker_svc.loading ends with)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from worker_svc.forward_batch import ForwardBatch
from worker_svc.layers import (
    AttentionPlan,
    Embedding,
    Int8Embedding,
    KVCache,
    Linear,
    LlamaDecoderLayer,
    RMSNorm,
    use_weight_side_products,
)
from worker_svc.quantization import Int4Blocks, TiedInt8Embedding, kernels_for, quantize_layer, quantize_model
from worker_svc.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from worker_svc.cpu_kernels import DecodeLayers

RopeScaling = tuple[tuple[str, float | int | str | tuple[float, ...]], ...]

# What each rope_scaling type must give (transformers' names); the others are optional.
ROPE_SCALING_KEYS: dict[str, tuple[str, ...]] = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "linear": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
}
ACTIVATIONS = ("silu", "gelu_tanh")
NORM_LAYOUTS = ("pre", "sandwich", "post")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_context_len: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    rope_scaling: RopeScaling | None
    name: str
    # What the Llama family's members add (each False/None for Llama itself):
    qkv_bias: bool = False  # q/k/v projections with a bias (Qwen2; Llama's attention_bias)
    o_bias: bool = False  # the output projection with a bias (Llama's attention_bias)
    qk_norm: bool = False  # an RMSNorm over each head of q and k before the rotation (Qwen3)
    sliding_window: int | None = None  # each query attends its last W keys, itself included (Mistral)
    architecture: str = "llama"  # the family member's name, for messages
    # A divisor of each rotary frequency (a GGUF's rope_freqs: Llama 3.1's scaling, precomputed)
    rope_factors: tuple[float, ...] | None = None
    hidden_act: str = "silu"  # the MLP's gate: silu, or gelu_tanh (Gemma)
    norm_offset: bool = False  # each RMSNorm scales by 1 + weight, in float32 (Gemma)
    # Where a layer's norms are (LlamaDecoderLayer): "pre" each block's input (Llama), "sandwich"
    # its input and output (Gemma 2/3), "post" its output (OLMo 2).
    norm_layout: str = "pre"
    qk_norm_whole: bool = False  # the q/k norms over the whole projection, not each head (OLMo 2)
    embedding_scale: float | None = None  # the embeddings times this (Gemma: sqrt(hidden); Granite)
    attention_scale: float | None = None  # the scores' scale; None: head_dim ** -0.5 (Gemma, Granite)
    attention_softcap: float | None = None  # scores capped as cap * tanh(s / cap) (Gemma 2)
    final_softcap: float | None = None  # the logits likewise (Gemma 2)
    residual_scale: float = 1.0  # each block's output times this before the add (Granite)
    logits_divisor: float = 1.0  # the logits divided by this (Granite's logits_scaling)
    # By layer, True where it attends within sliding_window only (Gemma 2/3's local layers,
    # layer_types); None: every layer does where sliding_window is set (Mistral, Phi-3).
    sliding_layers: tuple[bool, ...] | None = None
    local_rope_theta: float | None = None  # the sliding layers' own rotary base, unscaled (Gemma 3)
    rope_layers: tuple[bool, ...] | None = None  # by layer, False where there is no rotation (SmolLM3)
    rotary_dim: int | None = None  # the rotation covers each head's first rotary_dim only (Phi-4-mini)
    # Queries times 1 + beta * log(1 + floor(position / original context)) (Ministral 3's
    # llama_4_scaling_beta, over its yarn's original_max_position_embeddings); None: unscaled.
    query_scale_beta: float | None = None
    query_scale_span: int = 1
    # A mixture of experts in place of the MLP (Qwen3-MoE, Mixtral); 0 experts: none.
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    normalize_expert_weights: bool = True  # the top k's probabilities renormalised to sum to 1
    shared_expert_intermediate_size: int = 0  # an expert every token takes, gated (Qwen2-MoE); 0: none
    sparse_layers: tuple[bool, ...] | None = None  # by layer, False where the MLP is dense; None: all sparse

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rope_scaling is not None:
            check_rope_scaling(dict(self.rope_scaling))
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.norm_layout not in NORM_LAYOUTS:
            raise ValueError(
                f"norm_layout must be one of {', '.join(NORM_LAYOUTS)}, got {self.norm_layout!r}"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r} (one of {', '.join(ACTIVATIONS)})")
        if self.num_experts and not (0 < self.experts_per_token <= self.num_experts):
            raise ValueError(
                f"experts_per_token must be in 1..{self.num_experts}, got {self.experts_per_token}"
            )
        by_layers = (
            ("sliding_layers", self.sliding_layers),
            ("rope_layers", self.rope_layers),
            ("sparse_layers", self.sparse_layers),
        )
        for what, by_layer in by_layers:
            if by_layer is not None and len(by_layer) != self.num_layers:
                raise ValueError(f"{what} has {len(by_layer)} entries for {self.num_layers} layers")
        if self.rotary_dim is not None and not (
            0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0
        ):
            raise ValueError(
                f"rotary_dim must be even and in 1..head_dim {self.head_dim}, got {self.rotary_dim}"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def window_of(self, layer: int) -> int | None:
        """The sliding window layer `layer` attends within (None: every earlier key)."""
        if self.sliding_layers is not None and not self.sliding_layers[layer]:
            return None
        return self.sliding_window

    def rope_of(self, layer: int) -> str | None:
        """Which rotation layer `layer` applies: "global", "local" (Gemma 3's sliding layers) or None."""
        if self.rope_layers is not None and not self.rope_layers[layer]:
            return None
        if self.local_rope_theta is not None and self.window_of(layer) is not None:
            return "local"
        return "global"

    def sparse(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts."""
        return self.num_experts > 0 and (self.sparse_layers is None or self.sparse_layers[layer])

    @property
    def llama_arithmetic(self) -> bool:
        """True where a layer computes what Llama's does, to the operator (Mistral's window, Qwen's
        biases and q/k norms aside): what Stepahead's CPU kernels implement."""
        return (
            self.hidden_act == "silu"
            and not self.norm_offset
            and self.norm_layout == "pre"
            and not self.qk_norm_whole
            and self.embedding_scale is None
            and self.attention_scale is None
            and self.attention_softcap is None
            and self.residual_scale == 1.0
            and self.sliding_layers is None
            and self.rope_layers is None
            and self.rotary_dim is None
            and self.num_experts == 0
            and self.query_scale_beta is None
        )


def check_rope_scaling(scaling: dict[str, Any]) -> None:
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type not in ROPE_SCALING_KEYS:
        raise ValueError(
            f"unsupported rope_scaling type {rope_type!r} (one of {', '.join(ROPE_SCALING_KEYS)})"
        )
    missing = [key for key in ROPE_SCALING_KEYS[rope_type] if key not in scaling]
    if missing:
        raise ValueError(f"{rope_type} rope_scaling lacks {missing}")


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, layers_on: torch.device | None = None) -> None:
        """`layers_on`: where the decoder layers' weights are made (None: where the rest is);
        `meta` leaves them unallocated until each is loaded (`load_weights`)."""
        super().__init__()
        self.embed_tokens: Embedding | Int8Embedding | TiedInt8Embedding = Embedding(
            config.vocab_size, config.hidden_size
        )
        self.embedding_scale = config.embedding_scale
        self.query_scale_beta, self.query_scale_span = config.query_scale_beta, config.query_scale_span
        with contextlib.nullcontext() if layers_on is None else torch.device(layers_on):
            self.layers = nn.ModuleList(
                LlamaDecoderLayer(config, config.sparse(i)) for i in range(config.num_layers)
            )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_offset)
        # By layer: its rotation ("global", "local" or None) and its sliding window (None: none).
        self.layer_ropes = [config.rope_of(i) for i in range(config.num_layers)]
        self.layer_windows = [config.window_of(i) for i in range(config.num_layers)]
        names = sorted({name for name in self.layer_ropes if name is not None})
        self.rotary = nn.ModuleDict({name: RotaryEmbedding(config, local=name == "local") for name in names})
        self.query_group = config.num_heads // config.num_kv_heads
        # The layers in one call of Stepahead's CPU kernels for steps of decode rows alone
        # (`quantization.decode_layers`): the same arithmetic as the layers' modules, without a
        # dozen Python calls a layer, which at batch 1 cost about as much as the products.
        self.decode_kernel: DecodeLayers | None = None

    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Final-normed hidden states of the sampling rows, [R, hidden], then of the scored
        prompt positions (`ForwardBatch.score_token_index`), [S, hidden]."""
        x = self.embed_tokens(batch.input_ids)
        if self.embedding_scale is not None:  # in the activations' dtype, as transformers scales
            x = x * torch.tensor(self.embedding_scale, dtype=x.dtype)
        upto = max(batch.row_ctx_lens)  # every position is below its row's context length
        ropes = {
            name: _rotary(rotary).at(batch.positions, x.dtype, upto) for name, rotary in self.rotary.items()
        }
        beta = self.query_scale_beta
        scale = None if beta is None else query_scale(batch.positions, beta, self.query_scale_span, x.dtype)
        plans = {
            w: AttentionPlan.build(batch, self.query_group, w, scale)
            for w in dict.fromkeys(self.layer_windows)
        }
        decode = plans[self.layer_windows[0]].decode
        if self.decode_kernel is not None and decode is not None and decode.whole_batch:
            # NOTE: a model of Llama's arithmetic only (quantization.decode_layers): one rotation and window
            x = self.decode_kernel(
                x, ropes["global"], (kv.k, kv.v), batch.out_kv_slots, decode.kv_slots, decode.valid
            )
        else:
            for i, layer in enumerate(self.layers):
                name, plan = self.layer_ropes[i], plans[self.layer_windows[i]]
                x = layer(
                    x, None if name is None else ropes[name], (kv.k[i], kv.v[i]), batch.out_kv_slots, plan
                )
        index = batch.sample_token_index
        if batch.score_token_index is not None:  # prompt positions scored: their logits follow
            index = torch.cat((index, batch.score_token_index))
        normed: torch.Tensor = self.norm(x.index_select(0, index))
        return normed


def query_scale(positions: torch.Tensor, beta: float, span: int, dtype: torch.dtype) -> torch.Tensor:
    """Ministral 3's scale of each token's queries [T, 1, 1], as transformers computes it."""
    scale = 1 + beta * torch.log(1 + torch.floor(positions / span))
    return scale[:, None, None].to(dtype)


def _rotary(module: nn.Module) -> RotaryEmbedding:
    assert isinstance(module, RotaryEmbedding)
    return module


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, layers_on: torch.device | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, layers_on)
        self.lm_head: nn.Module = Linear(config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:
            embeddings = self.model.embed_tokens
            assert isinstance(embeddings, Embedding)  # as made; quantized only for serving
            self.lm_head.weight = embeddings.weight

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the final norm's, whatever the projections and embeddings are
        stored in)."""
        return self.model.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    def fuse_projections(self) -> None:
        """q/k/v and gate/up each as one projection (after loading and sharding: serving's layout)."""
        for layer in self.model.layers:
            assert isinstance(layer, LlamaDecoderLayer)
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """float32 logits [R, vocab] of the sampling rows (then [S, vocab] of the scored prompt
        positions); writes the batch's K/V into `kv`.

        NOTE: enters no grad mode of its own: the worker's forward thread runs in
        inference mode for its whole life, and the weights need no gradient anyway.
        """
        return self.head(self.model(batch, kv))

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of final hidden states: the output layer, then Granite's divisor and
        Gemma 2's cap where the model has them."""
        logits: torch.Tensor = self.lm_head(hidden).float()
        config = self.config
        if config.logits_divisor != 1.0:
            logits = logits / config.logits_divisor
        if config.final_softcap is not None:
            logits = torch.tanh(logits / config.final_softcap) * config.final_softcap
        return logits

    def logits_and_scored(self, batch: ForwardBatch, kv: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """The sampling rows' float32 logits [R, vocab], and the scored prompt positions' final
        hidden states [S, hidden], whose logits `LogitsDraw.scores` makes a slice at a time with
        `head` (all of a long chunk's at once would take S x vocab floats, twice)."""
        hidden = self.model(batch, kv)
        rows = batch.sample_token_index.shape[0]
        return self.head(hidden[:rows]), hidden[rows:]

    def weight_names(self) -> list[str]:
        """Names a checkpoint must provide (lm_head.weight is optional when tied)."""
        names = list(self.state_dict().keys())
        if self.config.tie_word_embeddings:
            names.remove("lm_head.weight")
        return names


def new_model(
    config: ModelConfig, dtype: torch.dtype, device: torch.device, lazy_layers: bool = False
) -> LlamaForCausalLM:
    """A model with uninitialised weights allocated directly in `dtype` on `device`; `lazy_layers`:
    each decoder layer's only when its first weight is loaded (`load_weights`), so that a layer
    can be quantized before the next one takes its room."""
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config, torch.device("meta") if lazy_layers else None)
    finally:
        torch.set_default_dtype(previous_dtype)
    return model.eval()


def prepare_for_serving(
    model: LlamaForCausalLM, quantization: str = "none", int4_blocks: Mapping[str, Int4Blocks] | None = None
) -> None:
    """Serving's layout of loaded (and sharded) weights: q/k/v and gate/up fused; then quantized
    (`int8`, `int4`: `int4_blocks`, a file's own 4-bit weights, where it has them), or else, in
    float32 on the CPU, multiplied weight-side for a few rows (`use_weight_side_products`)."""
    model.fuse_projections()
    if quantization != "none":
        quantize_model(model, quantization, int4_blocks or {})
    elif model.device.type == "cpu" and model.dtype == torch.float32:
        use_weight_side_products(model)


# Called with a decoder layer's index and module once all its weights are loaded.
LayerLoaded = Callable[[int, LlamaDecoderLayer], None]


def quantize_as_loaded(
    model: LlamaForCausalLM, quantization: str, int4_blocks: Mapping[str, Int4Blocks]
) -> LayerLoaded | None:
    """`load_weights`' hook that quantizes each decoder layer as soon as it is loaded (None for
    `none`): with `new_model(lazy_layers=True)`, loading holds one layer's float weights at a
    time beside the quantized ones, not the whole model's. `prepare_for_serving` does the rest."""
    if quantization == "none":
        return None
    kernels = kernels_for(model.dtype, quantization)

    def quantize(index: int, layer: LlamaDecoderLayer) -> None:
        quantize_layer(layer, index, quantization, int4_blocks, kernels)

    return quantize


IGNORED_CHECKPOINT_SUFFIXES = ("rotary_emb.inv_freq",)  # an old checkpoint's saved frequencies


def load_weights(
    model: LlamaForCausalLM,
    shards: Iterable[dict[str, torch.Tensor]],
    layer_loaded: LayerLoaded | None = None,
) -> None:
    """Copy each named tensor of `shards` onto the model's weight of that name (checkpoint and GGUF
    files alike); ValueError where a required weight is missing, a name is unknown or a shape differs.
    A layer left unallocated (`new_model(lazy_layers=True)`) is allocated at its first weight;
    `layer_loaded` is called for each layer as soon as it has all its weights, in whatever order
    the files hold them."""
    params = dict(model.named_parameters(remove_duplicate=False))
    required = set(model.weight_names())
    layers = model.model.layers
    left = [{n for n in required if n.startswith(f"model.layers.{i}.")} for i in range(len(layers))]
    loaded: set[str] = set()
    unexpected: list[str] = []
    for shard in shards:
        for name, tensor in shard.items():
            if name.endswith(IGNORED_CHECKPOINT_SUFFIXES):
                continue
            if name not in params:
                unexpected.append(name)
            elif name in required:
                index = _layer_of(name)
                if params[name].is_meta and index is not None:
                    layers[index].to_empty(device=model.device)
                    prefix = f"model.layers.{index}."
                    params.update((prefix + n, p) for n, p in layers[index].named_parameters())
                _copy_weight(name, params[name], tensor)
                loaded.add(name)
                if index is not None and name in left[index]:
                    left[index].discard(name)
                    if not left[index] and layer_loaded is not None:
                        layer = layers[index]
                        assert isinstance(layer, LlamaDecoderLayer)
                        layer_loaded(index, layer)
                        # its float weights go with the modules it replaced, not kept here
                        prefix = f"model.layers.{index}."
                        for key in [key for key in params if key.startswith(prefix)]:
                            del params[key]
    missing = sorted(required - loaded)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not match the model: missing {missing}, unexpected {sorted(unexpected)}"
        )


def _layer_of(name: str) -> int | None:
    """The decoder layer a weight's name is in (None: not in one)."""
    parts = name.split(".", 3)
    return int(parts[2]) if len(parts) > 3 and parts[:2] == ["model", "layers"] else None


def _copy_weight(name: str, param: torch.Tensor, tensor: torch.Tensor) -> None:
    if tuple(tensor.shape) != tuple(param.shape):
        raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor)
