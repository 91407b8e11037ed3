"""Greedy generation on an in-process engine, prompts arriving one step apart."""

from __future__ import annotations

from memserve.ipc.messages import AddRequest, SamplingParams
from memserve.workers.engine.engine import Engine


def generate(engine: Engine, prompts: list[list[int]], max_tokens: int, stagger: bool = True,
             tag: str = "g") -> list[tuple[list[int], int]]:
    """(greedy tokens, cached prompt tokens) of every prompt, ``max_tokens`` each (EOS
    ignored). With ``stagger``, prompt i arrives after i steps, so steps mix prefills with
    decodes; otherwise all arrive at once."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    cached: dict[str, int] = {}
    pending = list(zip(ids, prompts))
    while pending or engine.has_work:
        for rid, prompt in pending[: 1 if stagger else len(pending)]:
            assert engine.add_request(AddRequest(rid, prompt, params)) is None
        pending = pending[1:] if stagger else []
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            cached[out.request_id] = out.num_cached_tokens
    return [(tokens[rid], cached[rid]) for rid in ids]
