"""Rotary position embeddings (RoPE) for Llama-family models.

Frequencies follow the Hugging Face definitions so that our logits match transformers.
All supported variants rotate by a fixed angle per position, so rotating an already
rotated key by ``delta`` positions moves it to ``position + delta``: that is how cached
keys are re-positioned when a truncated conversation reuses its cache."""

from __future__ import annotations

import math
from typing import Any

import torch

from memserve.workers.model.model_config import SUPPORTED_ROPE_TYPES


def inverse_frequencies(rope_parameters: dict[str, Any], rotary_dim: int) -> torch.Tensor:
    """float32 inverse frequencies [rotary_dim // 2] for ``rope_parameters`` (see model_config)."""
    rope_type = rope_parameters["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})")
    base = rope_parameters["rope_theta"]
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim
    inv_freq = 1.0 / (base**exponents)
    if rope_type == "linear":
        return inv_freq / rope_parameters["factor"]
    if rope_type == "llama3":
        return _llama3_frequencies(inv_freq, rope_parameters)
    return inv_freq


def _llama3_frequencies(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by ``factor``, blend in between."""
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_context = p["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """Computes cos/sin for arbitrary (even negative) positions and rotates q/k with them.

    Not an ``nn.Module``: the frequencies are derived from the config, not weights, and
    are copied to each device on first use."""

    def __init__(self, rope_parameters: dict[str, Any], rotary_dim: int):
        self._inv_freq = inverse_frequencies(rope_parameters, rotary_dim)
        self._by_device: dict[torch.device, torch.Tensor] = {}

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, rotary_dim] for positions [T], broadcastable over heads."""
        inv_freq = self._by_device.get(positions.device)
        if inv_freq is None:
            inv_freq = self._by_device.setdefault(positions.device, self._inv_freq.to(positions.device))
        freqs = positions[:, None].float() * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] (rotate-half convention, as in Hugging Face weights).
    With cos/sin narrower than the head (partial rotary, Phi-3/4), only its leading
    ``cos.shape[-1]`` dimensions are rotated; the rest pass through unchanged."""
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)
    half = rotary_dim // 2
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated_half * sin
