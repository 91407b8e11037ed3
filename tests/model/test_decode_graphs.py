"""The decode-graph path (workers/model/decode_graphs.py) run eagerly on the CPU: what a
CUDA graph would capture, replayed by re-running it, must give the eager path's hidden
states and greedy tokens, write nothing but the scratch block for its padding rows, and
call every layer hook; which models are captured, and why the others are not.
tests/cuda checks real capture and replay on a GPU; test_triton_backend.py the graphs of
a windowed, soft-capped model through the Triton kernel."""

from __future__ import annotations

import pytest
import torch
from helpers.eager_graphs import EagerCapture, graphed_engine
from helpers.engine_generate import generate

from memserve.config import EngineConfig
from memserve.model_files.generation import eos_token_ids
from memserve.testing.random_models import TINY_SIZES, save_tiny_model
from memserve.workers.engine.engine import Engine
from memserve.workers.model.attention import AttentionMetadata, AttentionPlan, allocate_kv_cache
from memserve.workers.model.decode_graphs import DecodeGraphs, decode_buckets, eager_reason
from memserve.workers.model.loader import load_model
from memserve.workers.model_runner import ModelRunner

BS = 16


def test_buckets_are_powers_of_two_capped_by_context_tokens():
    buckets = decode_buckets(max_batch=48, max_blocks=100, block_size=16)
    assert buckets[0] == (32, 100) and (48, 64) in buckets  # largest first; the limits themselves are buckets
    assert all(b * w * 16 <= 1 << 16 for b, w in buckets)
    assert {w for _, w in buckets} == {8, 16, 32, 64, 100}
    assert {b for b, _ in buckets} == {1, 2, 4, 8, 16, 32, 48}
    assert decode_buckets(1, 3, 16) == [(1, 3)]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model(folder, "llama")
    return folder


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def before_layer(self, layer: int) -> None:
        self.calls.append(("before", layer))

    def after_layer(self, layer: int) -> None:
        self.calls.append(("after", layer))


