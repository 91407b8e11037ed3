"""Cost-model presets for the papers' setups, derived from published figures.

The simulator replays the papers' experiments without their hardware, so these presets
give ``CostModel``s from first principles: FLOPs per token from the parameter counts,
peak dense FP16 tensor throughput and HBM bandwidth from the datasheets, each scaled by
an achievable-efficiency factor. Load them with ``store.load_cost_model(name)``.

``llama2-13b-h800``: MemServe's setup (§7): Llama-2-13B, FP16, tensor parallel 2 on a
DGX H800 (H800-SXM5-80GB, NVLink 400 GB/s).
``opt-13b-a100``: CacheOpt's setup (§2): OPT-13B, FP16, one A100-SXM4-80GB of a
p4d.24xlarge (NVSwitch 600 GB/s).
``llama3-70b-h100-tp8``: Meta-Llama-3-70B, BF16, tensor parallel 8 on 8 H100-SXM5-80GB
(NVLink 4): the setup of a published vLLM run that
``benchmarks/simulated/llama70b_tp8_on_paper.py`` sets these figures against.

Published figures
  H800-SXM5:  989.5 TFLOP/s dense FP16 (1979 with sparsity), HBM3 3.35 TB/s, NVLink
              400 GB/s (bidirectional: 200 GB/s each way), PCIe Gen5 x16 (64 GB/s each way).
  A100-SXM4:  312 TFLOP/s dense FP16, HBM2e 2.039 TB/s (80 GB), NVLink/NVSwitch 600 GB/s
              (300 GB/s each way), PCIe Gen4 x16: about 26 GB/s effective (AttentionStore §2.3).
  H100-SXM5:  989.4 TFLOP/s dense BF16/FP16 (1979 with sparsity), HBM3 3.35 TB/s (80 GB),
              NVLink 4 900 GB/s (bidirectional: 450 GB/s each way), PCIe Gen5 x16 (64 GB/s
              each way; 0.8 of it effective, as for the H800).

Architectures (FP16, 2 bytes a value; L layers, d hidden, I FFN width)
  Llama-2-13B: L=40, d=5120, I=13824 (SwiGLU: 3 matrices), 40 heads x 128 (no GQA),
    vocab 32000, untied head. Parameters 40*(4d² + 3dI + 2d) + 2*32000*d + d = 13.016e9.
    GEMM FLOPs/token 2*40*(4d² + 3dI) = 25.38e9.
  OPT-13B: L=40, d=5120, I=20480 (ReLU: 2 matrices), 40 heads x 128, vocab 50272 (tied),
    learned positions (2050 rows). Parameters 40*314,639,360 (with biases and 2 LayerNorms)
    + 50272*d + 2050*d + 2d = 12.853e9. GEMM FLOPs/token 2*40*(4d² + 2dI) = 25.17e9.
  KV bytes/token, both: 2 (K, V) * 40 layers * 5120 * 2 B = 819,200 B.
  Meta-Llama-3-70B (BF16: 2 bytes a value, the same peak as FP16 on H100): L=80, d=8192,
    I=28672 (SwiGLU), 64 query heads x 128 over 8 KV heads (GQA: K and V are 1024 wide),
    vocab 128256, untied head. Parameters 80*(2d² + 2*d*1024 + 3dI + 2d) + 2*128256*d + d
    = 80*855,654,400 + 2,101,346,304 + 8192 = 70.554e9. GEMM FLOPs/token
    2*80*(2d² + 2*d*1024 + 3dI) = 136.90e9 (the LM head is left out, as for the 13B
    models). KV bytes/token 2 * 80 * 1024 * 2 B = 327,680 B.

Efficiency factors (assumptions, stated once here)
  GEMMs 0.6 of peak on H800 and H100 (TP-sharded shapes, cuBLAS reaches 60-75% on
  H100-class parts) and 0.7 on A100 (cuBLAS reaches 70-85% on large FP16 GEMMs); attention
  0.35 on H800 and H100 and 0.5 on A100 (FlashAttention-2 forward: about 335 of 989 TFLOP/s
  on H100 and up to 73% of peak on A100 for long sequences; shorter prompts do worse); HBM
  0.8 of peak; GPU links 0.8 of peak. Engine overhead per step (scheduling, input
  preparation): 2 ms, an estimate for a vLLM-like engine, not a published figure.

Terms, with TP = t (each rank holds 1/t of every GEMM and of the heads)
  linear (compute-bound GEMMs): per_token = FLOPs/token / (t * peak * eff_gemm);
    per_step = weight bytes / (t * HBM * 0.8): a step reads every weight once even when it
    has few tokens (the paper's last wave). Additive, so it overestimates large steps by
    at most this floor.
  elementwise (constant operators: norms, residual adds, activation): memory-bound,
    per_token = 2 B * L * (10d + k*I/t) / (HBM * 0.8), with k = 3 (SwiGLU reads gate and
    up, writes one) or 2 (ReLU); norms and residuals are replicated on every rank.
  allreduce (t > 1): two per layer of d values per token; a ring moves 2(t-1)/t of them
    per rank: per_token = 2*L*d*2 B * 2(t-1)/t / (link each way * 0.8); per_step = 2L * 10 us.
  attention: causal prefix attention of x tokens with xy cached does 2*L*d*x²(1-y²)
    FLOPs; the paper's form has no y² term, so the preset takes the chord through y=0 and
    y=1: b = 2*L*d / (t * peak * eff_attn), a = -b (underestimates attention by at most
    b*x²/4, at y=0.5: under 2% of a 2k-token prefill here). c = KV bytes/token /
    (t * HBM * 0.8) (each key and value read once); d = 0 (one launch per layer for the
    whole batch, counted in the overhead).
  decode step: per_step = weight floor + allreduce latency + overhead; per_seq = the
    GEMM and allreduce cost of one token; per_context_token = KV bytes/token / (t * HBM * 0.8).
  copy (host <-> device): the PCIe link each way, 10 us latency.
  transfer (instance -> instance): t links each way (every rank sends its own shard)
    * 0.8, 50 us latency (a few NCCL calls).

Resulting numbers
  llama2-13b-h800: linear 21.37 us/token + 4.86 ms/step, elementwise 2.15 us/token,
    allreduce 5.12 us/token + 0.8 ms/step, attention b = 5.91e-10 s/token², c = 1.53e-7
    s/token; prefill_s(2048, 0) = 69 ms, prefill_s(2048, 0.75) = 23 ms; decode step
    7.66 ms + 26.5 us/seq + 0.153 us/context token (B=32 at 2048 tokens: 18.5 ms);
    copy 51.2 GB/s; transfer 320 GB/s (2048 tokens = 1.68 GB: 5.3 ms).
  opt-13b-a100: linear 115.2 us/token + 15.76 ms/step, elementwise 4.52 us/token,
    attention b = 2.63e-9, c = 5.02e-7; prefill_s(2048, 0) = 275 ms; decode step
    17.76 ms + 115 us/seq + 0.502 us/context token; copy 26 GB/s; transfer 240 GB/s.
  llama3-70b-h100-tp8: linear 28.83 us/token + 6.58 ms/step (the weight floor: 141.1 GB
    over 8 x 2.68 TB/s), elementwise 5.53 us/token, allreduce 12.74 us/token + 1.6 ms/step,
    attention b = 4.73e-10, c = 1.53e-8; prefill_s(2048, 0) = 109 ms, prefill_s(2048, 0.75)
    = 35 ms; decode step 10.18 ms + 41.6 us/seq + 0.0153 us/context token (B=1 at 512
    tokens: 10.2 ms; B=32 at 2048 tokens: 12.5 ms); copy 51.2 GB/s; transfer 2.88 TB/s
    (2048 tokens = 0.67 GB: 0.28 ms).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

from memserve.costmodel.model import (
    AttentionCost,
    BandwidthCost,
    CostKey,
    CostModel,
    DecodeCost,
    OperatorCost,
)

FP16_BYTES = 2
BLOCK_SIZE = 16
STEP_OVERHEAD_S = 2e-3
ALLREDUCE_LATENCY_S = 10e-6
COPY_LATENCY_S = 10e-6
TRANSFER_LATENCY_S = 50e-6


@dataclass(frozen=True)
class Architecture:
    name: str
    num_layers: int
    hidden: int
    intermediate: int
    ffn_matrices: int  # 3 for SwiGLU (gate, up, down), 2 for a plain MLP
    activation_io: int  # values the activation reads + writes per FFN unit: 3 SwiGLU, 2 ReLU
    kv_dim: int  # num_kv_heads * head_dim
    num_params: int

    @property
    def gemm_flops_per_token(self) -> float:
        d = self.hidden
        per_layer = 2 * d * d + 2 * d * self.kv_dim + self.ffn_matrices * d * self.intermediate
        return 2.0 * self.num_layers * per_layer

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.kv_dim * FP16_BYTES


@dataclass(frozen=True)
class Accelerator:
    name: str
    peak_flops: float  # dense FP16 tensor throughput
    hbm_bytes_per_s: float
    link_bytes_per_s: float  # GPU-to-GPU, each way
    host_bytes_per_s: float  # host <-> device, each way, effective


@dataclass(frozen=True)
class Efficiency:
    gemm: float
    attention: float
    memory: float = 0.8
    link: float = 0.8


LLAMA2_13B = Architecture("Llama-2-13b", 40, 5120, 13824, 3, 3, 5120, 13_015_864_320)
OPT_13B = Architecture("opt-13b", 40, 5120, 20480, 2, 2, 5120, 12_853_473_280)
LLAMA3_70B = Architecture("Meta-Llama-3-70B", 80, 8192, 28672, 3, 3, 1024, 70_553_706_496)
H800 = Accelerator("nvidia-h800-sxm5-80gb", 989.5e12, 3.35e12, 200e9, 64e9 * 0.8)
A100 = Accelerator("nvidia-a100-sxm4-80gb", 312e12, 2.039e12, 300e9, 26e9)
H100 = Accelerator("nvidia-h100-sxm5-80gb", 989.4e12, 3.35e12, 450e9, 64e9 * 0.8)


def derive(preset: str, arch: Architecture, acc: Accelerator, tp: int, eff: Efficiency,
           dtype: str = "float16") -> CostModel:
    """The cost model of ``arch`` on ``tp`` x ``acc`` (see the module docstring); ``dtype``
    names the 2-byte type the setup ran in (its key), the figures are the same for both."""
    L, d = arch.num_layers, arch.hidden
    flops = tp * acc.peak_flops
    hbm = tp * acc.hbm_bytes_per_s * eff.memory  # t ranks read their shards in parallel
    rank_hbm = acc.hbm_bytes_per_s * eff.memory
    link = acc.link_bytes_per_s * eff.link
    weight_floor = arch.num_params * FP16_BYTES / hbm
    linear_per_token = arch.gemm_flops_per_token / (flops * eff.gemm)
    ops = {
        "linear": OperatorCost(per_token=linear_per_token, per_step=weight_floor, kind="compute"),
        "elementwise": OperatorCost(
            per_token=FP16_BYTES * L * (10 * d + arch.activation_io * arch.intermediate / tp) / rank_hbm,
            kind="constant"),
        "overhead": OperatorCost(per_step=STEP_OVERHEAD_S, kind="overhead"),
    }
    allreduce_per_token = allreduce_per_step = 0.0
    if tp > 1:
        allreduce_per_token = 2 * L * d * FP16_BYTES * 2 * (tp - 1) / tp / link
        allreduce_per_step = 2 * L * ALLREDUCE_LATENCY_S
        ops["allreduce"] = OperatorCost(per_token=allreduce_per_token, per_step=allreduce_per_step,
                                        kind="communication")
    b = 2.0 * L * d / (flops * eff.attention)
    return CostModel(
        key=CostKey(arch.name, dtype, f"{acc.name}-tp{tp}"),
        block_size=BLOCK_SIZE,
        kv_bytes_per_token=arch.kv_bytes_per_token,
        operators=ops,
        attention=AttentionCost(a=-b, b=b, c=arch.kv_bytes_per_token / hbm, d=0.0),
        decode=DecodeCost(
            per_step=weight_floor + allreduce_per_step + STEP_OVERHEAD_S,
            per_seq=linear_per_token + allreduce_per_token,
            per_context_token=arch.kv_bytes_per_token / hbm,
        ),
        copy=BandwidthCost(COPY_LATENCY_S, acc.host_bytes_per_s),
        transfer=BandwidthCost(TRANSFER_LATENCY_S, tp * link),
        meta={"source": "preset", "preset": preset, "tensor_parallel": tp, "architecture": asdict(arch),
              "accelerator": asdict(acc), "efficiency": asdict(eff),
              "notes": "derived from published figures; see memserve/costmodel/presets.py"},
    )


PRESETS: dict[str, Callable[[], CostModel]] = {
    "llama2-13b-h800": lambda: derive("llama2-13b-h800", LLAMA2_13B, H800, tp=2,
                                      eff=Efficiency(gemm=0.6, attention=0.35)),
    "opt-13b-a100": lambda: derive("opt-13b-a100", OPT_13B, A100, tp=1, eff=Efficiency(gemm=0.7, attention=0.5)),
    "llama3-70b-h100-tp8": lambda: derive("llama3-70b-h100-tp8", LLAMA3_70B, H100, tp=8,
                                          eff=Efficiency(gemm=0.6, attention=0.35), dtype="bfloat16"),
}
