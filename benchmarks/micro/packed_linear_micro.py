"""The served model's linear layers, timed with torch's F.linear against oneDNN over
prepacked weights (``memserve/workers/model/packed_linear.py``), at decode and prefill
batch sizes: why the CPU engine packs its weights at load.

    python benchmarks/micro/packed_linear_micro.py [--threads 1] [--dtype float32] [--rows 1,8,16,32,256]

Every layer's projections (qkv, o, gate_up, down) plus the lm_head, with the shapes of
the embedded SmolLM2, run once per repetition; rounds alternate the two paths and the
speed-up is the median of per-round ratios, so a noisy machine slows both sides alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from memserve.model_files.gguf_convert import ensure_model_dir
from memserve.workers.model.model_config import ModelConfig
from memserve.workers.model.packed_linear import PackedLinear


def layer_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """(out, in) of every linear layer the model runs per token, lm_head last."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    per_layer = [(q + 2 * kv, config.hidden_size), (config.hidden_size, q),
                 (2 * config.intermediate_size, config.hidden_size), (config.hidden_size, config.intermediate_size)]
    return per_layer * config.num_layers + [(config.vocab_size, config.hidden_size)]


def timed(layers: list, inputs: dict[int, torch.Tensor]) -> float:
    start = time.perf_counter()
    for layer in layers:
        layer(inputs[layer.in_features])
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rows", default="1,8,16,32,256", help="batch sizes (tokens per step)")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    config = ModelConfig.from_folder(ensure_model_dir(None))
    torch.manual_seed(0)
    plain = []
    for out_features, in_features in layer_shapes(config):
        linear = torch.nn.Linear(in_features, out_features, bias=False, dtype=dtype)
        torch.nn.init.normal_(linear.weight, std=0.02)
        plain.append(linear)
    packed = [PackedLinear(linear) for linear in plain]
    flops_per_row = 2 * sum(layer.in_features * layer.out_features for layer in plain)
    print(f"{len(plain)} linear layers of {config.num_layers}-layer SmolLM2, {args.dtype}, {args.threads} thread(s)")
    print(f"{'rows':>5} {'F.linear ms':>12} {'oneDNN packed ms':>17} {'speed-up':>9} {'GFLOP/s packed':>15}")
    with torch.inference_mode():
        for rows in map(int, args.rows.split(",")):
            inputs = {n: torch.randn(rows, n, dtype=dtype) for n in {layer.in_features for layer in plain}}
            timed(plain, inputs), timed(packed, inputs)  # warm-up: page in both weight copies
            pairs = [(timed(plain, inputs), timed(packed, inputs)) for _ in range(args.rounds)]
            torch_s = statistics.median(a for a, _ in pairs)
            packed_s = statistics.median(b for _, b in pairs)
            ratio = statistics.median(a / b for a, b in pairs)
            print(f"{rows:>5} {torch_s * 1e3:>12.1f} {packed_s * 1e3:>17.1f} {ratio:>8.2f}x "
                  f"{rows * flops_per_row / packed_s / 1e9:>15.0f}")


if __name__ == "__main__":
    main()
