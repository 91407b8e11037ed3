"""The Triton attention backend on the CPU, in a process of its own started with
TRITON_INTERPRET=1 (triton chooses its interpreter as it is imported, and a test process
has usually imported it already, through transformers): ``python
tests/helpers/triton_backend_run.py SPEC_JSON`` prints the results as JSON on its last line.

SPEC: ``engines``, by name: folder, prompts, new_tokens, options (EngineConfig fields)
and whether its pure decode steps replay CUDA graphs (``graphs``, captured by re-running:
``helpers/eager_graphs.py``); each engine generates the prompts cold (``cold``) and again
from its prefix cache (``hit``), and counts the drafts it verified and the graphs it
replayed (those of rows of several tokens apart). ``plans``: the largest difference between
the Triton kernel's output and the SDPA path's for a mixed batch (decode rows, verify
rows, a chunk after a cached prefix, a prompt) and for a CUDA-graph decode plan run
eagerly, each for the windows and soft-caps listed."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers.eager_graphs import EagerCapture, graphed_engine  # noqa: E402
from helpers.engine_generate import generate  # noqa: E402

from memserve.config import EngineConfig  # noqa: E402
from memserve.testing.paged_batch import paged_batch  # noqa: E402
from memserve.workers.model.attention import (  # noqa: E402
    AttentionMetadata,
    AttentionPlan,
    allocate_kv_cache,
    layer_kv,
    paged_attention,
)
from memserve.workers.real_engine import build_engine  # noqa: E402

HEADS, KV_HEADS, DIM, BLOCK_SIZE = 4, 2, 32, 8
GRAPH_BLOCKS = 4  # the widest decode graph of an engine with ``graphs``: 4 blocks of 16
# (new tokens, context after the step): a decode row, verify rows of a decode with two
# drafts, a chunk after a cached prefix, a prompt with nothing cached.
MIXED = [(1, 40), (3, 30), (12, 45), (20, 20)]


def run_engine(spec: dict) -> dict:
    folder = Path(spec["folder"])
    cfg = EngineConfig(model=str(folder), dtype="float32", num_blocks=64, max_num_seqs=8, attention_backend="triton",
                       cpu_prefill_attention="sdpa", **spec.get("options", {}))
    capture = EagerCapture()
    engine = graphed_engine(cfg, folder, GRAPH_BLOCKS, capture) if spec.get("graphs") else build_engine(cfg, folder)
    assert engine.runner.attention_backend == "triton"
    prompts, n = spec["prompts"], spec["new_tokens"]
    out = {"cold": generate(engine, prompts, n), "hit": generate(engine, prompts, n, tag="hit")}
    graphs = engine.runner.graphs
    # Replays of graphs whose rows hold several tokens: decodes with drafts.
    wide = sum(n for (_, _, tokens), n in zip(graphs.buckets, capture.replays_of) if tokens > 1) if graphs else 0
    return {**out, "drafts": engine.scheduler.draft_tokens_total, "replays": capture.replays, "wide_replays": wide}


def both_plans(meta: AttentionMetadata, window: int, softcap: float) -> list[AttentionPlan]:
    """The SDPA plan (the reference) and the Triton plan of the same step."""
    return [AttentionPlan.build(dataclasses.replace(meta, attention_backend=backend), torch.device("cpu"), window,
                                softcap) for backend in ("sdpa", "triton")]


def plan_difference(window: int, softcap: float, layout: str) -> float:
    """Largest |Triton - SDPA| over a mixed batch's outputs, float32, layer 1 of a pool of 2."""
    gen = torch.Generator().manual_seed(window * 10 + int(softcap))
    batch = paged_batch(gen, MIXED, BLOCK_SIZE)
    meta = batch.metadata(BLOCK_SIZE, layout, "sdpa", torch.device("cpu"))
    pool = allocate_kv_cache(batch.num_blocks, 2, BLOCK_SIZE, KV_HEADS, DIM, torch.float32, "cpu", layout).normal_(
        generator=gen)
    num_tokens = batch.query_start_loc[-1]
    qkv = torch.randn(num_tokens, HEADS + 2 * KV_HEADS, DIM, generator=gen)
    q, k, v = qkv.split([HEADS, KV_HEADS, KV_HEADS], dim=1)  # strided views, as the model has them
    outputs = []
    for plan in both_plans(meta, window, softcap):
        cache = pool.clone()
        outputs.append(paged_attention(q, k, v, *layer_kv(cache, 1, layout), plan, DIM**-0.5))
    return float((outputs[0] - outputs[1]).abs().max())


def static_difference(layout: str) -> float:
    """Largest |Triton - SDPA| of a CUDA-graph decode plan (``AttentionPlan.static``) run
    eagerly: one new token per row, every row's table as wide as the widest."""
    gen = torch.Generator().manual_seed(7)
    specs = [(1, 40), (1, 9), (1, 17)]
    batch = paged_batch(gen, specs, BLOCK_SIZE)
    tables, slots, context_lens = batch.block_tables, batch.slots, torch.tensor(batch.context_lens)
    pool = allocate_kv_cache(batch.num_blocks, 2, BLOCK_SIZE, KV_HEADS, DIM, torch.float32, "cpu",
                             layout).normal_(generator=gen)
    qkv = torch.randn(len(specs), HEADS + 2 * KV_HEADS, DIM, generator=gen)
    q, k, v = qkv.split([HEADS, KV_HEADS, KV_HEADS], dim=1)
    outputs = []
    for backend in ("sdpa", "triton"):
        plan = AttentionPlan.static(slots, tables, context_lens, BLOCK_SIZE, layout, backend)
        cache = pool.clone()
        outputs.append(paged_attention(q, k, v, *layer_kv(cache, 1, layout), plan, DIM**-0.5))
    return float((outputs[0] - outputs[1]).abs().max())


def run(spec: dict) -> dict:
    torch.set_num_threads(1)  # tiny shapes on a shared machine: a second thread only waits
    out: dict = {"engines": {name: run_engine(s) for name, s in spec.get("engines", {}).items()}}
    out["plans"] = {f"{w}-{c}-{layout}": plan_difference(w, c, layout) for w, c, layout in spec.get("plans", [])}
    out["static"] = {layout: static_difference(layout) for layout in spec.get("static", [])}
    return out


if __name__ == "__main__":
    print(json.dumps(run(json.loads(sys.argv[1]))))
