"""Stepahead's own CPU kernels (`cpu_kernels.c`): linear layers over weights kept at 4 or 8 bits in
blocks of 32 inputs, with float32 activations rounded to 8 bits a block and multiplied on integers
(AVX2). torch's own weight-only kernels read the same weights several times slower at a decode
step's few rows (docs/BENCHMARKS.md, `bench.model_speed`).

The C file is built on first use with the machine's C compiler (`$CC`, else `cc`) into a cache
directory (`$STEPAHEAD_CACHE_DIR`, else `$XDG_CACHE_HOME/stepahead`, else `~/.cache/stepahead`),
one library per source, flags and compiler, and loaded with ctypes after torch: the library's
OpenMP calls then bind to the libgomp torch loaded, so its threads are torch's. A call releases the
GIL for its duration, as a torch operator does.

Where the kernels cannot be had (not x86-64 with AVX2 and FMA, no compiler, a failed build, or
`STEPAHEAD_CPU_KERNELS=off`), `load()` returns None and `unavailable()` says why; the quantized
modes then use torch's kernels (worker_svc.quantization).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = ("-O3", "-std=gnu11", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC")
BLOCK = 32  # inputs sharing a scale: a GGUF Q4_0/Q4_1/Q8_0 block
GROUP = 8  # outputs laid out together (cpu_kernels.c says how)
Q4, Q8 = 4, 8  # the weight kinds the library takes
SWITCH = "STEPAHEAD_CPU_KERNELS"  # "off": torch's kernels only


class KernelError(RuntimeError):
    """The library refused a call (it could not allocate its scratch)."""


@dataclass(frozen=True)
class Kernels:
    """The loaded library."""

    library: ctypes.CDLL
    path: Path

    def linear(
        self,
        kind: int,
        x: torch.Tensor,
        codes: torch.Tensor,
        scale: torch.Tensor,
        minimum: torch.Tensor | None,
        n: int,
    ) -> torch.Tensor:
        """x [m, k] float32 (contiguous) times the transposed weight of `n` outputs, given as `kind`
        (Q4: `pack_q4` codes, `pack_scales` scale and minimum; Q8: `pack_q8` codes, scale, no
        minimum): [m, n] float32."""
        m, k = x.shape
        if kind not in (Q4, Q8) or k % BLOCK or x.dtype != torch.float32:
            raise ValueError(f"stepahead_linear: kind {kind} over a {x.dtype} [{m}, {k}] input")
        out = torch.empty(m, n, dtype=torch.float32)
        if m == 0:
            return out
        rc = self.library.stepahead_linear(
            kind,
            x.data_ptr(),
            m,
            k,
            codes.data_ptr(),
            scale.data_ptr(),
            None if minimum is None else minimum.data_ptr(),
            n,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise KernelError(f"stepahead_linear: out of memory for a [{m}, {k}] input")
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of x [..., n] float32 over its last axis, times `weight` [n]."""
        flat = x.contiguous()
        out = torch.empty_like(flat)
        n = flat.shape[-1]
        self.library.stepahead_rms_norm(
            flat.data_ptr(), weight.data_ptr(), flat.numel() // n, n, eps, out.data_ptr()
        )
        return out

    def decode_attention(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        slots: torch.Tensor,
        valid: torch.Tensor,
    ) -> torch.Tensor:
        """Attention of one query token a row, q [rows, heads, d] float32, over the pools' keys
        [slots, kv_heads, d] at slots [rows, keys] (int64) where valid [rows, keys] (bool):
        [rows, heads * d]."""
        # Held in names for the call: a copy made inside the argument list would be freed before it.
        q, slots, valid = q.contiguous(), slots.contiguous(), valid.contiguous()
        rows, heads, d = q.shape
        keys, kv_heads = slots.shape[1], k_pool.shape[1]
        threads = torch.get_num_threads()
        out = torch.empty(rows, heads * d, dtype=torch.float32)
        scores = torch.empty(threads, keys, dtype=torch.float32)
        self.library.stepahead_decode_attention(
            q.data_ptr(),
            k_pool.data_ptr(),
            v_pool.data_ptr(),
            slots.data_ptr(),
            valid.data_ptr(),
            rows,
            keys,
            heads,
            kv_heads,
            d,
            1.0 / math.sqrt(d),
            out.data_ptr(),
            scores.data_ptr(),
            threads,
        )
        return out

    def rope_store(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        heads: int,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """A fused q/k/v projection's output [tokens, (heads + 2 kv_heads) d] float32 with q and k
        rotated (cos, signed sin [tokens, d], see `layers.apply_rotary`), k and v written to the
        pools [slots, kv_heads, d] at `slots` (int64): q [tokens, heads, d]."""
        qkv, cos, sin, slots = qkv.contiguous(), cos.contiguous(), sin.contiguous(), slots.contiguous()
        tokens = qkv.shape[0]
        kv_heads, d = k_pool.shape[1], k_pool.shape[2]
        q = torch.empty(tokens, heads, d, dtype=torch.float32)
        self.library.stepahead_rope_store(
            qkv.data_ptr(),
            tokens,
            heads,
            kv_heads,
            d,
            cos.data_ptr(),
            sin.data_ptr(),
            slots.data_ptr(),
            q.data_ptr(),
            k_pool.data_ptr(),
            v_pool.data_ptr(),
        )
        return q

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a fused gate/up projection's output [rows, 2 n] float32: [rows, n]."""
        flat = gate_up.contiguous()
        rows, n = flat.shape[0], flat.shape[1] // 2
        out = torch.empty(rows, n, dtype=torch.float32)
        self.library.stepahead_silu_mul(flat.data_ptr(), rows, n, out.data_ptr(), torch.get_num_threads())
        return out


@dataclass(frozen=True)
class PackedWeight:
    """A linear layer's weight as `Kernels.linear` takes it (`pack_q4`/`pack_q8`, `pack_scales`), and
    its float32 bias."""

    kind: int
    codes: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor | None
    bias: torch.Tensor | None
    out_features: int
    in_features: int


class _Weight(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int64),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("codes", ctypes.c_void_p),
        ("scale", ctypes.c_void_p),
        ("minimum", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("eps", ctypes.c_double),
        ("scale", ctypes.c_double),
        ("heads", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("d", ctypes.c_int64),
        ("qkv", _Weight),
        ("o", _Weight),
        ("gate_up", _Weight),
        ("down", _Weight),
    ]


@dataclass(frozen=True)
class LayerWeights:
    """A llama decoder layer's weights as `DecodeLayers` takes them: its q/k/v and gate/up
    projections fused (`LlamaForCausalLM.fuse_projections`), no q/k norms."""

    input_norm: torch.Tensor  # float32 [hidden]
    post_norm: torch.Tensor  # float32 [hidden]
    qkv: PackedWeight
    o: PackedWeight
    gate_up: PackedWeight
    down: PackedWeight


class DecodeLayers:
    """A model's decoder layers on the kernels in one call, for a step whose rows all decode one
    token: the same kernels in the same order as the layers' modules run them, so the same bits,
    without a dozen Python calls a layer. Holds the weights' tensors while it lives."""

    def __init__(
        self,
        kernels: Kernels,
        layers: Sequence[LayerWeights],
        eps: float,
        heads: int,
        kv_heads: int,
        head_dim: int,
    ) -> None:
        self.kernels = kernels
        self._keep = tuple(layers)
        self._layers = (_Layer * len(layers))(
            *(_layer(layer, eps, heads, kv_heads, head_dim) for layer in layers)
        )

    def __call__(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv: tuple[torch.Tensor, torch.Tensor],
        out_slots: torch.Tensor,
        kv_slots: torch.Tensor,
        valid: torch.Tensor,
    ) -> torch.Tensor:
        """The residual stream after the last layer, from x [rows, hidden] float32 (token i row
        i's); rope: cos, signed sin [rows, 1, d]; kv: every layer's pools [layers, slots, kv_heads,
        d] (contiguous); out_slots [rows]: where each row's k and v go; kv_slots, valid [rows,
        keys]: each row's keys and which count."""
        k_pools, v_pools = kv
        if not (k_pools.is_contiguous() and v_pools.is_contiguous()) or k_pools.shape[0] != len(self._layers):
            raise ValueError(f"DecodeLayers: {len(self._layers)} layers over pools {tuple(k_pools.shape)}")
        out = x.contiguous().clone()
        # Held in names for the call (`Kernels.decode_attention` says why)
        cos, sin = rope[0].contiguous(), rope[1].contiguous()
        out_slots, kv_slots, valid = out_slots.contiguous(), kv_slots.contiguous(), valid.contiguous()
        rows, keys = out.shape[0], kv_slots.shape[1]
        rc = self.kernels.library.stepahead_decode_layers(
            self._layers,
            len(self._layers),
            out.data_ptr(),
            rows,
            cos.data_ptr(),
            sin.data_ptr(),
            out_slots.data_ptr(),
            kv_slots.data_ptr(),
            valid.data_ptr(),
            keys,
            k_pools.data_ptr(),
            v_pools.data_ptr(),
            k_pools.stride(0),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise KernelError(f"stepahead_decode_layers: out of memory for {rows} rows")
        return out


def _weight(w: PackedWeight) -> _Weight:
    return _Weight(
        w.kind,
        w.out_features,
        w.in_features,
        w.codes.data_ptr(),
        w.scale.data_ptr(),
        None if w.minimum is None else w.minimum.data_ptr(),
        None if w.bias is None else w.bias.data_ptr(),
    )


def _layer(layer: LayerWeights, eps: float, heads: int, kv_heads: int, head_dim: int) -> _Layer:
    return _Layer(
        layer.input_norm.data_ptr(),
        layer.post_norm.data_ptr(),
        eps,
        1.0 / math.sqrt(head_dim),
        heads,
        kv_heads,
        head_dim,
        _weight(layer.qkv),
        _weight(layer.o),
        _weight(layer.gate_up),
        _weight(layer.down),
    )


def _grouped(t: torch.Tensor) -> torch.Tensor:
    """[n, ...] padded with zeros to whole groups, as [groups, GROUP, ...]."""
    pad = -t.shape[0] % GROUP
    if pad:
        t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
    return t.reshape(-1, GROUP, *t.shape[1:])


def pack_q4(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes uint8 [n, k] (0..15) in the kernels' Q4 layout."""
    c = _grouped(codes).reshape(-1, GROUP, codes.shape[1] // BLOCK, BLOCK).transpose(1, 2)  # [g, b, row, 32]
    low = c[..., : BLOCK // 2].reshape(*c.shape[:3], 4, 4)  # [g, b, row, t, q]
    high = c[..., BLOCK // 2 :].reshape(*c.shape[:3], 4, 4)
    return (low | (high << 4)).transpose(2, 3).reshape(c.shape[0], -1).contiguous()


def pack_q8(codes: torch.Tensor) -> torch.Tensor:
    """8-bit codes int8 [n, k] in the kernels' Q8 layout."""
    c = _grouped(codes).reshape(-1, GROUP, codes.shape[1] // BLOCK, BLOCK // 4, 4)  # [g, row, b, t, q]
    return c.permute(0, 2, 3, 1, 4).reshape(c.shape[0], -1).contiguous()


def pack_scales(scale: torch.Tensor) -> torch.Tensor:
    """Per-block scales or minima float [n, k / 32] in the kernels' layout."""
    return _grouped(scale.float()).transpose(1, 2).reshape(-1, scale.shape[1] * GROUP).contiguous()


def cache_dir() -> Path:
    """Where built libraries are kept."""
    own = os.environ.get("STEPAHEAD_CACHE_DIR")
    if own:
        return Path(own)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "stepahead"


def _cpu_refusal() -> str | None:
    if os.environ.get(SWITCH, "on") == "off":
        return f"{SWITCH}=off"
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"an {platform.machine()} processor (the kernels are x86-64 AVX2)"
    capability = str(torch.backends.cpu.get_cpu_capability())
    if capability not in ("AVX2", "AVX512"):
        return f"this CPU runs torch at {capability}, without AVX2 and FMA"
    return None


def _build(compiler: str) -> Path:
    """The library for this source, flags and compiler, built unless the cache has it."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), version.encode()):
        digest.update(part)
    where = cache_dir()
    target = where / f"cpu_kernels-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    where.mkdir(parents=True, exist_ok=True)
    # Built beside the target, then renamed: processes building at once each get a whole file.
    fd, partial = tempfile.mkstemp(prefix=".cpu_kernels-", suffix=".so", dir=where)
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *FLAGS, "-o", partial, str(SOURCE)], capture_output=True, text=True, timeout=300
        )
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def _declare(library: ctypes.CDLL) -> None:
    p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    library.stepahead_linear.restype = i32
    library.stepahead_linear.argtypes = [i32, p, i64, i64, p, p, p, i64, p, i32]
    library.stepahead_rms_norm.restype = None
    library.stepahead_rms_norm.argtypes = [p, p, i64, i64, f32, p]
    library.stepahead_rope_store.restype = None
    library.stepahead_rope_store.argtypes = [p, i64, i64, i64, i64, p, p, p, p, p, p]
    library.stepahead_silu_mul.restype = None
    library.stepahead_silu_mul.argtypes = [p, i64, i64, p, i32]
    library.stepahead_decode_attention.restype = None
    library.stepahead_decode_attention.argtypes = [p, p, p, p, p, i64, i64, i64, i64, i64, f32, p, p, i32]
    library.stepahead_decode_layers.restype = i32
    library.stepahead_decode_layers.argtypes = [p, i64, p, i64, p, p, p, p, p, i64, p, p, i64, i32]


@functools.cache
def _load() -> tuple[Kernels | None, str | None]:
    refusal = _cpu_refusal()
    if refusal is not None:
        return None, refusal
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        return None, f"no C compiler ({compiler}; set $CC)"
    try:
        path = _build(compiler)
        library = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return None, f"building {SOURCE.name}: {e}"
    _declare(library)
    return Kernels(library, path), None


def load() -> Kernels | None:
    """The kernels, built and loaded once per process; None where they cannot be had."""
    kernels, why = _load()
    if kernels is None:
        log.info("Stepahead's CPU kernels are not used: %s", why)
    return kernels


def unavailable() -> str | None:
    """Why `load()` gives None, or None where it gives the kernels."""
    return _load()[1]
