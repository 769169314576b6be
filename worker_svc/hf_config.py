"""A Hugging Face checkpoint's config.json read into a ModelConfig: which member of the Llama
family it is, and each member's options, with the defaults transformers' config classes give
where a file leaves a key out. Both ways transformers has written rotary settings are read: the
older top-level `rope_theta` and `rope_scaling` (most checkpoints published), and the newer
`rope_parameters` (by layer type for Gemma 3 and OLMo 3)."""

from __future__ import annotations

from typing import Any

from worker_svc.model import ModelConfig, RopeScaling, check_rope_scaling

# The members served: architectures (config.json) -> model_type.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
    "Ministral3ForCausalLM": "ministral3",
    "Olmo2ForCausalLM": "olmo2",
    "Olmo3ForCausalLM": "olmo3",
    "Exaone4ForCausalLM": "exaone4",
    "Glm4ForCausalLM": "glm4",
    "GemmaForCausalLM": "gemma",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Phi3ForCausalLM": "phi3",
    "SmolLM3ForCausalLM": "smollm3",
    "GraniteForCausalLM": "granite",
}
MODEL_TYPES = set(ARCHITECTURES.values())
GEMMA = ("gemma", "gemma2", "gemma3_text")
# Vision-language checkpoints served as their language model alone (its config is text_config,
# its weights under language_model): architecture -> its text model's type where text_config
# does not name it.
TEXT_OF = {"Gemma3ForConditionalGeneration": "gemma3_text", "Mistral3ForConditionalGeneration": "mistral"}
# transformers' Gemma3TextConfig defaults: a Gemma 3 checkpoint's text_config gives few keys.
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "eos_token_id": 1,
    "bos_token_id": 2,
}

# Where transformers' config class of a member defaults otherwise than Llama's (a key left out).
TIED_BY_DEFAULT = (*GEMMA, "smollm3")
ROPE_THETA_DEFAULT = {
    "gemma3_text": 1_000_000.0,
    "smollm3": 2_000_000.0,
    "mixtral": 1_000_000.0,
    "olmo3": 500_000.0,
}
HEAD_DIM_DEFAULT = {"gemma": 256, "gemma2": 256, "ministral3": 128, "glm4": 128}  # else hidden / heads
PARTIAL_ROTARY_DEFAULT = {"glm4": 0.5}  # else 1
EPS_DEFAULT = {
    "glm4": 1.5625e-07,
    "phi3": 1e-5,
    "mixtral": 1e-5,
    "ministral3": 1e-5,
    "olmo2": 1e-5,
    "olmo3": 1e-5,
    "exaone4": 1e-5,
}
NORM_LAYOUT = {
    "glm4": "sandwich",
    "gemma2": "sandwich",
    "gemma3_text": "sandwich",
    "olmo2": "post",
    "olmo3": "post",
    "exaone4": "post",
}
OLMO = ("olmo2", "olmo3")  # q/k norms over the whole projection
# Local and global layers each with their rotation (rope_parameters by layer type): the local
# layers' base where the config gives none (the key it is under in older configs, its default).
LOCAL_ROPE = {"gemma3_text": ("rope_local_base_freq", 10_000.0), "olmo3": ("", 500_000.0)}
QWEN3 = ("qwen3", "qwen3_moe")  # q/k norms; a sliding window only with use_sliding_window
QWEN2 = ("qwen2", "qwen2_moe")  # q/k/v biases; a sliding window only with use_sliding_window
# Qwen's mixtures of experts, where a config leaves their sizes out: experts, experts a token,
# an expert's width, the shared expert's width (Qwen2-MoE's; 0: none).
QWEN_MOE_DEFAULTS = {"qwen3_moe": (128, 8, 768, 0), "qwen2_moe": (60, 4, 1408, 5632)}
PER_HEAD_QK_NORMS = (*QWEN3, "gemma3_text", "exaone4")
EVERY_LAYER_WINDOWED = ("mistral", "mixtral", "ministral3", "phi3")  # a sliding_window is every layer's
SOFTCAP_DEFAULTS = {"gemma2": (50.0, 30.0)}  # attention's, the logits'
WINDOW_DEFAULT = {"gemma2": 4096, "gemma3_text": 4096, "olmo3": 4096, "exaone4": 4096}

# hidden_act values (transformers' ACT2FN names) -> ModelConfig.hidden_act
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
LAYER_TYPES = ("full_attention", "sliding_attention")


