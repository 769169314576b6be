"""transformers' own loading of the smollm2 GGUF: the reference the worker's model is checked with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from worker_svc.gguf import smollm2_path


@dataclass(frozen=True)
class Transformers:
    model: Any  # transformers.LlamaForCausalLM, float32
    tokenizer: Any  # transformers' tokenizer converted from the GGUF metadata


def load_transformers() -> Transformers:
    import transformers

    path = smollm2_path()
    model: Any = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    model.eval()
    # NOTE: so that generate() runs the full length past EOS, as the comparisons need.
    model.generation_config.eos_token_id = None
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return Transformers(model, tokenizer)
