"""Pick the compute dtype for the model weights and the KV cache.

"auto" uses bfloat16 only where the hardware computes it natively (CUDA, or a CPU with
AVX512-BF16/AMX); elsewhere bfloat16 is emulated and slower than float32."""

from __future__ import annotations

from pathlib import Path

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CPU_BF16_FLAGS = {"avx512_bf16", "amx_bf16"}


def cpu_has_native_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """True when the CPU advertises bfloat16 arithmetic (read from /proc/cpuinfo flags)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            return bool(_CPU_BF16_FLAGS & set(line.split(":", 1)[1].split()))
    return False


def resolve_dtype(name: str, device: str | torch.device) -> torch.dtype:
    """Map a config dtype name ("auto" | "float32" | "bfloat16" | "float16") to a torch dtype."""
    if name != "auto":
        if name not in _DTYPES:
            raise ValueError(f"unknown dtype {name!r}; expected auto, {', '.join(_DTYPES)}")
        return _DTYPES[name]
    if torch.device(device).type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