def config_from_hf_dict(d: dict[str, Any], name: str = "llama") -> ModelConfig:
    """ModelConfig from the config.json dict of a checkpoint of the Llama family (ARCHITECTURES,
    or a vision-language checkpoint of TEXT_OF for its language model); ValueError naming what
    is not supported."""
    d = text_config(d)
    family = _family(d)
    if family == "gemma3_text":
        d = {**GEMMA3_TEXT_DEFAULTS, **d}
    _check_unsupported_options(d)
    num_heads = int(d["num_attention_heads"])
    num_layers = int(d["num_hidden_layers"])
    head_dim = int(d.get("head_dim") or HEAD_DIM_DEFAULT.get(family) or d["hidden_size"] // num_heads)
    max_len = int(d["max_position_embeddings"])
    rope_theta, rope_scaling, local_theta, rotary_dim = _rope_settings(d, family, head_dim)
    window, sliding_layers = _sliding(d, family, num_layers, max_len)
    # As transformers builds each: attention_bias covers q/k/v and the output (GLM-4's: q/k/v); Qwen2's q/k/v
    # always have a bias, its output never; Mistral's kin (Mixtral, Ministral 3) and Phi-3 have none.
    attention_bias = bool(d.get("attention_bias", family == "glm4")) and family not in (
        *QWEN2,
        *EVERY_LAYER_WINDOWED,
    )
    attn_cap, final_cap = SOFTCAP_DEFAULTS.get(family, (None, None))
    gemma = family in GEMMA
    return ModelConfig(
        vocab_size=int(d["vocab_size"]),
        hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        rope_theta=rope_theta,
        rms_norm_eps=float(d.get("rms_norm_eps", EPS_DEFAULT.get(family, 1e-6))),
        max_context_len=max_len,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", family in TIED_BY_DEFAULT)),
        eos_token_ids=token_ids(d.get("eos_token_id")),
        bos_token_id=d.get("bos_token_id"),
        rope_scaling=rope_scaling,
        name=name,
        qkv_bias=attention_bias or (family in QWEN2 and bool(d.get("qkv_bias", True))),
        o_bias=attention_bias and family != "glm4",  # GLM-4's bias is q/k/v's only
        qk_norm=family in (*PER_HEAD_QK_NORMS, *OLMO),
        qk_norm_whole=family in OLMO,
        sliding_window=window,
        architecture=family,
        hidden_act=_activation(d, family),
        norm_offset=gemma,
        norm_layout=NORM_LAYOUT.get(family, "pre"),
        embedding_scale=_embedding_scale(d, family),
        attention_scale=_attention_scale(d, family),
        attention_softcap=_optional_float(d.get("attn_logit_softcapping", attn_cap)),
        final_softcap=_optional_float(d.get("final_logit_softcapping", final_cap)),
        residual_scale=float(d.get("residual_multiplier", 1.0)) if family == "granite" else 1.0,
        logits_divisor=float(d.get("logits_scaling", 1.0)) if family == "granite" else 1.0,
        sliding_layers=sliding_layers,
        local_rope_theta=local_theta,
        rope_layers=_rope_layers_of(d, family, num_layers),
        rotary_dim=rotary_dim,
        **_experts(d, family, num_layers),
        **(_query_scale(d) if family == "ministral3" else {}),
    )


def _rope_layers_of(d: dict[str, Any], family: str, num_layers: int) -> tuple[bool, ...] | None:
    """The layers that rotate, where not all do: SmolLM3's (no_rope_layers); EXAONE 4's hybrid
    attention, where it has a sliding window (however wide): its windowed layers only."""
    if family == "smollm3":
        return _rope_layers(d, num_layers)
    if family != "exaone4" or d.get("sliding_window", WINDOW_DEFAULT[family]) is None:
        return None
    types = d.get("layer_types") or _default_layer_types(d, family, num_layers)
    return tuple(t == "sliding_attention" for t in types)


def _query_scale(d: dict[str, Any]) -> dict[str, Any]:
    """Ministral 3's scale of the queries by position (its rope parameters' llama_4_scaling_beta,
    over their original_max_position_embeddings)."""
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    beta = params.get("llama_4_scaling_beta")
    if beta is None:
        return {}
    span = params.get("original_max_position_embeddings") or d.get("original_max_position_embeddings")
    if span is None:
        raise ValueError("llama_4_scaling_beta without original_max_position_embeddings")
    return {"query_scale_beta": float(beta), "query_scale_span": int(span)}


def _experts(d: dict[str, Any], family: str, num_layers: int) -> dict[str, Any]:
    """A mixture of experts' settings (Qwen3-MoE's sparse layers: every decoder_sparse_step-th,
    less mlp_only_layers; every one of Mixtral's, whose top k are always renormalised)."""
    if family == "mixtral":
        return {
            "num_experts": int(d.get("num_local_experts", 8)),
            "experts_per_token": int(d.get("num_experts_per_tok", 2)),
            "expert_intermediate_size": int(d["intermediate_size"]),
        }
    if family not in QWEN_MOE_DEFAULTS:
        return {}
    experts, per_token, width, shared = QWEN_MOE_DEFAULTS[family]
    step, dense = int(d.get("decoder_sparse_step", 1)), set(d.get("mlp_only_layers") or [])
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    return {
        # num_experts as configs are written, num_local_experts as transformers saves them
        "num_experts": int(d.get("num_experts") or d.get("num_local_experts") or experts),
        "experts_per_token": int(d.get("num_experts_per_tok", per_token)),
        "expert_intermediate_size": int(d.get("moe_intermediate_size", width)),
        "normalize_expert_weights": bool(d.get("norm_topk_prob", False)),
        "shared_expert_intermediate_size": int(d.get("shared_expert_intermediate_size", shared)),
        "sparse_layers": None if all(sparse) else sparse,
    }


def text_config(d: dict[str, Any]) -> dict[str, Any]:
    """A vision-language checkpoint's text model's config (TEXT_OF), with the special ids the
    checkpoint gives at its top level; any other config as it is."""
    wrappers = [a for a in d.get("architectures") or [] if a in TEXT_OF]
    if not wrappers:
        return d
    inner = dict(d.get("text_config") or {})
    for key in ("eos_token_id", "bos_token_id"):
        if key in d and key not in inner:
            inner[key] = d[key]
    if "tie_word_embeddings" in d:  # the wrapper's output layer is tied as its own config says
        inner["tie_word_embeddings"] = d["tie_word_embeddings"]
    model_type = inner.get("model_type") or TEXT_OF[wrappers[0]]
    text = [a for a, family in ARCHITECTURES.items() if family == model_type]
    if not text:
        raise ValueError(f"unsupported language model {model_type!r} in {wrappers[0]}")
    return {**inner, "architectures": text[:1]}


def is_vision_language(d: dict[str, Any]) -> bool:
    return any(a in TEXT_OF for a in d.get("architectures") or [])


def token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _family(d: dict[str, Any]) -> str:
    """The member of the Llama family a config describes (its model_type)."""
    architectures = list(d.get("architectures") or [])
    model_type = d.get("model_type")
    known = [ARCHITECTURES[a] for a in architectures if a in ARCHITECTURES]
    if known:
        return known[0]
    if not architectures and model_type in MODEL_TYPES:
        return str(model_type)
    raise ValueError(
        f"unsupported architecture {architectures} (model_type {model_type!r}); supported: "
        f"{', '.join(sorted(ARCHITECTURES))}"
    )


def _check_unsupported_options(d: dict[str, Any]) -> None:
    if d.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported")
    if d.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=true is not supported (an encoder, not a decoder)")


def _activation(d: dict[str, Any], family: str) -> str:
    if family in ("gemma2", "gemma3_text"):
        act = d.get("hidden_activation") or "gelu_pytorch_tanh"
    elif family == "gemma":  # "gelu" is the first releases' name of the tanh approximation
        act = d.get("hidden_act") or "gelu_pytorch_tanh"
        act = "gelu_pytorch_tanh" if act == "gelu" else act
    else:
        act = d.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise ValueError(f"unsupported hidden_act {act!r} (one of {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[act]


def _optional_float(value: object) -> float | None:
    return None if value is None else float(value)  # type: ignore[arg-type]


def _embedding_scale(d: dict[str, Any], family: str) -> float | None:
    if family in GEMMA:
        root: float = float(d["hidden_size"]) ** 0.5
        return root
    if family == "granite":
        return float(d.get("embedding_multiplier", 1.0))
    return None


def _attention_scale(d: dict[str, Any], family: str) -> float | None:
    if family in ("gemma2", "gemma3_text"):
        scale: float = float(d.get("query_pre_attn_scalar", 256)) ** -0.5
        return scale
    if family == "granite":  # its scores' scale itself (transformers' default 1.0)
        return float(d.get("attention_multiplier", 1.0))
    return None


def _rope_settings(
    d: dict[str, Any], family: str, head_dim: int
) -> tuple[float, RopeScaling | None, float | None, int | None]:
    """The global rotation's base and scaling, the local layers' base (Gemma 3) and the rotated
    width of a head where it is not the whole of it (partial_rotary_factor)."""
    params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    local_theta = None
    if family in LOCAL_ROPE:
        if "full_attention" in params or "sliding_attention" in params:  # by layer type
            local = dict(params.get("sliding_attention") or {})
            params = dict(params.get("full_attention") or {})
        else:
            local = {}
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"unsupported rope type {local['rope_type']!r} for the sliding layers")
        key, default = LOCAL_ROPE[family]
        local_theta = float(local.get("rope_theta", d.get(key, default) if key else default))
    rope_theta = float(
        params.pop("rope_theta", d.get("rope_theta", ROPE_THETA_DEFAULT.get(family, 10_000.0)))
    )
    partial = params.pop("partial_rotary_factor", None) or d.get("partial_rotary_factor")
    partial = float(partial or PARTIAL_ROTARY_DEFAULT.get(family, 1.0))
    rotary_dim = int(head_dim * partial) if partial != 1.0 else None
    rope_type = params.get("rope_type", params.get("type", "default"))
    if family == "phi3" and rope_type in ("su", "yarn"):  # the names transformers reads as longrope
        params["rope_type"] = rope_type = "longrope"
    if rope_type == "default":
        return rope_theta, None, local_theta, rotary_dim
    if rope_type in ("longrope", "yarn") and "original_max_position_embeddings" in d:
        params.setdefault("original_max_position_embeddings", d["original_max_position_embeddings"])
    check_rope_scaling(params)
    if rope_type == "longrope":
        for key in ("short_factor", "long_factor"):
            if len(params[key]) != (rotary_dim or head_dim) // 2:
                raise ValueError(
                    f"longrope {key} has {len(params[key])} entries, not {(rotary_dim or head_dim) // 2}"
                )
    items = {
        k: tuple(float(x) for x in v) if isinstance(v, list) else v
        for k, v in params.items()
        if v is not None
    }
    return rope_theta, tuple(sorted(items.items())), local_theta, rotary_dim


def _sliding(
    d: dict[str, Any], family: str, num_layers: int, max_len: int
) -> tuple[int | None, tuple[bool, ...] | None]:
    """The sliding window and, where not every layer has it, the layers that do."""
    window = d.get("sliding_window", WINDOW_DEFAULT.get(family))
    if family in (*QWEN2, *QWEN3, "smollm3") and not d.get("use_sliding_window", False):
        window = None
    if window is None or int(window) >= max_len:  # no key is ever out of a window this wide
        return None, None
    if family in EVERY_LAYER_WINDOWED:
        return int(window), None
    types = d.get("layer_types")
    if types is None:
        types = _default_layer_types(d, family, num_layers)
    if len(types) != num_layers or any(t not in LAYER_TYPES for t in types):
        raise ValueError(
            f"layer_types must give one of {', '.join(LAYER_TYPES)} for each of {num_layers} layers"
        )
    sliding = tuple(t == "sliding_attention" for t in types)
    return (int(window), sliding) if any(sliding) else (None, None)


def _default_layer_types(d: dict[str, Any], family: str, num_layers: int) -> list[str]:
    """transformers' layer_types where a config leaves them out."""
    full, local = LAYER_TYPES
    if family == "gemma2":  # every other layer, the first sliding
        return [local if (i + 1) % 2 else full for i in range(num_layers)]
    if family == "gemma3_text":  # five sliding layers to one global
        pattern = int(d.get("sliding_window_pattern", 6))
        return [local if (i + 1) % pattern else full for i in range(num_layers)]
    if family in (*QWEN2, *QWEN3):  # the layers from max_window_layers on
        first = int(d.get("max_window_layers", 28))
        return [local if i >= first else full for i in range(num_layers)]
    if family == "exaone4":  # a pattern: every n-th global, or "L"ocal and "G"lobal by letter
        pattern = d.get("sliding_window_pattern", 4)
        if isinstance(pattern, str):
            return [local if pattern[i % len(pattern)] == "L" else full for i in range(num_layers)]
        return [local if (i + 1) % int(pattern) else full for i in range(num_layers)]
    if family == "olmo3":  # three sliding layers to one global
        return [local if (i + 1) % 4 else full for i in range(num_layers)]
    if family == "smollm3":  # the layers without a rotation
        return [full if uses else local for uses in _rope_layers(d, num_layers)]
    return [full] * num_layers


def _rope_layers(d: dict[str, Any], num_layers: int) -> tuple[bool, ...]:
    """SmolLM3's no_rope_layers: 1 where a layer rotates, 0 where not (every fourth by default)."""
    given = d.get("no_rope_layers")
    if given is None:
        interval = int(d.get("no_rope_layer_interval", 4))
        return tuple((i + 1) % interval != 0 for i in range(num_layers))
    if len(given) != num_layers:
        raise ValueError(f"no_rope_layers has {len(given)} entries for {num_layers} layers")
    return tuple(bool(x) for x in given)
