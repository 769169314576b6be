"""GGUF models: SmolLM2-135M-Instruct against transformers' loading of the same file, a Llama GGUF
written here against the model it was written from, and the worker serving smollm2."""

from __future__ import annotations

import asyncio
import importlib
import json
import pathlib
import random
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, TokenType, dequantize, quantize
from tokenizers import Tokenizer
from tokenizers.implementations.sentencepiece_bpe import SentencePieceBPETokenizer

from scheduler_svc.frontend.tokenizer import REPLACEMENT_CHAR, HFTokenizer
from stepahead.processes import serving_pair
from tests.smollm2 import Transformers
from tests.test_architectures import greedy_stream
from tests.test_checkpoint import write_tokenizer
from tests.test_model import SMALL, prefill_all_logits, random_model
from worker_svc.backends import load_backend
from worker_svc.forward_batch import ForwardBatch
from worker_svc.gguf import GGUFModel, load_gguf
from worker_svc.layers import KVCache
from worker_svc.model import LlamaForCausalLM, ModelConfig
from worker_svc.rotary import rope_inv_freq

CPU = torch.device("cpu")
Q8_0 = GGMLQuantizationType.Q8_0
NEW_TOKENS = 32
# NOTE: float32 on both sides, the same operations up to the order of some reductions: the
# differences measured are below 1e-4, and greedy choices here win by at least 1e-3.
LOGITS_ATOL = 1e-3

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def chatml(user: str) -> str:
    """The smollm2 chat template rendered by hand for one user turn and the assistant's reply."""
    return (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    )


FRANCE = chatml("What is the capital of France?")
PROMPTS = [
    FRANCE,
    chatml("Write a haiku about the sea."),
    "def fibonacci(n):\n",
    "The three largest planets of the solar system are",
    "Le petit prince est un livre écrit par",
]


# ---------------------------------------------------------------------------------------------
# The file's facts


def test_smollm2_config_tokenizer_and_template(smollm2: GGUFModel) -> None:
    config = smollm2.model.config
    shape = (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim)
    assert shape == (30, 576, 9, 3, 64)
    assert (config.intermediate_size, config.vocab_size, config.max_context_len) == (1536, 49152, 8192)
    assert (config.rope_theta, config.bos_token_id, config.eos_token_ids) == (100000.0, 1, (2,))
    assert (
        config.tie_word_embeddings and smollm2.model.lm_head.weight is smollm2.model.model.embed_tokens.weight
    )
    assert HFTokenizer(smollm2.tokenizer_json).vocab_size == 49152
    assert smollm2.chat_template is not None and "<|im_start|>" in smollm2.chat_template


# ---------------------------------------------------------------------------------------------
# Model against transformers


@dataclass
class Rows:
    """Requests run together, one request slot each, over KV slots handed out in shuffled order."""

    seqs: list[list[int]]
    cached: list[int]
    free: list[int]
    req_to_token: torch.Tensor

    @classmethod
    def of(cls, prompts: list[list[int]], steps: int) -> Rows:
        longest = max(map(len, prompts)) + steps
        free = torch.randperm(len(prompts) * longest, generator=torch.Generator().manual_seed(0)).tolist()
        table = torch.zeros(len(prompts), longest, dtype=torch.int64)
        return cls([list(p) for p in prompts], [0] * len(prompts), free, table)

    def next_batch(self) -> ForwardBatch:
        """Every row's tokens not in the KV pool yet: the prompts first, then one token a row."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts: list[int] = []
        for row, seq in enumerate(self.seqs):
            new_slots = [self.free.pop() for _ in seq[self.cached[row] :]]
            self.req_to_token[row, self.cached[row] : len(seq)] = torch.tensor(new_slots)
            starts.append(len(ids))
            ids += seq[self.cached[row] :]
            positions += range(self.cached[row], len(seq))
            slots += new_slots
        counts = [len(seq) - done for seq, done in zip(self.seqs, self.cached, strict=True)]
        self.cached = [len(seq) for seq in self.seqs]
        return ForwardBatch(
            input_ids=torch.tensor(ids),
            positions=torch.tensor(positions),
            out_kv_slots=torch.tensor(slots),
            row_req_slots=torch.arange(len(self.seqs)),
            row_token_starts=starts,
            row_num_tokens=counts,
            row_ctx_lens=list(self.cached),
            sample_token_index=torch.tensor([s + n - 1 for s, n in zip(starts, counts, strict=True)]),
            req_to_token=self.req_to_token,
        )


def greedy_batched(
    model: LlamaForCausalLM, prompts: list[list[int]], steps: int
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy continuations of all prompts at once (one prefill, then decode steps of every row),
    and the logits [rows, vocab] of each step."""
    rows = Rows.of(prompts, steps)
    kv = KVCache.allocate(model.config, len(rows.free), torch.float32, CPU)
    step_logits = []
    for _ in range(steps):
        logits = model(rows.next_batch(), kv)
        step_logits.append(logits)
        for seq, token in zip(rows.seqs, logits.argmax(-1).tolist(), strict=True):
            seq.append(token)
    return [seq[len(p) :] for seq, p in zip(rows.seqs, prompts, strict=True)], step_logits


