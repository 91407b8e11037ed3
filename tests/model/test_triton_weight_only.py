"""The Triton weight-only kernel for AWQ/GPTQ and FP8 layers on CUDA, run on CPU tensors
by Triton's interpreter, against ``F.linear`` over the weight the layer replaces
(``int4_linear.dequantize``; ``Fp8Linear.widened``): rows fewer than a tile and more (1,
5, 17), output widths that are and are not a multiple of the tile (64, 48), groups of 32
and 64 columns (FP8: per tensor, per channel, per block of 32 or 64), with and without a
bias, float32 (exact up to float32 sums) and float16; every code value and zeros across
the range, every finite e4m3 value with both signs and subnormals. The codes' packing two
a byte is checked on its own. Beside the interpreter, the kernel is compiled for Ampere
and Hopper in both formats (no GPU needed).

Triton chooses its interpreter as it is imported, and other test files import it
compiling or interpreting in this process: both run in processes of their own."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (the test extra)", allow_module_level=True)

# For each (format, rows, out, in, group, dtype, bias) in argv[1]: the largest difference
# between the interpreted kernel's product and F.linear over the dequantized weight, and
# the largest |expected|, printed as JSON; and whether pack_codes keeps every code.
RUN_INTERPRETED = """
import json, sys
import torch
import torch.nn.functional as F
from memserve.workers.model.fp8_linear import Fp8Linear
from memserve.workers.model.int4_linear import dequantize
from memserve.workers.model.triton_weight_only import TritonFp8Linear, TritonInt4Linear, pack_codes
results = []
gen = torch.Generator().manual_seed(0)
finite_e4m3 = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
for form, rows, out_f, in_f, group, dtype, with_bias in json.loads(sys.argv[1]):
    dtype = getattr(torch, dtype)
    scales = torch.rand(out_f, in_f // group, generator=gen) * 0.1 + 0.01
    bias = torch.randn(out_f, generator=gen).to(dtype) if with_bias else None
    x = torch.randn(rows, in_f, generator=gen).to(dtype)
    if form == "int4":
        codes = torch.randint(0, 16, (out_f, in_f), generator=gen, dtype=torch.uint8)
        zeros = torch.randint(0, 16, (out_f, in_f // group), generator=gen).float()
        got = TritonInt4Linear(codes, scales, zeros, bias)(x)
        weight = dequantize(codes, scales, zeros, dtype)
    else:
        at = torch.randint(0, len(finite_e4m3), (out_f, in_f), generator=gen)
        values = finite_e4m3[at].view(torch.float8_e4m3fn)
        got = TritonFp8Linear(values, scales, bias)(x)
        weight = Fp8Linear(values, scales, None, dtype).widened()
    expected = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    results.append([got.dtype == dtype, (got.float() - expected).abs().max().item(), expected.abs().max().item()])
packed = pack_codes(torch.arange(16, dtype=torch.uint8).repeat(3, 2))
unpacked = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(1)
print(json.dumps({"cases": results, "packing": torch.equal(unpacked, torch.arange(16, dtype=torch.uint8).repeat(3, 2))}))
"""

# Compiles the kernel (TRITON_INTERPRET unset) for each (compute capability, dtype) in
# argv[1], down to a cubin through the ptxas that triton's wheel ships.
COMPILE_FOR_CUDA = """
import json, sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from memserve.workers.model import triton_weight_only as t
kernel = t._weight_only_matmul_kernel
for arch, dtype, fp8 in json.loads(sys.argv[1]):
    constants = {"GROUP": 64, "FP8": fp8, "BLOCK_M": t.BLOCK_M, "BLOCK_N": t.BLOCK_N, "BLOCK_K": t.BLOCK_K}
    pointers = {"x": dtype, "out": dtype, "weight": "u8", "scales": "fp32", "zeros": "fp32"}
    signature = {name: "constexpr" if name in constants else "*" + pointers[name] if name in pointers else "i32"
                 for name in kernel.arg_names}
    compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", arch, 32))
"""


def run(script: str, cases: list, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script, json.dumps(cases)], env=env, capture_output=True, text=True,
                          timeout=600)


def test_interpreted_kernel_equals_the_dequantized_weights_product():
    cases = [("int4", 1, 64, 128, 32, "float32", False), ("int4", 5, 48, 128, 64, "float32", True),
             ("int4", 17, 64, 192, 32, "float32", True), ("int4", 5, 48, 128, 32, "float16", True),
             ("fp8", 1, 64, 128, 128, "float32", False), ("fp8", 5, 48, 192, 64, "float32", True),
             ("fp8", 17, 64, 128, 32, "float32", True), ("fp8", 5, 48, 128, 128, "float16", True)]
    result = run(RUN_INTERPRETED, cases, {**os.environ, "TRITON_INTERPRET": "1"})
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["packing"]
    for (form, rows, _, _, _, dtype, _), (same_dtype, error, largest) in zip(cases, report["cases"], strict=True):
        assert same_dtype
        assert error <= (1e-5 if dtype == "float32" else 1e-2) * largest, (form, rows, dtype, error, largest)


def test_kernel_compiles_for_cuda(tmp_path):
    """What only the compiler checks (tl.dot's tile shapes and operand types), for Ampere
    and Hopper, in float32, float16 and bf16 (the interpreter computes no bf16), int4 and FP8."""
    spec = importlib.util.find_spec("triton")
    assert spec is not None and spec.origin is not None
    if not (Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton ships no ptxas")
    cases = [(80, "fp32", False), (80, "bf16", True), (90, "fp16", False), (90, "bf16", True), (90, "bf16", False)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path)}
    result = run(COMPILE_FOR_CUDA, cases, env)
    assert result.returncode == 0, result.stderr
