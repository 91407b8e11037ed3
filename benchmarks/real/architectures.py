"""Decode and prefill speed of each architecture memserve serves, against transformers on
the same weights.

Every family (llama, qwen2, qwen3, mistral with a window shorter than the prompts, phi3,
mixtral, qwen3_moe; gemma2 and gemma3_text where memserve serves them) is built with
random weights by transformers at two sizes: the tests' tiny one and Qwen2.5-0.5B's
(``memserve/testing/random_models.py``; the MoE models there hold 8 experts, 2 chosen,
as many weights as the dense MLP). memserve's in-process engine and transformers run
them in float32 on the same torch threads, one timed run each after a warm-up:

- decode tok/s at batch 1 and 8: the steps after the prefill, ``--decode-tokens`` a
  sequence after ``--context``-token prompts (memserve's engine steps; transformers'
  ``generate``, timed from its first token to its last);
- prefill tok/s: a ``--prefill``-token prompt up to its first token.

Then the price of the experts: each MoE model against a dense model of the same active
parameters (the same attention, an MLP twice the experts' width), on memserve.

Figures from a shared machine are noisy: a single run is a rough comparison, not a
measurement to three digits. There, ``--threads 1``: two OpenMP threads on two busy cores
stall each other's every kernel, and the figures become noise.

    python benchmarks/real/architectures.py --threads 1           # both sizes: 8 minutes on 2 cores
    python benchmarks/real/architectures.py --threads 1 --quick   # the tiny size only: 15 seconds
"""

from __future__ import annotations

import argparse
import tempfile
import time
from itertools import count
from pathlib import Path

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.initialization import no_init_weights
from transformers.utils import logging as transformers_logging

from memserve.config import EngineConfig
from memserve.ipc.messages import AddRequest, SamplingParams
from memserve.testing.random_models import (
    HALF_B_OPTIONS,
    HALF_B_SIZES,
    TINY_ARCHITECTURES,
    TINY_SIZES,
    random_model,
)
from memserve.workers.engine.engine import Engine
from memserve.workers.model.model_config import SUPPORTED_MODEL_TYPES
from memserve.workers.real_engine import build_engine

# (sizes, each family's options at them, the N(0, std) of the random weights): at the tiny
# size the MoE models also get 8 experts, every layer sparse.
SIZES: dict[str, tuple[dict, dict[str, dict], float]] = {
    "tiny": (TINY_SIZES, {"mixtral": {"num_local_experts": 8}, "qwen3_moe": {"mlp_only_layers": []}}, 0.2),
    "0.5B": (HALF_B_SIZES, HALF_B_OPTIONS, 0.02),
}
# Each MoE family's dense counterpart: the same attention, no experts.
DENSE_TWINS = {"qwen3_moe": "qwen3", "mixtral": "llama"}
BATCHES = (1, 8)
Speeds = dict[str, float]  # "decode x1", "decode x8", "prefill" -> tokens/s


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the tiny size only")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads, both sides (default: torch's)")
    p.add_argument("--context", type=int, default=128, help="prompt tokens of each decoding sequence")
    p.add_argument("--decode-tokens", type=int, default=16, help="tokens each decoding sequence generates")
    p.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill run")
    p.add_argument("--families", default=None, help="comma-separated subset of the families")
    return p.parse_args(argv)


class Prompts:
    """Random prompts from one seeded generator: their lengths matter, not their tokens."""

    def __init__(self, vocab_size: int, seed: int = 0):
        self.gen = torch.Generator().manual_seed(seed)
        self.vocab_size = vocab_size

    def __call__(self, batch: int, length: int) -> list[list[int]]:
        return torch.randint(0, self.vocab_size, (batch, length), generator=self.gen).tolist()


# --------------------------------------------------------------------------- memserve
_request_ids = count()


def run_engine(engine: Engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, float]:
    """(seconds of the first step, seconds of the steps after it) to generate
    ``max_tokens`` for every prompt, all added at once (the first step prefills them all)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for prompt in prompts:
        assert engine.add_request(AddRequest(f"r{next(_request_ids)}", prompt, params)) is None
    start = time.perf_counter()
    engine.step()
    first = time.perf_counter()
    while engine.has_work:
        engine.step()
    return first - start, time.perf_counter() - first


def memserve_speeds(folder: Path, args: argparse.Namespace, prompts: Prompts) -> Speeds:
    tokens_per_step = max(args.prefill, max(BATCHES) * args.context)
    block = EngineConfig.block_size
    blocks = max(BATCHES) * -(-(args.context + args.decode_tokens) // block) + -(-args.prefill // block) + 8
    cfg = EngineConfig(model=str(folder), dtype="float32", num_blocks=blocks, max_num_seqs=max(BATCHES),
                       max_num_batched_tokens=tokens_per_step, max_model_len=tokens_per_step,
                       enable_prefix_caching=False, async_save=False)
    engine = build_engine(cfg, folder)
    run_engine(engine, prompts(2, 16), 2)  # warm-up
    speeds = {}
    for batch in BATCHES:
        _, decode = run_engine(engine, prompts(batch, args.context), args.decode_tokens)
        speeds[f"decode x{batch}"] = batch * (args.decode_tokens - 1) / decode
    prefill, _ = run_engine(engine, prompts(1, args.prefill), 1)
    speeds["prefill"] = args.prefill / prefill
    return speeds


# --------------------------------------------------------------------------- transformers
class StepClock(LogitsProcessor):
    """When generate produced each token (it calls this once a token, after the forward)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.times.append(time.perf_counter())
        return scores


