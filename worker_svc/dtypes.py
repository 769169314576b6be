"""The worker's dtype: what `--dtype` names, the default of each device, and why.

On the CPU the default is float32, the exact mode: token for token transformers' (the tests hold
it so). bfloat16 halves the bytes a decode step reads and runs on the processor's bf16 matrix
units where it has them (`avx512_bf16`, AMX), but its greedy tokens drift from float32's, so it
is asked for, not assumed. `--quantization int4|int8` (worker_svc.quantization) keeps the weights
quantized, on the CPU only, and computes in float32 with Stepahead's own kernels where they can be
had (worker_svc.cpu_kernels), else (or with `--dtype bfloat16`) in bfloat16 with torch's; the
default's log line names it where torch's int4 kernel is vectorized. On CUDA the default is
bfloat16 (tensor cores, half the memory).
"""

from __future__ import annotations

import torch

from worker_svc import cpu_kernels

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
# vLLM's other spellings of --dtype: `auto` is the default choice (None), the others names above.
DTYPE_SPELLINGS: dict[str, str | None] = {"auto": None, "half": "float16", "float": "float32"}


def dtype_name(value: str) -> str | None:
    """--dtype's value as a name of DTYPES (None: the default for the device); ValueError else."""
    if value in DTYPES:
        return value
    if value in DTYPE_SPELLINGS:
        return DTYPE_SPELLINGS[value]
    raise ValueError(f"choose from {', '.join([*DTYPES, *DTYPE_SPELLINGS])}, got {value!r}")


def cpu_bf16_units() -> list[str]:
    """The bf16 matrix units of this processor, as torch's CPU backend sees them."""
    units = []
    if torch.cpu._is_avx512_bf16_supported():
        units.append("avx512_bf16")
    if torch.cpu._is_amx_tile_supported():
        units.append("AMX")
    return units


# torch's CPU builds whose int4 kernel is vectorized (torch.backends.cpu.get_cpu_capability())
VECTORIZED_INT4 = ("AVX2", "AVX512")


def cpu_vector_isa() -> str:
    """The instruction set torch's CPU kernels run with here (e.g. AVX512, AVX2, DEFAULT)."""
    return str(torch.backends.cpu.get_cpu_capability())


def choose_dtype(
    requested: str | None, device: torch.device, quantization: str = "none"
) -> tuple[torch.dtype, str]:
    """The dtype for `device` (`requested`: --dtype, None for the default) and a sentence on why,
    for the start-up log; ValueError where --quantization rules it out."""
    if quantization != "none":
        return _quantized_dtype(requested, device, quantization)
    if device.type != "cpu":
        name = requested or "bfloat16"
        return DTYPES[name], f"{name} on {device.type}" + ("" if requested else " (the default there)")
    units = cpu_bf16_units()
    if requested is None:
        hints = []
        if cpu_vector_isa() in VECTORIZED_INT4:
            hints.append("--quantization int4 is faster (4-bit weights: a Q4 GGUF's as stored), not exact")
        if units:
            hints.append(f"this CPU has {' and '.join(units)}: --dtype bfloat16 is faster at large batches")
        hint = "".join(f"; {h}" for h in hints)
        return torch.float32, f"float32 on the CPU (the default: exact, token for token transformers'){hint}"
    if requested in ("bfloat16", "float16") and not units:
        return DTYPES[requested], (
            f"{requested} on the CPU as asked; this CPU has no bf16 matrix units (avx512_bf16, AMX): "
            "it is computed in emulation and may be slower than float32"
        )
    return DTYPES[requested], f"{requested} on the CPU as asked"


# What --quantization computes in: float32 on Stepahead's kernels, bfloat16 on torch's
QUANTIZED_DTYPES = ("float32", "bfloat16")


def quantized_dtype_refusal(quantization: str, requested: str | None) -> str | None:
    """Why --quantization cannot compute in --dtype `requested` (None where it can)."""
    if requested is None or requested in QUANTIZED_DTYPES:
        return None
    return (
        f"--quantization {quantization}: computes in float32 (Stepahead's kernels) or bfloat16 "
        f"(torch's), not --dtype {requested}"
    )


def _quantized_dtype(
    requested: str | None, device: torch.device, quantization: str
) -> tuple[torch.dtype, str]:
    if device.type != "cpu":
        raise ValueError(f"--quantization {quantization}: CPU only (its kernels are the CPU's)")
    refusal = quantized_dtype_refusal(quantization, requested)
    if refusal is not None:
        raise ValueError(refusal)
    why_not = cpu_kernels.unavailable()
    if requested == "bfloat16" or (requested is None and why_not is not None):
        because = "as asked" if requested else f"Stepahead's CPU kernels are not used here: {why_not}"
        return torch.bfloat16, (
            f"{quantization} weights with bfloat16 activations on the CPU, torch's kernels ({because})"
        )
    if why_not is not None:
        raise ValueError(f"--quantization {quantization} --dtype float32: no CPU kernels here ({why_not})")
    return torch.float32, (
        f"{quantization} weights with float32 activations on the CPU, Stepahead's kernels "
        f"(--quantization {quantization}; --dtype bfloat16 for torch's)"
    )
