"""Which attention path a worker runs (``--attention-backend``), decided once at start.

- ``sdpa``: attention.py's gathered torch paths. On CUDA, torch's SDPA over each
  sequence's blocks gathered into a padded copy; on the CPU, the CPU paths (the compiled
  decode kernel, the blocked or SDPA prefill: ``--cpu-attention``,
  ``--cpu-prefill-attention``).
- ``xformers``: on CUDA, one xformers call per layer over the gathered blocks; a batch of
  a windowed or soft-capped model takes the SDPA path (xformers applies neither). Not
  over xformers' paged biases, which no kernel of the xformers memserve installs
  (0.0.35) runs at a block size of 16: its flash operator is, without the flash_attn
  package, PyTorch's flash kernel, which reads no block table; the flash_attn package's
  paged kernels take pages of a multiple of 256 tokens; its Triton split-K operator
  takes pages of a multiple of 64 and one query length for the whole batch (decode rows
  alone). The Triton kernel below is the paged path.
- ``triton``: the Triton kernel that reads K/V in place through the block tables
  (triton_attention.py, given the step by triton_batch.py).

``auto`` is, on CUDA, the first of them that loads: triton where it imports and the GPU
is an Ampere or newer (Hopper for an FP8 cache: triton has no e4m3 before), else xformers
where it imports, else sdpa; on the CPU, sdpa. The order puts the path that reads K/V in
place before those that gather it every layer; no GPU timing backs it yet (the Triton
path has not run on a GPU). On the CPU, triton is Triton's interpreter, which
runs the kernel as Python, far too slowly to serve: it is what the CPU tests check the
kernel with, so it runs only where TRITON_INTERPRET=1 was set before triton was imported
(triton reads it then), and a worker asked for it otherwise refuses to start.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys

import torch

from memserve.config import ATTENTION_BACKENDS, EngineConfig, attention_backend_name

log = logging.getLogger(__name__)

_TRUE = ("1", "true", "on", "yes")  # what triton reads as a true TRITON_INTERPRET


def resolve_attention_backend(cfg: EngineConfig, device: torch.device, head_dim: int, dtype: torch.dtype) -> str:
    """The backend (sdpa, xformers or triton) a worker of ``cfg`` on ``device`` runs for a
    model of ``head_dim`` computing in ``dtype``, logged. Raises ValueError, naming the flag
    and why, for a backend that cannot run here."""
    fp8_cache = cfg.kv_cache_dtype != "auto"  # fp8 and fp8_e4m3 are both float8_e4m3fn
    backend = choose_attention_backend(cfg.attention_backend, device, head_dim, dtype, fp8_cache)
    log.info("attention backend: %s (--attention-backend %s)", backend, cfg.attention_backend)
    return backend


def choose_attention_backend(choice: str, device: torch.device, head_dim: int, dtype: torch.dtype,
                             fp8_cache: bool = False) -> str:
    """``resolve_attention_backend``'s rule, for ``choice`` (one of ATTENTION_BACKENDS, or
    vLLM's spelling of one) and whether the KV cache is FP8."""
    choice = attention_backend_name(choice)  # EngineConfig's field may hold vLLM's spelling
    if choice not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown --attention-backend {choice!r}; expected one of {', '.join(ATTENTION_BACKENDS)}")
    if choice == "auto":
        if device.type != "cuda":
            return "sdpa"
        if triton_unfit(device, head_dim, dtype, fp8_cache) is None:
            return "triton"
        return "xformers" if xformers_loads() else "sdpa"
    if choice == "xformers" and (device.type != "cuda" or not xformers_loads()):
        raise ValueError("--attention-backend xformers needs a CUDA GPU and xformers installed: "
                         "use --attention-backend auto or sdpa")
    if choice == "triton":
        reason = triton_unfit(device, head_dim, dtype, fp8_cache)
        if reason is not None:
            raise ValueError(f"--attention-backend triton cannot run here: {reason}")
    return choice


def triton_unfit(device: torch.device, head_dim: int, dtype: torch.dtype, fp8_cache: bool) -> str | None:
    """Why the Triton kernel cannot serve this model on ``device``; None where it can. On
    the CPU, TRITON_INTERPRET is read before triton is imported: a worker refused for want
    of it never imports triton."""
    if head_dim < 16:
        return f"the head dim {head_dim} is under 16, the smallest tile of tl.dot"
    if device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET", "").lower() not in _TRUE:
            return ("on the CPU the kernel runs only under Triton's interpreter, for tests (TRITON_INTERPRET=1 "
                    "set before start); serve with --attention-backend auto or sdpa")
        if dtype == torch.bfloat16:
            return "Triton's interpreter computes no bfloat16 arithmetic: use --dtype float32 or float16"
    elif device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 0):
            return f"it needs an Ampere or newer GPU (compute capability 8.0), this one has {capability}"
        if fp8_cache and capability < (9, 0):
            return "an FP8 KV cache needs a Hopper or newer GPU (triton has no float8_e4m3 before)"
    else:
        return f"it runs on CUDA GPUs, not on {device.type}"
    try:
        importlib.import_module("triton")
    except ImportError:
        return "triton is not installed"
    if device.type == "cpu" and not _interpreted():
        return "triton was imported in this process before TRITON_INTERPRET=1 was set, so it compiles for GPUs"
    return None


def _interpreted() -> bool:
    """Whether triton's own library was decorated for its interpreter, which it decides
    once, as triton is imported."""
    from triton.runtime.interpreter import InterpretedFunction  # type: ignore[import-untyped, import-not-found, unused-ignore]

    return isinstance(sys.modules["triton.language.standard"].cdiv, InterpretedFunction)


def xformers_loads() -> bool:
    """Whether attention.py imported xformers' attention (installed, and built for this torch)."""
    from memserve.workers.model.attention import xformers_available

    return xformers_available()