def transformers_greedy(reference: Transformers, prompt: list[int], steps: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = reference.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False
        )
    tokens: list[int] = out[0, len(prompt) :].tolist()
    return tokens


def transformers_logits(reference: Transformers, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits: torch.Tensor = reference.model(torch.tensor([tokens])).logits[0].float()
    return logits


def test_greedy_tokens_and_logits_match_transformers(
    smollm2: GGUFModel, smollm2_transformers: Transformers
) -> None:
    tokenizer = HFTokenizer(smollm2.tokenizer_json)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    ours, our_logits = greedy_batched(smollm2.model, prompts, NEW_TOKENS)
    for row, prompt in enumerate(prompts):
        # transformers over the prompt and our continuation: its greedy choice after every prefix.
        expected = transformers_logits(smollm2_transformers, prompt + ours[row][:-1])[len(prompt) - 1 :]
        assert expected.argmax(-1).tolist() == ours[row], PROMPTS[row]
        logits = torch.stack([step[row] for step in our_logits])
        torch.testing.assert_close(logits[0], expected[0], atol=LOGITS_ATOL, rtol=0)
        torch.testing.assert_close(logits, expected, atol=LOGITS_ATOL, rtol=0)
    # And transformers' own generate loop, with its KV cache, on the first prompt.
    assert transformers_greedy(smollm2_transformers, prompts[0], NEW_TOKENS) == ours[0]
    assert "Paris" in tokenizer.decode(ours[0])


# ---------------------------------------------------------------------------------------------
# Tokenizer against transformers

PLAIN_TEXTS = [
    "",
    "Hello, my name is",
    "I'm sure they'll say it's fine, don't you think? We've seen it.",
    "héllo wörld — naïve café, Ærøskøbing, Straße, façade",
    "你好\uff0c世界\uff01日本語のテキスト、한국어 텍스트, Привет мир, مرحبا بالعالم, שלום",
    "emoji 😀👍🏽 👨\u200d👩\u200d👧\u200d👦 🇫🇷 ❤️ 🎉🎉🎉",
    "digits 0 1 22 333 4444 55555 3.14159 -1e-10 2024-06-01 +33 (0)1 42 68 53 00 v1.2.3 x86_64",
    "    leading spaces, inner   runs\t\ttabs\n\n\nnewlines  \r\n and trailing   ",
    "def f(x):\n    return [i * 2 for i in range(x)]  # doubled\n\nclass A:\n\tpass\n",
    '{"key": [1, 2, 3], "nested": {"a": null, "b": true}, "s": "a\\nb"}',
    "SELECT name, COUNT(*) FROM users WHERE age >= 18 GROUP BY name;",
    "\u200bzero\u00a0width and non-breaking\u3000spaces, \x00 nul, \x7f del",
]
WITH_SPECIAL_TOKENS = [
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>tail <repo_name>x<file_sep>y",
]
CORPUS = PLAIN_TEXTS + WITH_SPECIAL_TOKENS
# NOTE: where two or more whitespace characters precede a digit, the split of transformers'
# GGUF tokenizer (GPT-2's) and that of llama.cpp's `smollm` pre-tokenizer (digits first) differ.
WHITESPACE_BEFORE_DIGITS = [
    "x   1",
    "   42",
    "a\n\n1",
    "\t\t3 items",
    "x = [\n    1,\n    2,\n]",
    "total:  \t 7.5",
    "row\r\n\r\n2024",
    "\u00a0\u00a01\u3000\u30002",
    "     1234567890",
]
CODE = [
    "import math\n\n\ndef area(r: float) -> float:\n    if r < 0:\n        raise ValueError(r)\n"
    "    return math.pi * r**2  # 3.14159...\n",
    "for i in range(10):\n    for j in range(i, 100, 7):\n"
    "        print(f'{i:03d} {j:>5}', 0x1F, 1_000_000, 2e-3)\n",
    "class Point:\n\tdef __init__(self, x=0, y=0):\n\t\tself.x, self.y = x, y\n",
    '{\n  "id": 12345,\n  "price": 19.99,\n  "tags": ["a", "b"],\n  "nested": {"ok": true, "n": null}\n}',
    '[{"x":1,"y":-2.5e10},{"x":  3 ,"y":  4}]',
    "#include <stdio.h>\nint main(void) {\n    int a[3] = {1, 2, 3};\n    return a[2] - 3;\n}\n",
    "    \n        \n\t\n",
]
UNICODE = [
    "中文字符测试\uff0c日本語の文章です。漢字とひらがなとカタカナ。",
    "한국어 문장입니다. 我们123个\uff0c第4章",
    "accents: àéîõü ÀÉÎÕÜ ñ ç ø å ł ő ű ş ğ ț",
    "decomposed e\u0301 a\u0308 n\u0303 versus composed é ä ñ",
    "combining Z\u0324\u0354\u0367\u0311a\u0308\u0356\u032d\u0308\u0307l\u036e\u0312g\u030c\u0317o\u0319",
    "RTL: مرحبا بكم في العالم 123, עברית שלום עולם, \u200fmark\u200e \u202eoverride\u202c",
    "Devanagari नमस्ते, Thai สวัสดีครับ, Greek Ελληνικά, Cyrillic ёжик",
    "math \U0001d400\U0001d401 \U0001d538\u2102 \u2200x\u2208\u211d: x² ≥ 0, ∑ᵢ aᵢ ≈ ∞",
]
EMOJI = [
    "👨\u200d👩\u200d👧\u200d👦 family, 👩\u200d💻 coder, 🧑🏽\u200d🚀 astronaut, 🏳️\u200d🌈 flag",
    "flags 🇫🇷🇯🇵🇺🇸🇧🇷 🏴\U000e0067\U000e0062\U000e0073\U000e0063\U000e0074\U000e007f",
    "skin tones 👍🏻👍🏼👍🏽👍🏾👍🏿 keycaps 1️⃣ #️⃣ *️⃣",
    "🙂🙃😉😊😇🥰😍🤩 ✨🔥💯 ☕️ ♥️♠️",
]
SPECIAL = [
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2 + 2 =<|im_end|>\n",
    "text<|im_end|><|im_end|>  <|im_start|>  <|endoftext|>\n",
]


def random_texts(count: int, seed: int) -> list[str]:
    alphabet = [*"ab Z09 \n\t.,'é你😀", "  ", "\n\n", "<|im_end|>"]
    rng = random.Random(seed)
    return ["".join(rng.choices(alphabet, k=rng.randint(1, 40))) for _ in range(count)]


TOKENIZER_TEXTS = {
    "corpus": CORPUS,
    "whitespace_before_digits": WHITESPACE_BEFORE_DIGITS,
    "code": CODE,
    "unicode": UNICODE,
    "emoji": EMOJI,
    "special": SPECIAL,
    "random": random_texts(300, seed=1),
}


@pytest.mark.parametrize("texts", TOKENIZER_TEXTS.values(), ids=TOKENIZER_TEXTS.keys())
def test_tokenizer_matches_transformers(
    smollm2: GGUFModel, smollm2_transformers: Transformers, texts: list[str]
) -> None:
    ours = HFTokenizer(smollm2.tokenizer_json)
    raw = Tokenizer.from_str(smollm2.tokenizer_json.decode())
    reference = smollm2_transformers.tokenizer
    for text in texts:
        ids = ours.encode(text)
        assert ids == reference.encode(text), repr(text)
        assert raw.decode(ids, skip_special_tokens=False) == text, repr(text)
        assert reference.decode(ids) == text, repr(text)


def test_incremental_decoding_emits_whole_characters(smollm2: GGUFModel) -> None:
    tokenizer = HFTokenizer(smollm2.tokenizer_json)
    for text in [*PLAIN_TEXTS, *UNICODE, *EMOJI]:
        decoder = tokenizer.new_decoder()
        chunks = [decoder.push([token]) for token in tokenizer.encode(text)]
        chunks.append(decoder.flush())
        assert "".join(chunks) == text
        assert not any(REPLACEMENT_CHAR in chunk for chunk in chunks), text


# ---------------------------------------------------------------------------------------------
# A Llama GGUF written here

# NOTE: every matrix row a multiple of Q8_0's 32-value block; eps exact in float32 as GGUF stores it.
GGUF_SMALL = replace(SMALL, vocab_size=0, intermediate_size=64, rms_norm_eps=2.0**-17, name="small")


def permute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's converter: each head's rows from halves order to interleaved pairs order."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, 2, half, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
GGUF_BLOCK_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(name: str) -> str:
    if name in GGUF_NAMES:
        return GGUF_NAMES[name]
    _, _, layer, rest = name.split(".", 3)
    module, _, suffix = rest.rpartition(".")
    return f"blk.{layer}.{GGUF_BLOCK_NAMES[module]}.{suffix}"


def write_llama_gguf(
    path: pathlib.Path,
    model: LlamaForCausalLM,
    tokenizer_json: dict[str, object],
    architecture: str = "llama",
    tokenizer: tuple[str, str] = ("gpt2", "default"),
    sentencepiece: list[tuple[str, float, int]] | None = None,
) -> dict[str, torch.Tensor]:
    """The model as llama.cpp's converter writes it: matrices Q8_0, norms and biases F32, q/k rows
    permuted for `llama` (not for the Qwen architectures); a SentencePiece vocabulary when no
    tokenizer.json is given.
    Returns the model's weights as the file holds them once dequantized, in the model's layout
    (Q8_0 rounds each row on its own, so rounding and the row permutation commute)."""
    cfg = model.config
    writer = GGUFWriter(path, architecture)
    add_shape(writer, cfg)
    if tokenizer_json:
        add_tokenizer(writer, tokenizer_json, *tokenizer)
    else:
        add_sentencepiece_tokenizer(writer, sentencepiece)
    if cfg.rope_factors is not None:
        writer.add_tensor("rope_freqs.weight", np.array(cfg.rope_factors, dtype=np.float32))
    stored = {}
    for name, weight in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:  # the file holds it once
            continue
        if weight.ndim == 1:
            if architecture == "llama" and name.endswith(("q_proj.bias", "k_proj.bias")):
                heads = cfg.num_heads if "q_proj" in name else cfg.num_kv_heads
                writer.add_tensor(gguf_name(name), permute_rotary_rows(weight, heads).numpy())
            else:
                writer.add_tensor(gguf_name(name), weight.numpy())
            stored[name] = weight
            continue
        if architecture == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_heads if name.endswith("q_proj.weight") else cfg.num_kv_heads
            weight = permute_rotary_rows(weight, heads)
        writer.add_tensor(gguf_name(name), quantize(weight.numpy(), Q8_0), raw_dtype=Q8_0)
        stored[name] = torch.from_numpy(dequantize(quantize(model.state_dict()[name].numpy(), Q8_0), Q8_0))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


def add_shape(writer: GGUFWriter, cfg: ModelConfig) -> None:
    """The model's sizes, rotary base and norm epsilon as `{arch}.*` metadata."""
    writer.add_block_count(cfg.num_layers)
    writer.add_context_length(cfg.max_context_len)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if cfg.head_dim != cfg.hidden_size // cfg.num_heads:
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)


