"""memserve's compiled CPU kernels (csrc/), built on first use for the CPU at hand.

torch ships no paged attention for CPU, and reading KV blocks in place from Python costs
an op per block (see attention.py): the decode kernel is a small C++ torch op. Beside it,
the pointwise steps of a layer (RMSNorm, residual add + RMSNorm, SwiGLU's activation,
the rotary embedding with the new K/V's stores) fused into one pass each (csrc/fused_pointwise.cpp), and products
over GGUF-quantized weights as the file stores them (csrc/gguf_linear.cpp). They are built
with torch's extension builder (g++ and ninja) the first time a process asks for it, with
``-march=native``, into a directory named by a hash of the source, the torch version and
installation (each virtual environment its own build, rather than one rebuilt in turns)
and this CPU's model and flags: the home cache outlives moves between machines, and a
binary built for another CPU's instructions could die on this one. Later processes load it from
there in milliseconds. Where the build fails (no compiler), ``available()`` is False,
attention keeps its gather-and-SDPA path and the layers their eager ops; the failure is
logged once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).parent / "csrc" / name
                for name in ("paged_decode.cpp", "fused_pointwise.cpp", "gguf_linear.cpp"))
# Included by the sources: part of what a build is named by.
HEADERS = (Path(__file__).parent / "csrc" / "bf16.h",)
CACHE_DIR = Path(os.environ.get("MEMSERVE_KERNEL_CACHE", Path.home() / ".cache" / "memserve" / "kernels"))
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]  # fast-math: vectorised exp (see the source)

_lock = threading.Lock()
_state: dict[str, bool] = {}


def _cpu_signature() -> str:
    """This CPU's model name and instruction-set flags (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        wanted = [line for line in lines if line.startswith(("model name", "flags"))][:2]
        return "\n".join(wanted)
    except OSError:
        return platform.processor() or platform.machine()


def build_dir() -> Path:
    key = hashlib.sha256(
        b"\0".join([*(source.read_bytes() for source in SOURCES + HEADERS), torch.__version__.encode(), str(Path(torch.__file__).parent).encode(),
                   _cpu_signature().encode(), " ".join(FLAGS).encode()])
    ).hexdigest()[:16]
    return CACHE_DIR / key


def available() -> bool:
    """Build (once per machine) and load the kernels; False where they cannot be built."""
    with _lock:
        if "loaded" not in _state:
            _state["loaded"] = _load()
        return _state["loaded"]


def _load() -> bool:
    from torch.utils import cpp_extension

    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    try:
        cpp_extension.load(name=f"memserve_kernels_{directory.name}", sources=[str(source) for source in SOURCES], extra_cflags=FLAGS,
                           extra_ldflags=["-fopenmp"], build_directory=str(directory), is_python_module=False,
                           verbose=False)
    except Exception as exc:  # no compiler, no ninja, a failed build: keep the torch path
        log.warning("CPU kernels unavailable (%s: %s); decode attention gathers the KV instead, layers run eager ops",
                    type(exc).__name__, str(exc).strip().splitlines()[-1] if str(exc).strip() else "")
        return False
    return True


def paged_decode_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           window: int = 0, softcap: float = 0.0) -> None:
    """out [rows, heads, dim] contiguous, q of its shape with contiguous heads (rows at any
    stride: a view into the fused projection); k_cache, v_cache [blocks, block_size, kv_heads,
    dim] (any strides but the last); block_tables [rows, >= blocks needed] and context_lens
    [rows], int64. Row i attends to the first context_lens[i] tokens of its blocks, or with
    a sliding ``window`` > 0 to the last ``window`` of them; a ``softcap`` > 0 caps each
    scaled score s at softcap * tanh(s / softcap)."""
    torch.ops.memserve.paged_decode_attention(out, q, k_cache, v_cache, block_tables, context_lens, scale, window,
                                              softcap)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
    """``RMSNorm`` of contiguous x [..., width] in one pass (see the source for the rounding)."""
    out = torch.empty_like(x)
    torch.ops.memserve.rms_norm(out, x, weight, eps, unit_offset)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 unit_offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(``RMSNorm`` of x + residual, x + residual) in one pass."""
    out, total = torch.empty_like(x), torch.empty_like(x)
    torch.ops.memserve.add_rms_norm(out, total, x, residual, weight, eps, unit_offset)
    return out, total


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of contiguous x [..., 2 * width] = [gate | up], in one pass."""
    out = x.new_empty(*x.shape[:-1], x.shape[-1] // 2)
    torch.ops.memserve.silu_and_mul(out, x)
    return out


def rotary_write_kv(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, write_blocks: torch.Tensor,
                    write_offsets: torch.Tensor) -> torch.Tensor:
    """The rotary embedding (``rope.apply_rotary``) of qk = [q heads | k heads] [T, heads,
    dim] (contiguous last dim) by cos, sin [T, rotary_dim] in one pass, and in the same
    pass the rotated k heads and v [T, kv_heads, dim] stored into k_cache and v_cache
    [blocks, block_size, kv_heads, dim] at (write_blocks[t], write_offsets[t]), as
    ``attention.write_kv`` stores them (the cache's dtype; FP8 clamped first)."""
    out = torch.empty(qk.shape, dtype=qk.dtype, device=qk.device)
    torch.ops.memserve.rotary_write_kv(out, qk, v, cos, sin, k_cache, v_cache, write_blocks, write_offsets)
    return out


# Activation rows ``gguf_matmul`` takes at once (the kernel's MAX_ROWS).
GGUF_MATMUL_MAX_ROWS = 16


def gguf_matmul(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, activation_bits: int = 32) -> torch.Tensor:
    """x [rows <= GGUF_MATMUL_MAX_ROWS, in] (float32 or bf16) times the GGUF-quantized weight
    rows ``blocks`` [out, row bytes] of ggml type ``ggml_type``, transposed: [rows, out] in
    x's dtype, summed in float32.
    ``activation_bits`` 8: x quantized to int8 per 32-block and integer products (llama.cpp's
    way), 16: two int8 digits, to 1/256 of int8's rounding; for the types in
    ``gguf_int8_types()``, float32 products otherwise (and for 32)."""
    out = x.new_empty(x.shape[0], blocks.shape[0])
    torch.ops.memserve.gguf_matmul(out, x, blocks, ggml_type, activation_bits)
    return out


def gguf_int8_types() -> frozenset[int]:
    """The ggml types ``gguf_matmul`` multiplies with int8 activations on this CPU (it needs
    AVX-512 VNNI): empty where it has none."""
    return frozenset(torch.ops.memserve.gguf_int8_types())


def gguf_dequantize(blocks: torch.Tensor, ggml_type: int, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """The weights [out, in_features] the GGUF blocks hold, in ``dtype`` (float32 or bf16)."""
    out = torch.empty(blocks.shape[0], in_features, dtype=dtype)
    torch.ops.memserve.gguf_dequantize(out, blocks, ggml_type)
    return out
