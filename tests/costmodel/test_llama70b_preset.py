"""The ``llama3-70b-h100-tp8`` preset (Meta-Llama-3-70B, BF16, TP 8 on H100-SXM5) and the
replay in benchmarks/simulated/llama70b_tp8_on_paper.py that sets it against a published
vLLM run: the architecture's counts, the decode step's weight floor, the replay's loop."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from memserve.costmodel.model import DecodeCost
from memserve.costmodel.presets import LLAMA3_70B
from memserve.costmodel.store import load_cost_model

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "simulated" / "llama70b_tp8_on_paper.py"


def on_paper() -> ModuleType:
    spec = importlib.util.spec_from_file_location("llama70b_tp8_on_paper", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_architecture_counts_follow_the_formula():
    L, d, inter, kv, vocab = 80, 8192, 28672, 1024, 128256
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * inter + 2 * d  # q, o; k, v; SwiGLU; two norms
    assert per_layer == 855_654_400
    assert LLAMA3_70B.num_params == L * per_layer + 2 * vocab * d + d == 70_553_706_496
    assert LLAMA3_70B.gemm_flops_per_token == 2 * L * (per_layer - 2 * d)
    assert LLAMA3_70B.kv_bytes_per_token == 2 * L * kv * 2 == 327_680  # GQA: 8 KV heads of 128


def test_decode_at_batch_one_is_the_weight_floor_and_its_fixed_costs():
    cost = load_cost_model("llama3-70b-h100-tp8")
    assert (cost.key.model, cost.key.dtype, cost.key.hardware) == (
        "Meta-Llama-3-70B", "bfloat16", "nvidia-h100-sxm5-80gb-tp8")
    # 141.1 GB of BF16 weights read by 8 ranks at 0.8 of 3.35 TB/s each: 6.58 ms.
    floor = 70.553706496e9 * 2 / (8 * 3.35e12 * 0.8)
    assert floor == pytest.approx(6.58e-3, abs=0.01e-3)
    assert cost.operators["linear"].per_step == pytest.approx(floor)
    # Two all-reduces a layer, priced from NVLink 4 each way (450 GB/s at 0.8), ring 2*7/8.
    allreduce = cost.operators["allreduce"]
    assert allreduce.per_token == pytest.approx(2 * 80 * 8192 * 2 * 2 * 7 / 8 / (450e9 * 0.8))
    assert allreduce.per_step == pytest.approx(160 * 10e-6)
    # Batch 1 at 512 tokens: the floor plus 1.6 ms of all-reduce latency and 2 ms of
    # overhead, plus one token's GEMMs: 10.2 ms, of which the weight floor is the most.
    step = cost.decode_step_s(1, 512)
    assert 9.5e-3 < step < 11e-3
    assert floor / step > 0.6
    assert cost.decode_step_s(8, 8 * 512) - step == pytest.approx(7 * cost.decode.per_seq + 7 * 512 * 1.528e-8,
                                                                  rel=1e-3)


def test_replay_runs_the_published_shape():
    script = on_paper()
    cost = load_cost_model(script.PRESET)
    # A decode step of exactly 10 ms whatever the batch: the loop's bookkeeping shows.
    flat = dataclasses.replace(cost, decode=DecodeCost(per_step=0.010, per_seq=0.0, per_context_token=0.0))
    prefill = flat.prefill_batch_s((x, 0.0) for x in script.INPUT_LENS)
    assert prefill == pytest.approx(cost.prefill_batch_s((x, 0.0) for x in script.INPUT_LENS))
    finish, steps = script.decode_phase(flat, prefill, script.INPUT_LENS, script.OUTPUT_LENS)
    assert finish[8] == pytest.approx(prefill + 5 * 0.010)  # 6 tokens: the prefill's and 5 steps'
    assert finish[6] == finish[7] == prefill  # no text: done at the prefill
    assert len(steps[8]) == 5 and len(steps[1]) == 741 - 624  # the 741-token request alone at last
    figures = script.replay(flat)
    assert set(figures) == set(script.PUBLISHED)
    assert figures["duration_s"] == pytest.approx(prefill + 740 * 0.010)
    assert figures["output_tok_s"] == pytest.approx(2054 / figures["duration_s"])
    assert figures["median_ttft_ms"] == pytest.approx(1e3 * prefill)
    assert figures["mean_ttft_ms"] == pytest.approx(0.8 * 1e3 * prefill)  # two zeros, as vLLM records
    assert figures["mean_tpot_ms"] == pytest.approx(10.0)
    assert figures["median_tpot_ms"] == pytest.approx(10.0)
    # The preset itself lands within a factor 2 of every published figure, its TTFT below
    # vLLM's (it prices the forward pass only, not the server's path to the first token),
    # and its batch-1 decode step within 15%.
    ours = script.replay(cost)
    for key, published in script.PUBLISHED.items():
        assert 0.5 < ours[key] / published < 2.0, key
    assert ours["median_ttft_ms"] < script.PUBLISHED["median_ttft_ms"]
    assert ours["decode_b1_ms"] == pytest.approx(script.PUBLISHED["decode_b1_ms"], rel=0.15)
    assert "| decode step, batch 1 (ms) | 10.23 | 11.23 | 0.91 |" in script.table(ours)