def hf_generate(model: PreTrainedModel, prompts: list[list[int]], new_tokens: int) -> list[float]:
    clock = StepClock()
    ids = torch.tensor(prompts)
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, eos_token_id=None, pad_token_id=0,
                       logits_processor=LogitsProcessorList([clock]))
    return clock.times


def transformers_speeds(model: PreTrainedModel, args: argparse.Namespace, prompts: Prompts) -> Speeds:
    hf_generate(model, prompts(2, 16), 2)  # warm-up
    speeds = {}
    for batch in BATCHES:
        times = hf_generate(model, prompts(batch, args.context), args.decode_tokens)
        speeds[f"decode x{batch}"] = batch * (len(times) - 1) / (times[-1] - times[0])
    start = time.perf_counter()
    hf_generate(model, prompts(1, args.prefill), 1)
    speeds["prefill"] = args.prefill / (time.perf_counter() - start)
    return speeds


# --------------------------------------------------------------------------- runs
def measure(name: str, size: str, args: argparse.Namespace, with_transformers: bool = True,
            **overrides: object) -> tuple[int, Speeds, Speeds | None, PretrainedConfig]:
    """(parameters, memserve's speeds, transformers' or None, the model's config) of a
    random ``name`` model of ``size``; transformers runs first and its model is freed
    before memserve loads the saved copy."""
    sizes, options, std = SIZES[size]
    with no_init_weights():  # random_model draws every weight itself: skip transformers' init
        model = random_model(name, sizes, std=std, **{**options.get(name, {}), **overrides})
    model.tie_weights()  # part of the init skipped
    params = sum(p.numel() for p in model.parameters())
    config = model.config
    prompts = Prompts(config.vocab_size)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        theirs = transformers_speeds(model, args, prompts) if with_transformers else None
        del model
        ours = memserve_speeds(Path(tmp), args, prompts)
    return params, ours, theirs, config


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |")
    print("| " + " | ".join("-" * (w - 1) + (":" if i else "-") for i, w in enumerate(widths)) + " |")
    for row in rows:
        print("| " + " | ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))) + " |")


def rate(tokens_per_s: float) -> str:
    return f"{tokens_per_s:,.0f}" if tokens_per_s >= 100 else f"{tokens_per_s:.1f}"


def speed_cells(ours: Speeds, theirs: Speeds | None) -> list[str]:
    cells = []
    for kind in ours:
        cells.append(rate(ours[kind]))
        if theirs is not None:
            cells += [rate(theirs[kind]), f"{ours[kind] / theirs[kind]:.2f}x"]
    return cells


def moe_against_dense(name: str, size: str, args: argparse.Namespace, moe: Speeds,
                      config: PretrainedConfig) -> list[list[str]]:
    """Rows of the MoE model and of its dense twin, whose MLP is twice the experts' width
    (the twin's parameters are the MoE's active ones, its router aside)."""
    width = config.moe_intermediate_size if name == "qwen3_moe" else config.intermediate_size
    twin = DENSE_TWINS[name]
    params, dense, _, _ = measure(twin, size, args, with_transformers=False, intermediate_size=2 * width,
                                  attention_bias=False)
    active = f"{params / 1e6:,.1f}M"
    return [[f"{name} {size}", active, *map(rate, moe.values()), *(f"{moe[k] / dense[k]:.2f}x" for k in moe)],
            [f"{twin} {size}, MLP {2 * width}", active, *map(rate, dense.values()), *([""] * len(moe))]]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    transformers_logging.disable_progress_bar()  # one per save_pretrained
    if args.threads:
        torch.set_num_threads(args.threads)
    families = [f for f in (args.families.split(",") if args.families else TINY_ARCHITECTURES)
                if f in SUPPORTED_MODEL_TYPES]
    sizes = ["tiny"] if args.quick else list(SIZES)
    print(f"float32, {torch.get_num_threads()} threads; decode: {args.decode_tokens} tokens after "
          f"{args.context}-token prompts; prefill: {args.prefill} tokens; one run each (noisy on a shared machine)\n")
    kinds = [f"decode x{b}" for b in BATCHES] + ["prefill"]
    headers = ["model", "params"] + [f"{k} {side}" for k in kinds for side in ("memserve", "HF", "ratio")]
    rows, moe_rows = [], []
    started = time.perf_counter()
    for size in sizes:
        for name in families:
            params, ours, theirs, config = measure(name, size, args)
            rows.append([f"{name} {size}", f"{params / 1e6:,.1f}M", *speed_cells(ours, theirs)])
            print(f"  {name} {size}: {time.perf_counter() - started:.0f} s", flush=True)
            if name in DENSE_TWINS:
                moe_rows += moe_against_dense(name, size, args, ours, config)
    print()
    print_table(headers, rows)
    if moe_rows:
        print("\nmemserve tokens/s: 8 experts, 2 chosen, against a dense MLP of the same active parameters\n")
        print_table(["model", "active params", *kinds, *(f"{k} MoE/dense" for k in kinds)], moe_rows)
    print(f"\n{time.perf_counter() - started:.0f} s in all")


if __name__ == "__main__":
    main()