def add_tokenizer(writer: GGUFWriter, tokenizer_json: dict[str, object], kind: str, pre: str) -> None:
    model = tokenizer_json["model"]
    assert isinstance(model, dict)
    vocab: dict[str, int] = model["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    writer.add_tokenizer_model(kind)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.CONTROL if t in ("<s>", "</s>") else TokenType.NORMAL for t in tokens])
    writer.add_token_merges([" ".join(pair) for pair in model["merges"]])
    writer.add_bos_token_id(vocab["<s>"])
    writer.add_eos_token_id(vocab["</s>"])
    writer.add_add_bos_token(True)
    writer.add_chat_template("{{ messages[0]['content'] }}")


@pytest.fixture
def small_gguf(tmp_path: pathlib.Path) -> tuple[pathlib.Path, LlamaForCausalLM, dict[str, torch.Tensor]]:
    vocab = write_tokenizer(tmp_path)
    cfg = replace(GGUF_SMALL, vocab_size=vocab)
    model = random_model(cfg, seed=3)
    tokenizer_json = json.loads((tmp_path / "tokenizer.json").read_text())
    stored = write_llama_gguf(tmp_path / "small.gguf", model, tokenizer_json)
    return tmp_path / "small.gguf", model, stored


def test_llama_gguf_loads_as_the_model_it_was_written_from(
    small_gguf: tuple[pathlib.Path, LlamaForCausalLM, dict[str, torch.Tensor]],
) -> None:
    path, model, stored = small_gguf
    backend = load_backend(str(path), CPU, torch.float32, 1.0, 0.0)
    assert (backend.name, backend.eos_token_ids, backend.bos_token_id) == ("small", (1,), 0)
    assert backend.tokenizer.chat_template == "{{ messages[0]['content'] }}"
    loaded = load_gguf(path, torch.float32, CPU).model
    assert loaded.config == replace(model.config, eos_token_ids=(1,), bos_token_id=0)
    weights = loaded.state_dict()
    for name, weight in stored.items():
        assert torch.equal(weights[name], weight), name
    expected = random_model(model.config, seed=0)
    expected.load_state_dict(stored)
    tokens = list(range(0, model.config.vocab_size, 7))
    torch.testing.assert_close(
        prefill_all_logits(loaded, tokens), prefill_all_logits(expected, tokens), atol=0, rtol=0
    )


def test_gguf_tokenizer_matches_the_tokenizer_it_was_written_from(
    small_gguf: tuple[pathlib.Path, LlamaForCausalLM, dict[str, torch.Tensor]],
) -> None:
    path = small_gguf[0]
    original = HFTokenizer((path.parent / "tokenizer.json").read_bytes())
    ours = HFTokenizer(load_gguf(path, torch.float32, CPU).tokenizer_json)
    for text in ["hello world", "the quick brown fox", "héllo wörld 你好", "  two  spaces\n"]:
        assert ours.encode(text) == [0, *original.encode(text)]  # the file asks for BOS
        assert ours.decode(ours.encode(text)) == text


@pytest.mark.parametrize(
    ("architecture", "tokenizer", "message"),
    [
        ("gpt2", ("gpt2", "default"), "unsupported GGUF architecture 'gpt2'"),
        ("llama", ("bert", "default"), "its tokenizer: .*tokenizer 'bert'"),
    ],
)
def test_unsupported_gguf_is_rejected_with_the_reason(
    tmp_path: pathlib.Path, architecture: str, tokenizer: tuple[str, str], message: str
) -> None:
    vocab = write_tokenizer(tmp_path)
    model = random_model(replace(GGUF_SMALL, vocab_size=vocab), seed=4)
    tokenizer_json = json.loads((tmp_path / "tokenizer.json").read_text())
    write_llama_gguf(tmp_path / "bad.gguf", model, tokenizer_json, architecture, tokenizer)
    with pytest.raises(ValueError, match=rf"bad\.gguf: {message}"):
        load_backend(str(tmp_path / "bad.gguf"), CPU, torch.float32, 1.0, 0.0)


def test_a_file_that_is_not_gguf_is_rejected(tmp_path: pathlib.Path) -> None:
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        load_backend(str(tmp_path / "junk.gguf"), CPU, torch.float32, 1.0, 0.0)


# ---- the Llama family's other GGUF architectures, and SentencePiece vocabularies -------------


def llama3_factors(head_dim: int, theta: float) -> tuple[float, ...]:
    """What llama.cpp's converter writes as rope_freqs for Llama 3.1's llama3 scaling."""
    base = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    scaled = rope_inv_freq(replace(GGUF_SMALL, rope_theta=theta, rope_scaling=tuple(sorted(LLAMA3.items()))))
    return tuple(float(f) for f in base / scaled)


LLAMA3: dict[str, float | int | str] = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
FAMILY_GGUF = {
    "llama-rope-freqs": ("llama", {"rope_factors": llama3_factors(8, 10000.0)}),
    "qwen2": ("qwen2", {"qkv_bias": True, "architecture": "qwen2", "tie_word_embeddings": True}),
    "qwen3": ("qwen3", {"qk_norm": True, "head_dim": 16, "architecture": "qwen3"}),
}


@pytest.mark.parametrize("kind", sorted(FAMILY_GGUF))
def test_each_gguf_architecture_loads_as_the_model_it_was_written_from(
    tmp_path: pathlib.Path, kind: str
) -> None:
    architecture, features = FAMILY_GGUF[kind]
    vocab = write_tokenizer(tmp_path)
    cfg = replace(GGUF_SMALL, vocab_size=vocab, **features)  # type: ignore[arg-type]
    model = random_model(cfg, seed=5)
    tokenizer_json = json.loads((tmp_path / "tokenizer.json").read_text())
    stored = write_llama_gguf(tmp_path / f"{kind}.gguf", model, tokenizer_json, architecture)
    loaded = load_gguf(tmp_path / f"{kind}.gguf", torch.float32, CPU).model
    assert loaded.config == replace(model.config, eos_token_ids=(1,), bos_token_id=0, name=kind)
    weights = loaded.state_dict()
    for name, weight in stored.items():
        assert torch.equal(weights[name], weight), name
    expected = random_model(model.config, seed=0)
    expected.load_state_dict(stored, strict=not model.config.tie_word_embeddings)
    tokens = list(range(0, vocab, 7))
    torch.testing.assert_close(
        prefill_all_logits(loaded, tokens), prefill_all_logits(expected, tokens), atol=0, rtol=0
    )


def test_rope_freqs_are_llama3_scaling_precomputed() -> None:
    """A Llama 3.1 GGUF's rope_freqs give the rotary frequencies of the llama3 scaling that
    config.json names (the one tested against transformers)."""
    scaling = tuple(sorted(LLAMA3.items()))
    from_freqs = rope_inv_freq(replace(GGUF_SMALL, rope_factors=llama3_factors(8, 10000.0)))
    from_scaling = rope_inv_freq(replace(GGUF_SMALL, rope_scaling=scaling))
    torch.testing.assert_close(from_freqs, from_scaling, atol=0, rtol=1e-6)
    assert not torch.allclose(from_scaling, rope_inv_freq(GGUF_SMALL))  # the scaling matters here


SPM_CORPUS = [
    "hello world",
    "the quick brown fox jumps over the lazy dog",
    "héllo wörld 你好",
    "  two  spaces",
] * 20


def sentencepiece_vocabulary() -> list[tuple[str, float, int]]:
    """A SentencePiece-style vocabulary as llama.cpp writes one: (piece, score, type), with
    <unk>, <s>, </s>, the 256 byte pieces, then pieces scored by their merge order."""
    trained = SentencePieceBPETokenizer()
    trained.train_from_iterator(
        iter(SPM_CORPUS * 20), vocab_size=200, special_tokens=["<unk>"], show_progress=False
    )
    learned = sorted((t for t in trained.get_vocab() if t != "<unk>"), key=trained.get_vocab().__getitem__)
    pieces: list[tuple[str, float, int]] = [
        ("<unk>", 0.0, int(TokenType.UNKNOWN)),
        ("<s>", 0.0, int(TokenType.CONTROL)),
        ("</s>", 0.0, int(TokenType.CONTROL)),
    ]
    pieces += [(f"<0x{b:02X}>", 0.0, int(TokenType.BYTE)) for b in range(256)]
    pieces += [(piece, -float(i), int(TokenType.NORMAL)) for i, piece in enumerate(learned)]
    return pieces


def add_sentencepiece_tokenizer(writer: GGUFWriter, pieces: list[tuple[str, float, int]] | None) -> None:
    assert pieces is not None
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([p for p, _, _ in pieces])
    writer.add_token_scores([s for _, s, _ in pieces])
    writer.add_token_types([t for _, _, t in pieces])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)