def test_static_decode_matches_the_eager_decode_and_writes_only_the_scratch_block(tiny_llama):
    model = load_model(tiny_llama, torch.float32, "cpu")
    cfg = model.config
    num_blocks, scratch = 24, 23
    cache = allocate_kv_cache(num_blocks, cfg.num_layers, BS, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(1)
    lens = [5, 40, 17]  # prompts, prefilled eagerly together
    tables = [[3, 9], [0, 14, 7], [20, 2]]
    prompts = [torch.randint(0, TINY_SIZES["vocab_size"], (n,), generator=gen).tolist() for n in lens]
    starts = [0, 5, 45, 62]
    slots = [tables[i][p // BS] * BS + p % BS for i, n in enumerate(lens) for p in range(n)]
    padded = torch.tensor([t + [0] * (3 - len(t)) for t in tables])
    meta = AttentionMetadata(torch.tensor(slots), starts, lens, padded, BS)
    hidden = model(torch.tensor(sum(prompts, [])), torch.tensor([p for n in lens for p in range(n)]), cache, meta)
    tokens = model.compute_logits(hidden[[s - 1 for s in starts[1:]]]).argmax(-1).tolist()

    graphs = DecodeGraphs(model, cache, "aggregated", BS, scratch, max_batch=4, max_blocks=8)
    graphs.capture(EagerCapture())
    assert graphs.num_graphs == len(graphs.buckets) == 3  # batches 1, 2, 4 of width 8
    eager_cache = cache.clone()
    for step in range(3):  # three decode steps, batch 3 in the bucket of 4: one padding row
        positions = [n + step for n in lens]
        step_slots = [tables[i][p // BS] * BS + p % BS for i, p in enumerate(positions)]
        contexts = [p + 1 for p in positions]
        hooks = Recorder()
        before = cache.clone()
        got = graphs.run(tokens, positions, step_slots, [0, 1, 2, 3], contexts, tables, hooks)
        assert got is not None and got.shape[0] == 3
        assert hooks.calls == [("before", i) for i in range(3)] + [("after", i) for i in range(3)]
        written = {s // BS for s in step_slots} | {scratch}
        untouched = [b for b in range(num_blocks) if b not in written]
        assert torch.equal(cache[untouched], before[untouched])

        meta = AttentionMetadata(torch.tensor(step_slots), [0, 1, 2, 3], contexts, padded, BS)
        expected = model(torch.tensor(tokens), torch.tensor(positions), eager_cache, meta)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        tokens = model.compute_logits(got).argmax(-1).tolist()
        assert tokens == model.compute_logits(expected).argmax(-1).tolist()
    assert graphs.run([1], [200], [0], [0, 1], [201], [list(range(13))], Recorder()) is None  # 13 blocks: no bucket
    assert graphs.run([1, 2], [40, 41], [0, 1], [0, 2], [42], [[3, 9, 4]], Recorder()) is None  # 2 tokens a row


def test_runner_replays_decode_steps_with_the_eager_tokens(tiny_llama):
    """The runner's graph path under real engine steps: graphs for the pure decode steps,
    eager prefills and mixed steps, the same tokens as a runner without graphs."""
    cfg = EngineConfig(model=str(tiny_llama), dtype="float32", num_blocks=40, max_num_seqs=4)
    eager = Engine(cfg, ModelRunner(cfg, tiny_llama), eos_token_ids(tiny_llama))
    capture = EagerCapture()
    graphed = graphed_engine(cfg, tiny_llama, 16, capture)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, TINY_SIZES["vocab_size"], (n,), generator=gen).tolist() for n in (9, 70, 33)]
    assert generate(graphed, prompts, 12) == generate(eager, prompts, 12)
    assert capture.replays >= 8  # the pure decode steps (most of the 14) were replayed


@pytest.mark.parametrize("family", ["llama", "gemma2", "gemma3_text", "mistral", "qwen3_moe", "mixtral"])
def test_which_models_graphs_capture(tmp_path, family):
    """Windows and soft-caps are captured through the Triton kernel only; experts in bf16 on
    Hopper and Blackwell only; never with tensor parallelism or adapters."""
    save_tiny_model(tmp_path, family)
    model = load_model(tmp_path, torch.float32, "cpu")
    bf16, hopper, ampere = torch.bfloat16, (9, 0), (8, 0)
    attends_plainly = family in ("llama", "qwen3_moe", "mixtral")
    assert (eager_reason(model, "sdpa", bf16, hopper, 1, False) is None) == attends_plainly
    assert (eager_reason(model, "xformers", bf16, hopper, 1, False) is None) == attends_plainly
    assert eager_reason(model, "triton", bf16, hopper, 1, False) is None
    moe = family in ("qwen3_moe", "mixtral")
    for dtype, capability in ((bf16, ampere), (torch.float16, hopper), (torch.float32, (10, 0))):
        reason = eager_reason(model, "triton", dtype, capability, 1, False)
        assert (reason is not None and "grouped GEMM" in reason) == moe
    assert eager_reason(model, "triton", bf16, (10, 0), 1, False) is None
    assert "collectives" in str(eager_reason(model, "triton", bf16, hopper, 2, False))
    assert "LoRA" in str(eager_reason(model, "triton", bf16, hopper, 1, True))


def test_static_plans_apply_windows_only_through_triton():
    slots, tables, lens = torch.tensor([3, 20]), torch.tensor([[0], [1]]), torch.tensor([4, 5])
    plans = AttentionPlan.static_windows(slots, tables, lens, BS, "aggregated", "triton", (0, 7, 0, 7), 5.0)
    assert sorted(plans) == [0, 7] and plans[7].window == 7 and plans[0].window == 0
    assert plans[0].softcap == plans[7].softcap == 5.0 and plans[0].triton is plans[7].triton
    assert list(AttentionPlan.static_windows(slots, tables, lens, BS, "aggregated", "sdpa", (0, 0))) == [0]
    with pytest.raises(ValueError, match="triton"):
        AttentionPlan.static_windows(slots, tables, lens, BS, "aggregated", "sdpa", (0, 7))
    with pytest.raises(ValueError, match="triton"):
        AttentionPlan.static_windows(slots, tables, lens, BS, "aggregated", "sdpa", (0,), 5.0)
