"""The Llama family against transformers: Llama (llama3 and yarn rope scaling, tied embeddings,
attention bias), Mistral (sliding window), Ministral 3 (yarn, queries scaled by position), Qwen2
(q/k/v bias; sliding layers), Qwen3 (q/k norms), Qwen3-MoE, Qwen2-MoE (its shared expert) and
Mixtral (a mixture of experts, dense layers beside sparse ones), Gemma (scaled embeddings, 1 + w
norms, tanh GELU), Gemma 2 (norms around each block, capped scores and logits, alternating
sliding layers), Gemma 3 (q/k norms, local layers with their own rotary base, linear scaling on
the global ones), Phi-3 (fused checkpoint projections, a partial rotation, longrope), SmolLM3
(layers without a rotation), Granite (its four multipliers), OLMo 2 and 3 (norms after each
block, q/k norms over all heads; OLMo 3's sliding layers) and EXAONE 4 (norms after each block,
global layers without a rotation) and GLM-4 (four norms a layer, interleaved partial rotation),
each a tiny random checkpoint written by transformers itself.

Our forward runs over the token-slot KV pool as the worker runs it: a prompt prefilled in two
chunks, then decode steps batched with a second, shorter sequence, so that the sliding window
cuts into prefill chunks, decode rows and padded rows alike. Logits must agree within 1e-4 (float32)
and greedy tokens exactly; then a checkpoint of each is served and its greedy stream compared with
transformers' `generate`.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import pathlib
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
import torch
from tokenizers import Regex, Tokenizer, models, pre_tokenizers

from stepahead.processes import serving_pair
from stepahead.v1 import generation_pb2 as pb
from stepahead.v1 import generation_pb2_grpc
from tests.live import CALL_TIMEOUT_S
from worker_svc.forward_batch import ForwardBatch
from worker_svc.hf_config import config_from_hf_dict
from worker_svc.layers import KVCache
from worker_svc.loading import checkpoint_chat_template, load_hf_checkpoint
from worker_svc.model import LlamaForCausalLM
from worker_svc.rotary import RotaryEmbedding

transformers: Any = importlib.import_module("transformers")  # dev dependency: the reference

CPU = torch.device("cpu")
VOCAB = 96
WINDOW = 8  # Mistral's sliding window here: far shorter than the sequences
LOGIT_TOLERANCE = 1e-4  # float32 against float32, the same weights

COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,  # in the vocabulary (some config classes default to a large id)
}
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}

YARN_SCALING = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
# Phi-3's longrope over a rotation of half of each 8-wide head: 2 factors each. The sequences here
# stay below the boundary, where transformers uses the short ones (see test_longrope_*).
LONGROPE = {"type": "longrope", "short_factor": [1.0, 1.5], "long_factor": [2.0, 6.0]}
MINISTRAL3_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 1e6,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "llama_4_scaling_beta": 0.3,
}
# Caps small enough to bite on these scores and logits (Gemma 2's own are 50 and 30).
SOFTCAPS = {"attn_logit_softcapping": 3.0, "final_logit_softcapping": 8.0}

# name: (transformers config class, its arguments beyond COMMON)
FAMILY: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {"rope_scaling": LLAMA3_SCALING, "tie_word_embeddings": True}),
    "llama-attention-bias": ("LlamaConfig", {"attention_bias": True}),
    "llama-yarn": ("LlamaConfig", {"rope_scaling": YARN_SCALING}),
    "mistral-sliding-window": ("MistralConfig", {"sliding_window": WINDOW}),
    "qwen2": ("Qwen2Config", {"rope_theta": 1e6, "tie_word_embeddings": True}),
    "qwen2-sliding-layers": (  # layer 1 windowed, layer 0 not
        "Qwen2Config",
        {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    ),
    "qwen3": ("Qwen3Config", {"head_dim": 16, "rope_theta": 1e6}),  # head_dim not hidden / heads
    "qwen3-moe": (  # layer 0 sparse, layer 1 dense
        "Qwen3MoeConfig",
        {
            "head_dim": 16,
            "num_experts": 6,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
        },
    ),
    "qwen2-moe": (  # layer 0 dense, layer 1 sparse with its shared expert
        "Qwen2MoeConfig",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "mlp_only_layers": [0],
        },
    ),
    "mixtral": (
        "MixtralConfig",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW},
    ),
    # yarn, and the queries scaled past each multiple of 16 positions (Ministral 3's; its own
    # configs write rope_parameters)
    "ministral3": ("Ministral3Config", {"rope_parameters": MINISTRAL3_ROPE}),
    "olmo2": ("Olmo2Config", {"rope_theta": 5e5}),
    "olmo3": (  # layer 0 sliding, its rotation unscaled; layer 1 global, scaled
        "Olmo3Config",
        {
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_theta": 1e4,
            "rope_scaling": {"rope_type": "linear", "factor": 4.0},
        },
    ),
    # norms after each block, per-head q/k norms, and its global layers without a rotation
    "exaone4": ("Exaone4Config", {"sliding_window": WINDOW, "sliding_window_pattern": 2}),
    # a window wider than the context: no layer is windowed, its global layers still unrotated
    "exaone4-wide-window": ("Exaone4Config", {"sliding_window_pattern": 2}),
    # q/k/v biases, four norms a layer, a rotation of interleaved pairs over half of each head
    "glm4": ("Glm4Config", {"head_dim": 16, "partial_rotary_factor": 0.5}),
    "gemma": ("GemmaConfig", {"head_dim": 16}),
    "gemma2": (
        "Gemma2Config",
        {"head_dim": 16, "sliding_window": WINDOW, "query_pre_attn_scalar": 24, **SOFTCAPS},
    ),
    "gemma3": (  # layer 0 local (its own base, unscaled), layer 1 global (scaled)
        "Gemma3TextConfig",
        {
            "head_dim": 16,
            "sliding_window": WINDOW,
            "sliding_window_pattern": 2,
            "rope_theta": 1e4,
            "rope_local_base_freq": 100.0,
            "rope_scaling": {"rope_type": "linear", "factor": 4.0},
            "query_pre_attn_scalar": 24,
        },
    ),
    "phi3": (
        "Phi3Config",
        {
            "partial_rotary_factor": 0.5,
            "rope_scaling": LONGROPE,
            "original_max_position_embeddings": 128,
            "sliding_window": WINDOW,
        },
    ),
    "smollm3": ("SmolLM3Config", {"no_rope_layer_interval": 2}),  # layer 1 without a rotation
    "granite": (
        "GraniteConfig",
        {
            "embedding_multiplier": 3.0,
            "attention_multiplier": 0.3,
            "residual_multiplier": 0.5,
            "logits_scaling": 2.0,
        },
    ),
}
EAGER = ("gemma2",)  # transformers caps the scores in its eager attention only


def hf_checkpoint(kind: str, directory: pathlib.Path) -> Any:
    """A random model of `kind` from transformers, saved to `directory`; the model itself."""
    config_class, extra = FAMILY[kind]
    config = getattr(transformers, config_class)(**COMMON, **extra)
    torch.manual_seed(11)
    implementation = {"attn_implementation": "eager"} if kind in EAGER else {}
    model = transformers.AutoModelForCausalLM.from_config(config, **implementation).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    model.save_pretrained(directory)
    return model


@pytest.fixture(scope="module", params=sorted(FAMILY))
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Any, pathlib.Path]:
    kind = str(request.param)
    directory = tmp_path_factory.mktemp(kind)
    return kind, hf_checkpoint(kind, directory), directory


@dataclass
class PooledSequences:
    """Sequences over a shuffled token-slot pool, batched the way the worker batches them."""

    model: LlamaForCausalLM
    slots: int = 1024
    free: list[int] = field(default_factory=list)
    req_to_token: torch.Tensor = field(init=False)
    kv: KVCache = field(init=False)
    cached: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.free = torch.randperm(self.slots, generator=torch.Generator().manual_seed(3)).tolist()
        self.req_to_token = torch.full((4, self.model.config.max_context_len), self.slots + 99)
        self.kv = KVCache.allocate(self.model.config, self.slots, torch.float32, CPU)

    def step(self, rows: list[tuple[int, list[int]]]) -> torch.Tensor:
        """Feeds each (sequence, new tokens) row in one batch; the logits of each row's last token."""
        ids: list[int] = []
        positions: list[int] = []
        out_slots: list[int] = []
        starts: list[int] = []
        for seq, tokens in rows:
            start = self.cached.get(seq, 0)
            new = [self.free.pop() for _ in tokens]
            self.req_to_token[seq, start : start + len(tokens)] = torch.tensor(new)
            starts.append(len(ids))
            ids += tokens
            positions += range(start, start + len(tokens))
            out_slots += new
            self.cached[seq] = start + len(tokens)
        batch = ForwardBatch(
            input_ids=torch.tensor(ids),
            positions=torch.tensor(positions),
            out_kv_slots=torch.tensor(out_slots),
            row_req_slots=torch.tensor([seq for seq, _ in rows]),
            row_token_starts=starts,
            row_num_tokens=[len(tokens) for _, tokens in rows],
            row_ctx_lens=[self.cached[seq] for seq, _ in rows],
            sample_token_index=torch.tensor([s + len(t) - 1 for s, (_, t) in zip(starts, rows, strict=True)]),
            req_to_token=self.req_to_token,
        )
        with torch.inference_mode():
            logits: torch.Tensor = self.model(batch, self.kv)
        return logits


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_greedy(model: Any, tokens: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation of `tokens` (EOS taken as any token, as ignore_eos
    does) and the logits of its first step."""
    sequence = list(tokens)
    with torch.no_grad():
        first = model(torch.tensor([tokens])).logits[0, -1].float()
        for _ in range(n):
            sequence.append(int(model(torch.tensor([sequence])).logits[0, -1].argmax()))
    return sequence[len(tokens) :], first


def ours_greedy(
    model: LlamaForCausalLM, tokens: list[int], n: int, other: list[int]
) -> tuple[list[int], torch.Tensor]:
    """Our greedy continuation: `tokens` prefilled in two chunks (the second beside `other`'s
    whole prompt), then decoded batched with `other`, which decodes beside it; and the logits
    [n + 1, V] of each of its steps (the prefill's, then each decode step's)."""
    pool = PooledSequences(model)
    cut = len(tokens) // 2
    pool.step([(0, tokens[:cut])])
    logits = pool.step([(0, tokens[cut:]), (1, other)])
    steps = [logits[0]]
    out: list[int] = []
    other_next = int(logits[1].argmax())
    for _ in range(n):
        out.append(int(logits[0].argmax()))
        logits = pool.step([(1, [other_next]), (0, [out[-1]])]).flip(0)  # decode rows, padded by length
        steps.append(logits[0])
        other_next = int(logits[1].argmax())
    return out, torch.stack(steps)


def hf_logits(model: Any, sequence: list[int]) -> torch.Tensor:
    """transformers' logits [len, V] at every position of `sequence`, in one forward."""
    with torch.no_grad():
        return model(torch.tensor([sequence])).logits[0].float()  # type: ignore[no-any-return]


# By kind, what each of its two layers reads from its config: the window, the rotation.
WINDOWED = {
    "mistral-sliding-window": [WINDOW, WINDOW],
    "mixtral": [WINDOW, WINDOW],
    "phi3": [WINDOW, WINDOW],
    "qwen2-sliding-layers": [None, WINDOW],
    "gemma2": [WINDOW, None],
    "gemma3": [WINDOW, None],
    "olmo3": [WINDOW, None],
    "exaone4": [WINDOW, None],
}
ROTATIONS = {
    "gemma3": ["local", "global"],
    "olmo3": ["local", "global"],
    "smollm3": ["global", None],
    "exaone4": ["global", None],
    "exaone4-wide-window": ["global", None],
}
SPARSE = {"qwen3-moe": [True, False], "qwen2-moe": [False, True], "mixtral": [True, True]}


def test_each_member_of_the_family_equals_transformers(pair: tuple[str, Any, pathlib.Path]) -> None:
    kind, hf_model, directory = pair
    ours = load_hf_checkpoint(directory, torch.float32, CPU)
    config = ours.config
    assert (config.qk_norm, config.qkv_bias, config.o_bias) == (
        kind in ("qwen3", "qwen3-moe", "gemma3", "olmo2", "olmo3", "exaone4", "exaone4-wide-window"),
        kind in ("qwen2", "qwen2-sliding-layers", "qwen2-moe", "llama-attention-bias", "glm4"),
        kind == "llama-attention-bias",
    )
    windowed = [config.window_of(i) for i in range(config.num_layers)]
    assert windowed == WINDOWED.get(kind, [None, None])
    assert [config.rope_of(i) for i in range(config.num_layers)] == ROTATIONS.get(kind, ["global"] * 2)
    assert [config.sparse(i) for i in range(config.num_layers)] == SPARSE.get(kind, [False, False])
    tokens, other = prompt(37, seed=5), prompt(11, seed=6)  # both past the window
    expected, hf_first = hf_greedy(hf_model, tokens, 24)
    got, steps = ours_greedy(ours, tokens, 24, other)
    torch.testing.assert_close(steps[0], hf_first, atol=LOGIT_TOLERANCE, rtol=LOGIT_TOLERANCE)
    assert got == expected
    # Every decode step's logits, not only its argmax (a random model may repeat one token).
    reference = hf_logits(hf_model, tokens + expected)[len(tokens) - 1 :]
    torch.testing.assert_close(steps, reference, atol=LOGIT_TOLERANCE, rtol=LOGIT_TOLERANCE)
    # The batch neighbour's own stream is the same as alone.
    other_expected, _ = hf_greedy(hf_model, other, 4)
    alone, _ = ours_greedy(ours, other, 4, prompt(5, seed=7))
    assert alone == other_expected


TINY_VISION = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2}


