from __future__ import annotations

import os

# One torch thread in each test process and in each service it starts: the suite runs several
# processes at once (pytest-xdist workers, the services they start), and torch's default of a
# thread per core then oversubscribes the cores, its idle threads spinning for CPU that the
# other processes need. Set before torch is imported, so that children inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from typing import Any

import pytest
import torch

from tests.smollm2 import Transformers, load_tokenizer, load_transformers
from worker_svc.gguf import SMOLLM2_NAME, GGUFModel, load_gguf, smollm2_path
from worker_svc.layers import use_weight_side_products


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def smollm2() -> GGUFModel:
    """SmolLM2-135M-Instruct as the worker loads it (float32, CPU), once per test session."""
    loaded = load_gguf(smollm2_path(), torch.float32, torch.device("cpu"), SMOLLM2_NAME)
    use_weight_side_products(loaded.model)
    return loaded


@pytest.fixture(scope="session")
def smollm2_transformers() -> Transformers:
    """transformers' model and tokenizer of the same file (float32), once per test session."""
    return load_transformers()


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> Any:
    """transformers' tokenizer of the same file, once per test session."""
    return load_tokenizer()
