"""Llama-3-70B at tensor parallel 8 on H100s, on paper: the ``llama3-70b-h100-tp8`` preset
(derived from datasheet figures, see memserve/costmodel/presets.py) against a published
vLLM run of the same setup.

The published run: LambdaLabsML/vllm-benchmark,
results/prompt_10/8xH100-80GB-SXM/Meta-Llama-3-70B-Instruct_tp8_len2048.json
(https://github.com/LambdaLabsML/vllm-benchmark; vLLM 0.6.0 era, run 2024-09-07):
vLLM's ``benchmark_serving`` with 10 ShareGPT prompts sent at once (request rate inf),
8x H100-80GB-SXM, tensor parallel 8, BF16. Its figures are copied below; nothing is
fetched.

This replays that run's shape through the cost model in a closed-form loop: all 10
requests arrive at t=0 and are prefilled in one step (the two that produced no text
ended on their first token, so they were prefilled too); then one decode step after
another, each request leaving the batch when it has its published output length. TTFT is
the prefill step's end (0 for a request with no text, as ``benchmark_serving`` records
it); TPOT of a request is (its finish - its TTFT) / (output length - 1), over requests of
2 tokens or more, as ``benchmark_serving`` computes it. The published decode step times
are read off the run's inter-token latencies: vLLM streamed 10 tokens per chunk
(multi-step scheduling), so a chunk's latency / 10 is one step.

    python benchmarks/simulated/llama70b_tp8_on_paper.py
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

from memserve.costmodel.model import CostModel
from memserve.costmodel.store import load_cost_model

PRESET = "llama3-70b-h100-tp8"
SOURCE = ("https://github.com/LambdaLabsML/vllm-benchmark/blob/a4f9f4371a1ccac781293837fce2bce0cc6d25cc/"
          "results/prompt_10/8xH100-80GB-SXM/Meta-Llama-3-70B-Instruct_tp8_len2048.json")
INPUT_LENS = (13, 25, 27, 10, 329, 29, 399, 328, 4, 205)
OUTPUT_LENS = (120, 624, 233, 194, 101, 741, 0, 0, 6, 35)
# The published figures (seconds, tokens/s, milliseconds). Decode steps: the first
# 10-token chunk, when all 8 answering requests decode (median over them, 136.1 ms / 10),
# and the chunks after the 624-token request ends, when only the 741-token one is left
# (median of its last 11, 112.3 ms / 10).
PUBLISHED = {
    "duration_s": 8.617, "output_tok_s": 238.36, "mean_ttft_ms": 97.96, "median_ttft_ms": 122.28,
    "mean_tpot_ms": 14.05, "median_tpot_ms": 12.18, "decode_b8_ms": 13.61, "decode_b1_ms": 11.23,
}
ROWS = (  # key, label, unit format
    ("duration_s", "duration (s)", "{:.3f}"),
    ("output_tok_s", "output tokens/s", "{:.1f}"),
    ("mean_ttft_ms", "mean TTFT (ms)", "{:.1f}"),
    ("median_ttft_ms", "median TTFT (ms)", "{:.1f}"),
    ("median_tpot_ms", "median TPOT (ms)", "{:.2f}"),
    ("mean_tpot_ms", "mean TPOT (ms)", "{:.2f}"),
    ("decode_b8_ms", "decode step, batch 8 (ms)", "{:.2f}"),
    ("decode_b1_ms", "decode step, batch 1 (ms)", "{:.2f}"),
)


def decode_phase(cost: CostModel, start_s: float, inputs: tuple[int, ...],
                 outputs: tuple[int, ...]) -> tuple[dict[int, float], dict[int, list[float]]]:
    """Decode steps from ``start_s`` until every request has its output length: each
    request's finish time (by index) and the step times seen at each batch size. A request
    of n tokens got its first from the prefill, so it leaves after step n - 1."""
    active = [i for i, n in enumerate(outputs) if n >= 2]
    finish = {i: start_s for i, n in enumerate(outputs) if n < 2}
    steps: dict[int, list[float]] = defaultdict(list)
    now, k = start_s, 0
    while active:
        k += 1  # the k-th decode step: each sequence's KV holds its prompt and k tokens
        contexts = [inputs[i] + k for i in active]
        step = cost.decode_step_s(len(active), sum(contexts), max(contexts))
        steps[len(active)].append(step)
        now += step
        for i in [i for i in active if outputs[i] - 1 == k]:
            finish[i] = now
            active.remove(i)
    return finish, steps


def replay(cost: CostModel, inputs: tuple[int, ...] = INPUT_LENS,
           outputs: tuple[int, ...] = OUTPUT_LENS) -> dict[str, float]:
    """The published run's figures as the cost model prices its shape (keys of ``PUBLISHED``)."""
    prefill_s = cost.prefill_batch_s((x, 0.0) for x in inputs)
    finish, steps = decode_phase(cost, prefill_s, inputs, outputs)
    ttfts = [prefill_s if n > 0 else 0.0 for n in outputs]  # no text: no first token recorded
    tpots = [(finish[i] - ttfts[i]) / (n - 1) for i, n in enumerate(outputs) if n >= 2]
    duration = max(finish.values())
    return {
        "duration_s": duration, "output_tok_s": sum(outputs) / duration,
        "mean_ttft_ms": 1e3 * statistics.mean(ttfts), "median_ttft_ms": 1e3 * statistics.median(ttfts),
        "mean_tpot_ms": 1e3 * statistics.mean(tpots), "median_tpot_ms": 1e3 * statistics.median(tpots),
        "decode_b8_ms": 1e3 * statistics.median(steps[8]), "decode_b1_ms": 1e3 * statistics.median(steps[1]),
    }


def table(ours: dict[str, float], published: dict[str, float] = PUBLISHED) -> str:
    """A Markdown table: each figure by the cost model, by vLLM, and their ratio."""
    lines = ["| figure | memserve cost model | published vLLM | cost model / vLLM |", "|---|---:|---:|---:|"]
    for key, label, fmt in ROWS:
        lines.append(f"| {label} | {fmt.format(ours[key])} | {fmt.format(published[key])} | "
                     f"{ours[key] / published[key]:.2f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cost-model", default=PRESET, help="a preset's name or a memserve profile (JSON)")
    args = p.parse_args()
    cost = load_cost_model(args.cost_model)
    prefill_ms = 1e3 * cost.prefill_batch_s((x, 0.0) for x in INPUT_LENS)
    print(f"{cost.key.model} {cost.key.dtype} on {cost.key.hardware}: {len(INPUT_LENS)} requests, "
          f"{sum(INPUT_LENS)} prompt tokens prefilled in one step ({prefill_ms:.1f} ms), "
          f"{sum(OUTPUT_LENS)} output tokens")
    print(table(replay(cost)))
    print(f"published: {SOURCE}")


if __name__ == "__main__":
    main()
