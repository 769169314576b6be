"""transformers' own loading of the smollm2 GGUF: the reference the worker's model is checked with.

transformers dequantizes the GGUF in Python (about 25 s for the model on a machine of this kind, 4 s
for the tokenizer), so what it loads is saved once with its own `save_pretrained` under
`.cache/tests/` (or $STEPAHEAD_TEST_CACHE), keyed by the file and the transformers version, and
later loads (other pytest-xdist workers, later runs) read that copy. A file lock makes concurrent
workers convert it once.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock

from worker_svc.gguf import smollm2_path

CACHE_ROOT = Path(os.environ.get("STEPAHEAD_TEST_CACHE", Path(__file__).parent.parent / ".cache" / "tests"))


@dataclass(frozen=True)
class Transformers:
    model: Any  # transformers.LlamaForCausalLM, float32
    tokenizer: Any  # transformers' tokenizer converted from the GGUF metadata


def _cache_dir(what: str) -> Path:
    import transformers

    path = smollm2_path()
    stat = path.stat()
    key = f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}-transformers-{transformers.__version__}"
    return CACHE_ROOT / key / what


def _cached(what: str, convert: Callable[[Path], Any]) -> Path:
    """The directory `what` is saved in, made once (under a file lock) from the GGUF by `convert`,
    which returns an object with `save_pretrained`; it is saved whole or not at all."""
    cached = _cache_dir(what)
    cached.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cached) + ".lock"):
        if not cached.exists():
            partial = cached.with_name(cached.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            convert(smollm2_path()).save_pretrained(partial)
            partial.rename(cached)
    return cached


def load_tokenizer() -> Any:
    """transformers' tokenizer of the smollm2 GGUF."""
    import transformers

    def convert(path: Path) -> Any:
        return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)

    return transformers.AutoTokenizer.from_pretrained(_cached("tokenizer", convert))


def load_transformers() -> Transformers:
    """transformers' model (float32, eval) and tokenizer of the smollm2 GGUF."""
    import transformers

    def convert(path: Path) -> Any:
        converted: Any = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
        # Dequantized while loading: what it holds are plain float32 weights, saved as such.
        converted.hf_quantizer = None
        del converted.config.quantization_config
        return converted

    cached = _cached("model", convert)
    model: Any = transformers.AutoModelForCausalLM.from_pretrained(cached, dtype=torch.float32)
    model.eval()
    # NOTE: so that generate() runs the full length past EOS, as the comparisons need.
    model.generation_config.eos_token_id = None
    return Transformers(model, load_tokenizer())
