"""A checkpoint directory's other files: its tokenizer (or `--tokenizer`), the end-of-sequence
ids of config.json, generation_config.json and tokenizer_config.json, and `--max-model-len`."""

from __future__ import annotations

import json
import pathlib
import shutil

import openai
import pytest
import tokenizers
import torch

from stepahead.processes import serving_pair
from tests.live import unused_port
from tests.test_checkpoint import write_checkpoint
from worker_svc.backends import load_backend
from worker_svc.loading import load_llama

CPU = torch.device("cpu")


@pytest.fixture
def checkpoint(tmp_path: pathlib.Path) -> pathlib.Path:
    directory = tmp_path / "tiny-llama"
    directory.mkdir()
    write_checkpoint(directory)  # config.json: bos 0, eos 1; a trained byte-level BPE
    return directory


def token_id(directory: pathlib.Path, text: str) -> int:
    found = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json")).token_to_id(text)
    assert found is not None
    return int(found)


def test_a_checkpoint_without_its_tokenizer_is_refused_unless_one_is_given(
    checkpoint: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    elsewhere = tmp_path / "tokenizer-only"
    elsewhere.mkdir()
    shutil.move(checkpoint / "tokenizer.json", elsewhere / "tokenizer.json")
    with pytest.raises(ValueError, match=r"no tokenizer\.json there; .*--tokenizer PATH"):
        load_llama(str(checkpoint), CPU, torch.float32)
    for given in (elsewhere, elsewhere / "tokenizer.json"):  # a directory, or the file itself
        _, spec = load_llama(str(checkpoint), CPU, torch.float32, given)
        assert spec.hf_json == (elsewhere / "tokenizer.json").read_bytes()
    with pytest.raises(ValueError, match=r"--tokenizer .*: no tokenizer\.json there"):
        load_llama(str(checkpoint), CPU, torch.float32, tmp_path / "nothing")


def test_every_end_of_sequence_id_the_files_name_stops_generation(checkpoint: pathlib.Path) -> None:
    """Instruct models name their end-of-turn token outside config.json (Qwen's <|im_end|> in
    generation_config.json and tokenizer_config.json): each counts, as in transformers."""
    hello, world = token_id(checkpoint, "hello"), token_id(checkpoint, "Ġworld")
    (checkpoint / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, hello]}))
    (checkpoint / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": {"content": "Ġworld"}, "bos_token": "</s>", "chat_template": "{{ 'x' }}"})
    )
    llama, spec = load_llama(str(checkpoint), CPU, torch.float32)
    assert llama.config.eos_token_ids == (1, hello, world)
    assert llama.config.bos_token_id == 0  # config.json names one: it stands
    assert spec.chat_template == "{{ 'x' }}"
    config = json.loads((checkpoint / "config.json").read_text())
    del config["bos_token_id"]
    (checkpoint / "config.json").write_text(json.dumps(config))
    llama, _ = load_llama(str(checkpoint), CPU, torch.float32)
    assert llama.config.bos_token_id == 1  # tokenizer_config.json's </s>


def test_max_model_len_cannot_exceed_the_models_context(checkpoint: pathlib.Path) -> None:
    backend = load_backend(str(checkpoint), CPU, torch.float32, 0.0, 0.0, max_model_len=64)
    assert backend.max_context_len == 64
    with pytest.raises(ValueError, match=r"--max-model-len 513: above tiny-llama's context, 512"):
        load_backend(str(checkpoint), CPU, torch.float32, 0.0, 0.0, max_model_len=513)


def test_max_model_len_is_served_reported_and_enforced(checkpoint: pathlib.Path) -> None:
    hello = token_id(checkpoint, "hello")
    (checkpoint / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, hello]}))
    worker = ["--model", str(checkpoint), "--max-model-len", "48"]
    with serving_pair(worker, ["--http-port", str(unused_port())]) as (_, scheduler):
        client = openai.OpenAI(base_url=f"{scheduler.http_url}/v1", api_key="unused", max_retries=0)
        (card,) = client.models.list().data
        assert card.model_extra is not None and card.model_extra["max_model_len"] == 48
        prompt = "the quick brown fox"
        n_prompt = len(tokenizers.Tokenizer.from_file(str(checkpoint / "tokenizer.json")).encode(prompt).ids)
        fits = client.completions.create(
            model=card.id, prompt=prompt, max_tokens=48 - n_prompt, temperature=0
        )
        assert fits.usage is not None and fits.usage.prompt_tokens == n_prompt
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=card.id, prompt=prompt, max_tokens=49 - n_prompt)
        body = refused.value.body
        assert isinstance(body, dict) and body.get("param") == "max_tokens", body
        assert "max_model_len" in refused.value.message and "48" in refused.value.message
        # A greedy completion that meets generation_config.json's end-of-sequence id stops there.
        stops = client.completions.create(
            model=card.id, prompt=prompt, max_tokens=20, temperature=0, logit_bias={str(hello): 100}
        )
        assert stops.choices[0].finish_reason == "stop" and stops.usage is not None
        assert stops.usage.completion_tokens == 1
