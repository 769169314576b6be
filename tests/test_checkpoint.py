"""A Llama-style checkpoint written by the test is loaded and served over gRPC."""

from __future__ import annotations

import asyncio
import json
import pathlib

import grpc
import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from scheduler_svc.frontend.tokenizer import HFTokenizer
from stepahead.processes import serving_pair
from stepahead.v1 import generation_pb2 as pb
from stepahead.v1 import generation_pb2_grpc
from tests.harness import WorkItem, params, serve_workload
from tests.live import CALL_TIMEOUT_S, server_info

HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE = 64, 2, 4, 2, 128
CORPUS = ["hello world", "the quick brown fox jumps over the lazy dog", "héllo wörld 你好"] * 20


def write_tokenizer(directory: pathlib.Path) -> int:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    return int(tokenizer.get_vocab_size())


def write_checkpoint(directory: pathlib.Path) -> None:
    vocab = write_tokenizer(directory)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    (directory / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)
    head_dim = HIDDEN // HEADS

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.1

    weights = {
        "model.embed_tokens.weight": rand(vocab, HIDDEN),
        "model.norm.weight": torch.ones(HIDDEN),
        "lm_head.weight": rand(vocab, HIDDEN),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": rand(HEADS * head_dim, HIDDEN),
            p + "self_attn.k_proj.weight": rand(KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.v_proj.weight": rand(KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.o_proj.weight": rand(HIDDEN, HEADS * head_dim),
            p + "mlp.gate_proj.weight": rand(INTERMEDIATE, HIDDEN),
            p + "mlp.up_proj.weight": rand(INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": rand(HIDDEN, INTERMEDIATE),
            p + "input_layernorm.weight": torch.ones(HIDDEN),
            p + "post_attention_layernorm.weight": torch.ones(HIDDEN),
        }
    save_file(weights, str(directory / "model.safetensors"))


async def generate(address: str, text: str, n: int) -> list[pb.GenerateResponse]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = pb.GenerateRequest(text=text, sampling=pb.SamplingParams(max_new_tokens=n, ignore_eos=True))
        return [r async for r in stub.Generate(request, timeout=CALL_TIMEOUT_S)]


def test_checkpoint_is_loaded_and_served(tmp_path: pathlib.Path) -> None:
    checkpoint = tmp_path / "tiny-llama"
    checkpoint.mkdir()
    write_checkpoint(checkpoint)
    tokenizer = HFTokenizer((checkpoint / "tokenizer.json").read_bytes())
    prompt = "hello wörld"
    item = WorkItem("ref", tokenizer.encode(prompt), params(20, ignore_eos=True), 0.0)
    reference, _, _ = asyncio.run(serve_workload(str(checkpoint), "serial", [item]))

    with serving_pair(["--model", str(checkpoint)]) as (_, scheduler):
        info = asyncio.run(server_info(scheduler.address))
        assert (info.model, info.tokenizer, info.vocab_size) == ("tiny-llama", "hf", tokenizer.vocab_size)
        assert info.max_context_len == 512 and list(info.eos_token_ids) == [1]
        stream = asyncio.run(generate(scheduler.address, prompt, 20))
    ids = [t for r in stream for t in r.token_ids]
    assert ids == reference["ref"].token_ids
    assert stream[-1].prompt_tokens == len(item.prompt_ids)
    assert "".join(r.text for r in stream) == tokenizer.decode(ids)


def test_a_broken_checkpoint_stops_the_worker_with_the_reason(tmp_path: pathlib.Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with (
        pytest.raises(RuntimeError, match=r"exited with 1(.|\n)*unsupported architecture"),
        serving_pair(["--model", str(tmp_path)]),
    ):
        pass
