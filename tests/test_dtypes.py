"""The worker's dtype: the default of each device, and what it says about the processor."""

from __future__ import annotations

import pytest
import torch

from worker_svc import dtypes
from worker_svc.dtypes import choose_dtype

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize("units", [["avx512_bf16", "AMX"], []])
def test_the_cpu_default_is_exact_and_names_the_faster_choice_where_there_is_one(
    monkeypatch: pytest.MonkeyPatch, units: list[str]
) -> None:
    monkeypatch.setattr(dtypes, "cpu_bf16_units", lambda: units)
    dtype, why = choose_dtype(None, CPU)
    assert dtype == torch.float32 and "exact" in why
    assert ("--dtype bfloat16 is faster at large batches" in why) == bool(units)
    dtype, why = choose_dtype("bfloat16", CPU)
    assert dtype == torch.bfloat16
    assert ("emulation" in why) == (not units)  # no bf16 units: the log says it may be slower


@pytest.mark.parametrize(("isa", "named"), [("AVX512", True), ("AVX2", True), ("DEFAULT", False)])
def test_the_cpu_default_names_int4_where_its_kernel_is_vectorized(
    monkeypatch: pytest.MonkeyPatch, isa: str, named: bool
) -> None:
    monkeypatch.setattr(dtypes, "cpu_vector_isa", lambda: isa)
    dtype, why = choose_dtype(None, CPU)
    assert dtype == torch.float32 and ("--quantization int4 is faster" in why) == named


def test_cuda_defaults_to_bfloat16_and_keeps_what_is_asked() -> None:
    assert choose_dtype(None, CUDA)[0] == torch.bfloat16
    assert choose_dtype("float32", CUDA)[0] == torch.float32


def test_this_processors_units_are_read_from_torch() -> None:
    units = dtypes.cpu_bf16_units()
    assert set(units) <= {"avx512_bf16", "AMX"}
    assert ("AMX" in units) == torch.cpu._is_amx_tile_supported()
