"""Multi-turn ShareGPT conversations replayed on an in-process engine."""

from __future__ import annotations

import json
import random

from helpers.paths import SHARED_DATA
from memserve.ipc.messages import AddRequest, SamplingParams
from memserve.text.tokenizer import Tokenizer
from memserve.workers.engine.engine import Engine

MAX_TOKENS = 12


def run(engine: Engine, prompts: dict[str, list[int]], max_tokens: int = MAX_TOKENS) -> dict[str, tuple[list, int]]:
    """Submit all prompts at once, step to completion; {id: (tokens, cached_tokens)}."""
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    cached: dict[str, int] = {}
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    for rid, ids in prompts.items():
        assert engine.add_request(AddRequest(rid, ids, params)) is None
    done: set[str] = set()
    while engine.has_work:
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
            cached[o.request_id] = o.num_cached_tokens
            if o.finished:
                done.add(o.request_id)
    assert done == set(prompts)
    return {rid: (out[rid], cached[rid]) for rid in prompts}


def conversations(n: int, seed: int = 0) -> list[list[dict]]:
    lines = (SHARED_DATA / "sharegpt-sample.jsonl").read_text().splitlines()
    convs = [json.loads(line)["messages"] for line in lines]
    convs = [c for c in convs if len(c) >= 6 and sum(len(m["content"]) for m in c[:6]) < 3000]
    return random.Random(seed).sample(convs, n)


def replay(engine: Engine, tokenizer: Tokenizer, convs: list[list[dict]], turns: int, tag: str):
    """Turn-by-turn replay of several sessions in lock step: each turn's history holds
    the answers the engine produced. Returns per-turn {session: (tokens, cached)}."""
    history = [[] for _ in convs]
    results = []
    for turn in range(turns):
        prompts = {}
        for s, conv in enumerate(convs):
            history[s].append({"role": "user", "content": conv[2 * turn]["content"]})
            prompts[f"{tag}-{s}-{turn}"] = tokenizer.encode_chat(history[s])
        outs = run(engine, prompts)
        for s in range(len(convs)):
            tokens, _ = outs[f"{tag}-{s}-{turn}"]
            history[s].append({"role": "assistant", "content": tokenizer.decode(tokens)})
        results.append({s: outs[f"{tag}-{s}-{turn}"] for s in range(len(convs))})
    return results
