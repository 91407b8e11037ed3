"""How often bfloat16 picks the same greedy tokens as float32, on ShareGPT prompts.

Both dtypes run the real engine (in-process, same prompts, prefix caching off) to
``--max-tokens`` greedy tokens per prompt. Once two greedy runs pick different tokens the
continuations differ, so the figures are: the share of prompts whose whole output is
identical, the share of output tokens before the first divergence, and the share of
positions holding the same token.

    python benchmarks/real/bf16_agreement.py [--prompts 32] [--max-tokens 64] [--threads 1]
        [--cpu-prefill-attention blocked|sdpa]   # the prefill path both dtypes take (default: the probe's)
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

SHARED_DATA = Path(__file__).resolve().parents[3] / "shared" / "data"


def sharegpt_prompts(model_dir: Path, n: int, max_len: int, seed: int = 0) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    lines = (SHARED_DATA / "sharegpt-sample.jsonl").read_text().splitlines()
    random.Random(seed).shuffle(lines)
    prompts = []
    for line in lines:
        ids = tokenizer.apply_chat_template([json.loads(line)["messages"][0]], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        if 16 <= len(ids) <= max_len:
            prompts.append(list(ids))
        if len(prompts) == n:
            break
    return prompts


def generate(model_dir: Path, dtype: str, prompts: list[list[int]], max_tokens: int,
             cpu_prefill: str = "auto") -> tuple[list[list[int]], float]:
    """Greedy outputs of every prompt (batched as the engine schedules them) and seconds taken."""
    from memserve.config import EngineConfig
    from memserve.ipc.messages import AddRequest, SamplingParams
    from memserve.workers.real_engine import build_engine

    cfg = EngineConfig(dtype=dtype, num_blocks=4096, enable_prefix_caching=False, max_num_seqs=16,
                       cpu_prefill_attention=cpu_prefill)
    engine = build_engine(cfg, model_dir)
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    for i, prompt in enumerate(prompts):
        engine.add_request(AddRequest(str(i), prompt, params))
    start = time.perf_counter()
    while engine.has_work:
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
    return [outputs[str(i)] for i in range(len(prompts))], time.perf_counter() - start


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict[str, float]:
    identical = sum(a == b for a, b in zip(reference, other))
    total = sum(len(a) for a in reference)
    before = same = 0
    for a, b in zip(reference, other):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        before += first
        same += sum(x == y for x, y in zip(a, b))
    return {"identical outputs": identical / len(reference), "tokens before first divergence": before / total,
            "same token at same position": same / total}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-prompt-len", type=int, default=512)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--cpu-prefill-attention", default="auto", choices=["auto", "blocked", "sdpa"])
    args = p.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from memserve.model_files.gguf_convert import ensure_model_dir

    model_dir = ensure_model_dir(None)
    prompts = sharegpt_prompts(model_dir, args.prompts, args.max_prompt_len)
    f32, f32_s = generate(model_dir, "float32", prompts, args.max_tokens, args.cpu_prefill_attention)
    bf16, bf16_s = generate(model_dir, "bfloat16", prompts, args.max_tokens, args.cpu_prefill_attention)
    print(f"{len(prompts)} ShareGPT prompts, {args.max_tokens} greedy tokens at most")
    for name, value in agreement(f32, bf16).items():
        print(f"  {name:32s} {value:6.1%}")
    print(f"  engine time float32 {f32_s:.1f} s, bfloat16 {bf16_s:.1f} s: bfloat16 {f32_s / bf16_s:.2f}x as fast")


if __name__ == "__main__":
    main()