def test_a_sentencepiece_gguf_tokenizes_as_transformers_reads_the_file(tmp_path: pathlib.Path) -> None:
    """Llama 2 and Mistral GGUFs carry a SentencePiece vocabulary (no merges, scores): ours and
    transformers' reading of the same file agree on a varied corpus, BOS included."""
    transformers: Any = importlib.import_module("transformers")
    pieces = sentencepiece_vocabulary()
    model = random_model(replace(GGUF_SMALL, vocab_size=len(pieces)), seed=6)
    write_llama_gguf(tmp_path / "spm.gguf", model, {}, sentencepiece=pieces)
    ours = HFTokenizer(load_gguf(tmp_path / "spm.gguf", torch.float32, CPU).tokenizer_json)
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    texts = [*SPM_CORPUS, *random_texts(40, seed=9), "", " ", "hello\nworld", "x" * 50]
    for text in texts:
        assert ours.encode(text) == reference.encode(text), text
        assert ours.encode(text)[:1] == [1] if text else True  # the file says nothing: BOS, as llama.cpp
        assert ours.decode(ours.encode(text)) == reference.decode(
            reference.encode(text), skip_special_tokens=True
        )


# ---- served, against transformers reading the same file ---------------------------------------

# transformers' GGUF reader takes Qwen3's head_dim from Qwen3Config's default (128), as the Qwen3
# models have it; the file says the same here.
SERVED_GGUF = {
    "qwen2": ("qwen2", {"qkv_bias": True, "architecture": "qwen2", "tie_word_embeddings": True}),
    "qwen3": ("qwen3", {"qk_norm": True, "head_dim": 128, "architecture": "qwen3"}),
}


