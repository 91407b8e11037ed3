"""Perplexity after context truncation: kv-shift vs recompute vs naive KV reuse
(AttentionStore Table 1).

Each sample is a ShareGPT conversation rendered with the chat template, at least
``window + continuation`` tokens long. Its first ``window`` tokens fill the context
window; then the window overflows and ``drop`` tokens right after the kept head (the
system prompt's blocks) are truncated, whole blocks; the perplexity of the next
``continuation`` tokens is measured under each scheme, on SmolLM2 float32 over
memserve's own paged KV cache and model:

- full: no truncation (the model's native window is larger): the reference.
- recompute (AttentionStore's TT): the truncated history is prefilled again.
- kv-shift (AS): the KV cached for the whole window is kept; the kept blocks are copied
  with their keys rotated back by ``drop`` positions (``workers/model/kv_shift.py``).
- nkvt: the same kept blocks copied without rotation: keys keep their old positions.

It also reports how far kv-shift's next-token distributions are from recompute's (mean
KL divergence, top-1 agreement): the figures ``tests/model/test_kv_shift.py`` bounds.

    nice -n 10 /tmp/venv/bin/python benchmarks/real/truncation_quality.py --samples 24
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from memserve.model_files.gguf_convert import ensure_model_dir
from memserve.text.tokenizer import Tokenizer
from memserve.workers.model.attention import AttentionMetadata, allocate_kv_cache
from memserve.workers.model.kv_shift import shift_blocks
from memserve.workers.model.llama import LlamaForCausalLM
from memserve.workers.model.loader import load_model

DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "sharegpt-sample.jsonl"
LAYOUT = "aggregated"
SCHEMES = ("full", "recompute", "kv-shift", "nkvt")


class PagedSequence:
    """One sequence over a private KV pool: tokens are written to the pool slots of their
    index in the sequence, with RoPE positions that may differ (``offset``)."""

    def __init__(self, model: LlamaForCausalLM, pool: torch.Tensor, block_ids: list[int], block_size: int) -> None:
        self.model, self.pool, self.block_ids, self.block_size = model, pool, block_ids, block_size
        self.length = 0

    def extend(self, token_ids: list[int], offset: int = 0) -> torch.Tensor:
        """Append tokens at positions ``length + offset ...``; returns their logits [n, vocab]."""
        bs, start, end = self.block_size, self.length, self.length + len(token_ids)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor([self.block_ids[p // bs] * bs + p % bs for p in range(start, end)]),
            query_start_loc=[0, end - start],
            context_lens=[end],
            block_tables=torch.tensor([self.block_ids]),
            block_size=bs,
            layout=LAYOUT,
        )
        positions = torch.arange(start + offset, end + offset)
        hidden = self.model(torch.tensor(token_ids), positions, self.pool, meta)
        self.length = end
        return self.model.compute_logits(hidden)


def new_pool(model: LlamaForCausalLM, num_blocks: int, block_size: int) -> torch.Tensor:
    c = model.config
    return allocate_kv_cache(num_blocks, c.num_layers, block_size, c.num_kv_heads, c.head_dim, torch.float32, "cpu",
                             LAYOUT)


@dataclass
class Sample:
    tokens: list[int]  # window + continuation tokens
    head: int  # tokens kept before the dropped range (whole blocks)
    drop: int  # tokens dropped (whole blocks)
    window: int


def continuation_logprobs(model: LlamaForCausalLM, sample: Sample, block_size: int) -> dict[str, torch.Tensor]:
    """Per scheme, log-probabilities [continuation - 1, vocab] of the continuation's next
    tokens. kv-shift and nkvt copy the blocks of one window prefill, so they share it."""
    t, h, d, w, bs = sample.tokens, sample.head, sample.drop, sample.window, block_size
    num_blocks = -(-len(t) // bs)
    out = {}
    for scheme in ("full", "recompute"):
        seq = PagedSequence(model, new_pool(model, num_blocks, bs), list(range(num_blocks)), bs)
        seq.extend(t[:w] if scheme == "full" else t[:h] + t[h + d : w])
        out[scheme] = seq.extend(t[w:])
    window = new_pool(model, num_blocks, bs)
    PagedSequence(model, window, list(range(num_blocks)), bs).extend(t[:w])  # the cached history
    kept = list(range((h + d) // bs, -(-w // bs)))
    for scheme, delta in (("kv-shift", -d), ("nkvt", 0)):
        pool = torch.cat([window, new_pool(model, num_blocks, bs)])  # aggregated: blocks are dim 0
        fresh = list(range(num_blocks, 2 * num_blocks))
        shift_blocks(pool, LAYOUT, model.rotary, kept, fresh[: len(kept)], delta)
        seq = PagedSequence(model, pool, list(range(h // bs)) + fresh, bs)  # head, shifted copies, free blocks
        seq.length = w - d
        out[scheme] = seq.extend(t[w:])
    return {scheme: torch.log_softmax(out[scheme][:-1].double(), dim=-1) for scheme in SCHEMES}


def nll(logprobs: torch.Tensor, targets: list[int]) -> float:
    return -logprobs[torch.arange(len(targets)), torch.tensor(targets)].sum().item()


def load_samples(tokenizer: Tokenizer, count: int, window: int, continuation: int, drop_ratio: float,
                 block_size: int) -> list[Sample]:
    # The kept head: the chat template's system prompt (SmolLM2 adds a default one).
    head_ids = tokenizer.encode_chat([{"role": "user", "content": ""}])
    conv = tokenizer.encode_chat([{"role": "user", "content": "x"}])
    head = -(-next(i for i, (a, b) in enumerate(zip(head_ids, conv)) if a != b) // block_size) * block_size
    drop = int(window * drop_ratio) // block_size * block_size
    samples = []
    with DATA.open() as f:
        for line in f:
            messages = [{"role": m["role"], "content": m["content"]} for m in json.loads(line)["messages"]]
            tokens = tokenizer.encode_chat(messages, add_generation_prompt=False)
            if len(tokens) >= window + continuation:
                samples.append(Sample(tokens[: window + continuation], head, drop, window))
                if len(samples) == count:
                    break
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=24)
    parser.add_argument("--window", type=int, default=512, help="the context window (max_model_len)")
    parser.add_argument("--continuation", type=int, default=128, help="held-out tokens scored after truncation")
    parser.add_argument("--drop-ratio", type=float, default=0.5, help="share of the window truncated (AS: 0.5)")
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    model_dir = ensure_model_dir(None)
    model = load_model(model_dir, torch.float32, "cpu")
    tokenizer = Tokenizer.from_folder(model_dir)
    samples = load_samples(tokenizer, args.samples, args.window, args.continuation, args.drop_ratio, args.block_size)
    totals = dict.fromkeys(SCHEMES, 0.0)
    kl_sum = agree = count = 0.0
    t0 = time.perf_counter()
    for s in samples:
        targets = s.tokens[args.window + 1 :]
        logprobs = continuation_logprobs(model, s, args.block_size)
        for scheme in SCHEMES:
            totals[scheme] += nll(logprobs[scheme], targets)
        ref, shifted = logprobs["recompute"], logprobs["kv-shift"]
        kl_sum += (ref.exp() * (ref - shifted)).sum().item()
        agree += (ref.argmax(-1) == shifted.argmax(-1)).sum().item()
        count += len(targets)
        print(f"sample {int(count) // len(targets)}: " + ", ".join(
            f"{scheme} {math.exp(totals[scheme] / count):.3f}" for scheme in SCHEMES), flush=True)
    print(f"SmolLM2-135M-Instruct float32, {len(samples)} ShareGPT conversations, window {args.window}, "
          f"kept head {samples[0].head} tokens, {samples[0].drop} tokens truncated, "
          f"{args.continuation - 1} continuation tokens scored each ({time.perf_counter() - t0:.0f} s)")
    print("| scheme | perplexity |\n|---|---|")
    for scheme in SCHEMES:
        print(f"| {scheme} | {math.exp(totals[scheme] / count):.3f} |")
    print(f"kv-shift vs recompute: mean KL(recompute || kv-shift) {kl_sum / count:.4f} nats/token, "
          f"top-1 agreement {agree / count:.1%}")


if __name__ == "__main__":
    main()