def vision_language_config(kind: str) -> Any:
    """A tiny Gemma3Config or Mistral3Config: FAMILY's `kind` as its text_config, a small vision tower."""
    text = {**COMMON, **FAMILY[kind][1]}
    vision = {**TINY_VISION, "image_size": 28, "patch_size": 14}
    if kind == "gemma3":
        tokens = {"image_token_index": VOCAB - 1, "boi_token_index": VOCAB - 3, "eoi_token_index": VOCAB - 2}
        return transformers.Gemma3Config(
            text_config=text, vision_config=vision, mm_tokens_per_image=4, **tokens
        )
    text["model_type"] = "ministral3"
    vision["head_dim"] = 16
    return transformers.Mistral3Config(text_config=text, vision_config=vision, image_token_index=VOCAB - 1)


@pytest.mark.parametrize(
    ("kind", "architecture"),
    [("gemma3", "Gemma3ForConditionalGeneration"), ("ministral3", "Mistral3ForConditionalGeneration")],
)
def test_a_vision_language_checkpoint_serves_its_language_model(
    tmp_path: pathlib.Path, kind: str, architecture: str
) -> None:
    """Gemma 3 from 4B up, and Mistral 3 (Ministral 3, Mistral Small 3.x), are published as vision-
    language models: a vision tower and a projector beside the language model, whose config is
    text_config. Its text is served: the language model's weights under their own names, the rest
    left out, logits as transformers' on the same text."""
    config = vision_language_config(kind)
    torch.manual_seed(11)
    hf_model = getattr(transformers, architecture)(config).eval()
    with torch.no_grad():
        for param in hf_model.parameters():
            param.normal_(0.0, 0.2)
    hf_model.save_pretrained(tmp_path)
    assert any("vision_tower" in name for name in hf_model.state_dict())
    ours = load_hf_checkpoint(tmp_path, torch.float32, CPU)
    family = "gemma3_text" if kind == "gemma3" else kind
    assert (ours.config.architecture, ours.config.num_layers) == (family, COMMON["num_hidden_layers"])
    tokens = prompt(37, seed=5)
    got, steps = ours_greedy(ours, tokens, 24, prompt(11, seed=6))
    reference = hf_logits(hf_model, tokens + got)[len(tokens) - 1 :]
    torch.testing.assert_close(steps, reference, atol=LOGIT_TOLERANCE, rtol=LOGIT_TOLERANCE)


