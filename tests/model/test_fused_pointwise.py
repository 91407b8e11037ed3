"""The fused pointwise CPU kernels against the eager ops they replace (which match
transformers): RMSNorm (Llama's and Gemma's unit offset), the residual add fused with the
next norm, SwiGLU's silu(gate) * up and the rotary embedding (whole and partial) with the K/V
stores, in float32 and bf16, on 1 row and on many
(threaded), widths that are and are not multiples of a vector. bf16 results round where
the eager ops round, so all but a rare value (the order of one float32 sum) are equal
bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from memserve.testing.random_models import save_tiny_model
from memserve.workers.model import cpu_kernels
from memserve.workers.model.attention import AttentionPlan, write_kv
from memserve.workers.model.llama import MLP, Attention, RMSNorm
from memserve.workers.model.loader import load_model
from memserve.workers.model.rope import RotaryEmbedding, apply_rotary

if not cpu_kernels.available():
    pytest.skip("the CPU kernels cannot be built here (no C++ compiler or ninja)", allow_module_level=True)


def same_or_one_rounding(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal in float32 up to float rounding; in bf16 at least 99 % equal bit for bit and
    the rest one bf16 rounding apart."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        return
    assert (got == expected).float().mean() >= 0.99
    torch.testing.assert_close(got.float(), expected.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 333])
@pytest.mark.parametrize("width", [576, 100])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_rms_norm_and_its_residual_add_equal_the_eager_ops(dtype, rows, width, unit_offset):
    gen = torch.Generator().manual_seed(rows + width)
    norm = RMSNorm(width, 1e-5, unit_offset).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width, generator=gen))
    x = (3 * torch.randn(rows, width, generator=gen)).to(dtype)
    residual = torch.randn(rows, width, generator=gen).to(dtype)
    with torch.inference_mode():
        eager, (eager_add, eager_total) = norm(x), norm.add_forward(x, residual)
        norm.fused = True
        fused, (fused_add, fused_total) = norm(x), norm.add_forward(x, residual)
    same_or_one_rounding(fused, eager)
    assert torch.equal(fused_total, eager_total)  # one rounded add either way
    same_or_one_rounding(fused_add, eager_add)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 257])
def test_silu_and_mul_equals_the_eager_swiglu(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    x = (4 * torch.randn(rows, 2 * 1536, generator=gen)).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    same_or_one_rounding(cpu_kernels.silu_and_mul(x), F.silu(gate) * up)


@pytest.mark.parametrize(("dtype", "cache_dtype"), [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                  (torch.bfloat16, torch.float8_e4m3fn)])
@pytest.mark.parametrize(("rotary_dim", "tokens"), [(64, 1), (64, 70), (32, 70)])
def test_rotary_write_kv_rotates_as_eager_and_stores_as_write_kv(dtype, cache_dtype, rotary_dim, tokens):
    """The rotation of the fused projection's q and k heads (a view, as in the model) equals
    the eager one, and the caches (one layer's views of an aggregated pool) hold at each
    slot exactly what ``write_kv`` stores from the rotated k and v; other slots untouched."""
    gen = torch.Generator().manual_seed(tokens)
    qkv = (40 * torch.randn(tokens, 9 + 2 * 3, 64, generator=gen)).to(dtype)  # past e4m3's 448: clamped
    qk, v = qkv[:, : 9 + 3], qkv[:, 9 + 3 :]
    rope = RotaryEmbedding({"rope_type": "default", "rope_theta": 10000.0}, rotary_dim)
    cos, sin = rope.cos_sin(torch.arange(100, 100 + tokens), dtype)
    pool = torch.randn(40, 2, 2, 16, 3, 64, generator=gen).to(cache_dtype)  # [blocks, layers, K/V, bs, heads, dim]
    expected_pool = pool.clone()
    slots = torch.randperm(40 * 16, generator=gen)[:tokens]
    blocks, offsets = slots // 16, slots % 16
    got = cpu_kernels.rotary_write_kv(qk, v, cos[:, 0], sin[:, 0], pool[:, 1, 0], pool[:, 1, 1], blocks, offsets)
    same_or_one_rounding(got, apply_rotary(qk, cos, sin))
    plan = AttentionPlan("aggregated", blocks, offsets, [], [], None)
    write_kv(expected_pool[:, 1, 0], expected_pool[:, 1, 1], got[:, 9:], v, plan)
    assert torch.equal(pool.view(torch.uint8), expected_pool.view(torch.uint8))


@pytest.mark.parametrize(("family", "fused_mlps"), [("llama", True), ("gemma2", False)])
def test_a_loaded_cpu_model_fuses_its_norms_and_only_swiglu_mlps(tmp_path, family, fused_mlps):
    save_tiny_model(tmp_path, family)
    model = load_model(tmp_path, torch.float32, "cpu")
    assert all(m.fused for m in model.modules() if isinstance(m, (RMSNorm, Attention)))
    assert all(m.fused == fused_mlps for m in model.modules() if isinstance(m, MLP))
    assert any(isinstance(m, MLP) for m in model.modules())
