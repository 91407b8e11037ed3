"""Per-token cost of what requests may add to sampling, as a ratio to plain sampling.

One decode step's sampling stage is timed on a [batch, vocab] float32 logits tensor (the
model's vocabulary, random values: softmax, top-k and sorting cost the same whatever the
values), with every row asking for the feature, against the same rows sampled plainly
(temperature 0.8, top-p 0.95, each with its own seed). One function per
feature builds that feature's step; the forward pass, identical for all, is left out, so
the ratio is an upper bound on what the feature adds to a whole decode step.

    python benchmarks/micro/sampling_overhead.py --device cpu --batch 1 16
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Callable

import torch

from memserve.gateway.structured_output import json_schema_grammar
from memserve.ipc.messages import SamplingParams
from memserve.model_files.generation import eos_token_ids
from memserve.model_files.gguf_convert import ensure_model_dir
from memserve.workers.model.grammar import GrammarMatchers
from memserve.workers.model.logprobs import log_softmax_rows, sampled_logprobs
from memserve.workers.model.penalties import TokenHistory
from memserve.workers.model.sampler import Sampler, position_uniform

VOCAB = 49152  # SmolLM2's vocabulary
PLAIN = SamplingParams(temperature=0.8, top_p=0.95)

# A step: (logits, the rows' uniform numbers) -> sampled tokens, with whatever the feature adds.
Step = Callable[[torch.Tensor, list[float | None]], object]


def plain_step(batch: int) -> Step:
    sampler, params = Sampler(), [PLAIN] * batch
    return lambda logits, uniforms: sampler.sample(logits, params, uniforms)


def logprobs_step(batch: int, top: int = 5) -> Step:
    """The chosen token's logprob and the ``top`` best, as a completions ``logprobs: 5``
    (or chat ``top_logprobs: 5``) request costs in the worker."""
    sampler = Sampler()
    params = [SamplingParams(temperature=0.8, top_p=0.95, logprobs=top)] * batch
    ids = [f"r{i}" for i in range(batch)]

    def step(logits: torch.Tensor, uniforms: list[float | None]) -> object:
        rows, log_probs = log_softmax_rows(logits, params)
        tokens = sampler.sample(logits, params, uniforms)
        return sampled_logprobs(rows, log_probs, tokens, params, ids)

    return step


def penalties_step(batch: int, prompt_len: int = 512, output_len: int = 256) -> Step:
    """presence, frequency and repetition penalties together, mid-answer: each row has
    seen a ``prompt_len``-token prompt and ``output_len`` tokens of its own."""
    sampler = Sampler()
    params = [SamplingParams(temperature=0.8, top_p=0.95, presence_penalty=0.5, frequency_penalty=0.5,
                             repetition_penalty=1.1)] * batch
    gen = torch.Generator().manual_seed(0)
    histories: list[TokenHistory | None] = []
    for p in params:
        history = TokenHistory.create(p, torch.randint(VOCAB, (prompt_len,), generator=gen).tolist(), set())
        history.output_ids = torch.randint(VOCAB, (output_len,), generator=gen).tolist()  # type: ignore[union-attr]
        histories.append(history)
    return lambda logits, uniforms: sampler.sample(logits, params, uniforms, histories)


def logit_bias_step(batch: int, entries: int = 300) -> Step:
    """``logit_bias`` at OpenAI's cap of ``entries`` tokens per row."""
    sampler = Sampler()
    bias = {t: 5.0 for t in range(0, VOCAB, VOCAB // entries)[:entries]}
    params = [SamplingParams(temperature=0.8, top_p=0.95, logit_bias=bias)] * batch
    return lambda logits, uniforms: sampler.sample(logits, params, uniforms)


def grammar_step(batch: int) -> Step:
    """``response_format: json_schema`` on every row: the rows' token masks are filled
    (llguidance), applied to the logits, and each matcher advances by its sampled token;
    a row whose JSON is complete (it sampled EOS, the only token then allowed) starts
    over. Random logits keep the rows mostly inside strings, the lexer's busiest state."""
    eos = eos_token_ids(ensure_model_dir(None))
    grammars = GrammarMatchers(ensure_model_dir(None), VOCAB, eos)
    grammar = json_schema_grammar({"type": "object", "properties": {
        "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
        "score": {"type": "integer"}}, "required": ["name", "tags", "score"]}, "response_format")
    sampler, params = Sampler(), [PLAIN] * batch
    ids = [f"r{i}" for i in range(batch)]
    for rid in ids:
        grammars.start(rid, grammar)

    def step(logits: torch.Tensor, uniforms: list[float | None]) -> object:
        tokens = sampler.sample(logits, params, uniforms, grammars=grammars.rows(ids))
        grammars.accept(ids, tokens)
        for rid, token in zip(ids, tokens):
            if token in eos:
                grammars.forget(rid)
                grammars.start(rid, grammar)
        return tokens

    return step


FEATURES: dict[str, Callable[[int], Step]] = {"logprobs": logprobs_step, "penalties": penalties_step,
                                              "logit_bias": logit_bias_step, "grammar": grammar_step}


def time_steps(steps: list[Step], batch: int, device: torch.device, iters: int, repeats: int) -> list[float]:
    """Seconds per step of each of ``steps``, timed in turn within each repeat (so load
    from elsewhere on the machine hits them alike); the fastest repeat of each counts,
    the least disturbed by that load."""
    logits = torch.randn(batch, VOCAB, device=device) * 4
    uniforms: list[float | None] = [position_uniform(seed, 0) for seed in range(batch)]
    best = [float("inf")] * len(steps)
    for step in steps:
        for _ in range(3):
            step(logits, uniforms)
    for _ in range(repeats):
        for i, step in enumerate(steps):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(iters):
                step(logits, uniforms)  # every step ends in .tolist(): it waits for the device
            best[i] = min(best[i], (time.perf_counter() - start) / iters)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--features", nargs="+", default=list(FEATURES), choices=list(FEATURES))
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads for torch: on a loaded machine more than one make OpenMP spin and wait")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    for batch in args.batch:
        plain, *costs = time_steps([plain_step(batch), *(FEATURES[name](batch) for name in args.features)], batch,
                                   device, args.iters, args.repeats)
        for name, cost in zip(args.features, costs):
            print(json.dumps({"feature": name, "batch": batch, "device": device.type,
                              "plain_us_per_token": round(plain / batch * 1e6, 1),
                              "feature_us_per_token": round(cost / batch * 1e6, 1), "ratio": round(cost / plain, 3)}))


if __name__ == "__main__":
    main()