def test_a_chat_template_is_found_where_checkpoints_keep_it(tmp_path: pathlib.Path) -> None:
    """chat_template.jinja first, then tokenizer_config.json's, then chat_template.json's (where a
    vision-language checkpoint's processor keeps it)."""
    assert checkpoint_chat_template(tmp_path) == ""
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "processor's"}))
    assert checkpoint_chat_template(tmp_path) == "processor's"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "tokenizer's"}))
    assert checkpoint_chat_template(tmp_path) == "tokenizer's"
    (tmp_path / "chat_template.jinja").write_text("its own file's")
    assert checkpoint_chat_template(tmp_path) == "its own file's"


def test_a_config_as_published_reads_as_the_one_transformers_writes(
    pair: tuple[str, Any, pathlib.Path],
) -> None:
    """Checkpoints on the Hub mostly carry the older keys (top-level rope_theta and rope_scaling,
    rope_local_base_freq, partial_rotary_factor, sliding_window_pattern, no layer_types): the
    arguments FAMILY gives; transformers writes them anew (rope_parameters, by layer type for Gemma
    3; layer_types). Both read as the same config."""
    kind, _, directory = pair
    written = json.loads((directory / "config.json").read_text())
    published = {**COMMON, **FAMILY[kind][1], "architectures": written["architectures"]}
    assert "rope_parameters" in written and ("rope_parameters" not in published) == (kind != "ministral3")
    assert config_from_hf_dict(published) == config_from_hf_dict(written)


