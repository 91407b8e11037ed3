"""The fused pointwise CPU kernels against the eager ops they replace (which match
transformers): RMSNorm (Llama's and Gemma's unit offset), the residual add fused with the
next norm, SwiGLU's silu(gate) * up and the rotary embedding (whole and partial), in float32 and bf16, on 1 row and on many
(threaded), widths that are and are not multiples of a vector. bf16 results round where
the eager ops round, so all but a rare value (the order of one float32 sum) are equal
bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from memserve.testing.random_models import save_tiny_model
from memserve.workers.model import cpu_kernels
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rotary_dim", "tokens"), [(64, 1), (64, 70), (32, 70)])
def test_rotary_equals_the_eager_rotation_on_the_fused_projections_view(dtype, rotary_dim, tokens):
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, 9 + 2 * 3, 64, generator=gen).to(dtype)
    qk = qkv[:, : 9 + 3]  # q and k heads, a view into the fused projection as in the model
    rope = RotaryEmbedding({"rope_type": "default", "rope_theta": 10000.0}, rotary_dim)
    cos, sin = rope.cos_sin(torch.arange(100, 100 + tokens), dtype)
    same_or_one_rounding(cpu_kernels.rotary(qk, cos[:, 0], sin[:, 0]), apply_rotary(qk, cos, sin))


@pytest.mark.parametrize(("family", "fused_mlps"), [("llama", True), ("gemma2", False)])
def test_a_loaded_cpu_model_fuses_its_norms_and_only_swiglu_mlps(tmp_path, family, fused_mlps):
    save_tiny_model(tmp_path, family)
    model = load_model(tmp_path, torch.float32, "cpu")
    assert all(m.fused for m in model.modules() if isinstance(m, (RMSNorm, Attention)))
    assert all(m.fused == fused_mlps for m in model.modules() if isinstance(m, MLP))
    assert any(isinstance(m, MLP) for m in model.modules())