@pytest.mark.parametrize("kind", sorted(SERVED_GGUF))
def test_served_gguf_greedy_streams_equal_transformers_reading_the_file(
    tmp_path: pathlib.Path, kind: str
) -> None:
    architecture, features = SERVED_GGUF[kind]
    vocab = write_tokenizer(tmp_path)
    model = random_model(replace(GGUF_SMALL, vocab_size=vocab, **features), seed=8)  # type: ignore[arg-type]
    tokenizer_json = json.loads((tmp_path / "tokenizer.json").read_text())
    write_llama_gguf(tmp_path / f"{kind}.gguf", model, tokenizer_json, architecture)
    assert_served_greedy_equals_transformers(tmp_path / f"{kind}.gguf", vocab)


def assert_served_greedy_equals_transformers(path: pathlib.Path, vocab: int) -> None:
    """Three prompts served at once from the GGUF at `path`: each stream's 16 greedy tokens are
    transformers' reading the same file."""
    assert_served_greedy_equals(path, read_by_transformers(path), vocab)


def assert_served_greedy_equals(path: pathlib.Path, reference: Any, vocab: int) -> None:
    """Three prompts served at once from the GGUF at `path`: each stream's 16 greedy tokens are
    those of `reference` (a transformers model)."""
    prompts = [[(17 * i + 5 * j) % vocab for j in range(12 + 5 * i)] for i in range(3)]
    expected = []
    for prompt in prompts:
        sequence = list(prompt)
        with torch.no_grad():
            for _ in range(16):
                sequence.append(int(reference(torch.tensor([sequence])).logits[0, -1].argmax()))
        expected.append(sequence[len(prompt) :])
    with serving_pair(["--model", str(path)]) as (_, scheduler):

        async def streams() -> list[list[int]]:
            return list(await asyncio.gather(*(greedy_stream(scheduler.address, p, 16) for p in prompts)))

        assert asyncio.run(streams()) == expected


def read_by_transformers(path: pathlib.Path) -> Any:
    """transformers' own reading of the GGUF at `path`, in float32: the reference."""
    transformers: Any = importlib.import_module("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