def test_longrope_rotates_past_the_boundary_with_the_long_factors(tmp_path: pathlib.Path) -> None:
    """Positions from original_max_position_embeddings on take the long factors, as transformers
    rotates a sequence longer than that; both scaled by its attention factor."""
    hf_model = hf_checkpoint("phi3", tmp_path)
    rotary = load_hf_checkpoint(tmp_path, torch.float32, CPU).model.rotary["global"]
    assert isinstance(rotary, RotaryEmbedding)
    init = importlib.import_module("transformers.modeling_rope_utils").ROPE_INIT_FUNCTIONS["longrope"]
    boundary = FAMILY["phi3"][1]["original_max_position_embeddings"]
    short, factor = init(hf_model.config, CPU)
    long, _ = init(hf_model.config, CPU, seq_len=boundary + 1)
    assert factor > 1.0 and not torch.equal(short, long)
    positions = torch.arange(COMMON["max_position_embeddings"], dtype=torch.float32)
    for inv_freq, rows in ((short, slice(0, boundary)), (long, slice(boundary, None))):
        freqs = positions[rows, None] * inv_freq[None, :]
        expected = torch.cat((freqs, freqs), dim=-1)
        assert torch.equal(rotary.cos_cache[rows], expected.cos() * factor)
        assert torch.equal(rotary.sin_cache[rows, inv_freq.shape[0] :], freqs.sin() * factor)


