from __future__ import annotations

import pytest
import torch

from tests.smollm2 import Transformers, load_transformers
from worker_svc.gguf import SMOLLM2_NAME, GGUFModel, load_gguf, smollm2_path
from worker_svc.model import store_weights_input_major


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def smollm2() -> GGUFModel:
    """SmolLM2-135M-Instruct as the worker loads it (float32, CPU), once per test session."""
    loaded = load_gguf(smollm2_path(), torch.float32, torch.device("cpu"), SMOLLM2_NAME)
    store_weights_input_major(loaded.model)
    return loaded


@pytest.fixture(scope="session")
def smollm2_transformers() -> Transformers:
    """transformers' model and tokenizer of the same file (float32), once per test session."""
    return load_transformers()