def test_exaone4s_pattern_of_letters_reads_as_its_layer_types() -> None:
    """EXAONE 4's published configs write their pattern in letters ("LLLG": three local layers,
    then a global one without a rotation)."""
    d = {**COMMON, "num_hidden_layers": 8, "architectures": ["Exaone4ForCausalLM"], "sliding_window": WINDOW}
    config = config_from_hf_dict({**d, "sliding_window_pattern": "LLLG"})
    windowed = [config.window_of(i) is not None for i in range(8)]
    assert windowed == [True, True, True, False] * 2
    assert [config.rope_of(i) is not None for i in range(8)] == windowed
    assert config == config_from_hf_dict({**d, "sliding_window_pattern": 4})


def test_a_sliding_window_changes_the_outputs() -> None:
    """The window is not a no-op here: without it the same weights continue differently."""
    d = {**COMMON, "architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": WINDOW}
    windowed = config_from_hf_dict(d)
    full = config_from_hf_dict({**d, "sliding_window": None})
    assert (windowed.sliding_window, full.sliding_window) == (WINDOW, None)
    torch.manual_seed(2)
    model = LlamaForCausalLM(windowed).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.3)
    with_window, _ = ours_greedy(model, prompt(37, 5), 16, prompt(11, 6))
    model.model.layer_windows = [None] * windowed.num_layers
    without, _ = ours_greedy(model, prompt(37, 5), 16, prompt(11, 6))
    assert with_window != without


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}, "DeepseekV3ForCausalLM"),
        (
            {"architectures": ["Gemma3ForCausalLM"], "use_bidirectional_attention": True},
            "use_bidirectional_attention",
        ),
        (
            {"architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}},
            "dynamic",
        ),
        (
            {"architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
            "original_max_position_embeddings",
        ),
        (
            {
                "architectures": ["Gemma2ForCausalLM"],
                "sliding_window": WINDOW,
                "layer_types": ["sliding_attention"],
            },
            "layer_types",
        ),
        ({"architectures": ["LlamaForCausalLM"], "hidden_act": "gelu"}, "hidden_act"),
        ({"architectures": ["LlamaForCausalLM"], "mlp_bias": True}, "mlp_bias"),
    ],
)
def test_what_is_not_supported_is_refused_by_name(override: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        config_from_hf_dict({**COMMON, **override})


# ---- served ----------------------------------------------------------------------------------

SERVED = ("mistral-sliding-window", "qwen2", "qwen3", "gemma3", "phi3", "qwen3-moe")


def write_char_tokenizer(directory: pathlib.Path) -> None:
    """A tokenizer.json of one token per printable character, VOCAB ids in all."""
    chars = [chr(c) for c in range(33, 33 + VOCAB - 3)]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tokenizer.save(str(directory / "tokenizer.json"))


async def greedy_stream(address: str, ids: list[int], n: int) -> list[int]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = pb.GenerateRequest(
            input_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(max_new_tokens=n, ignore_eos=True)
        )
        return [t async for r in stub.Generate(request, timeout=CALL_TIMEOUT_S) for t in r.token_ids]


@pytest.mark.parametrize("kind", SERVED)
def test_served_greedy_streams_equal_transformers(kind: str, tmp_path: pathlib.Path) -> None:
    hf_model = hf_checkpoint(kind, tmp_path / kind)
    write_char_tokenizer(tmp_path / kind)
    prompts = [prompt(30 + 7 * i, seed=20 + i) for i in range(3)]
    expected = [hf_greedy(hf_model, p, 20)[0] for p in prompts]
    with serving_pair(["--model", str(tmp_path / kind)], ["--mode", "overlap"]) as (_, scheduler):

        async def all_at_once() -> list[list[int]]:
            return list(await asyncio.gather(*(greedy_stream(scheduler.address, p, 20) for p in prompts)))

        assert asyncio.run(all_at_once()) == expected
