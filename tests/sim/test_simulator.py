"""``memserve simulate``: the real engine on a cost-model clock. Same inputs give the
same results, the simulator never imports torch, and its results are the bench's."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers.paths import SHARED_DATA

ARGS = ["--cost-model", "opt-13b-a100", "--instances", "2", "--workload", "sharegpt", "--dataset",
        str(SHARED_DATA / "sharegpt-sample.jsonl"), "--num-sessions", "12", "--max-turns", "3", "--rate", "2",
        "--fixed-output-len", "--max-tokens", "64", "--no-progress", "--seed", "3"]


def simulate(tmp_path, name: str, *extra: str) -> dict:
    out = tmp_path / f"{name}.json"
    subprocess.run([sys.executable, "-m", "memserve.cli", "simulate", *ARGS, *extra, "--output", str(out)],
                   check=True, capture_output=True)
    result = json.loads(out.read_text())
    del result["simulation"]["wall_s"], result["simulation"]["requests_per_wall_s"], result["config"]["output"]
    return result


def test_same_seed_same_results_and_bench_shaped(tmp_path):
    a, b = simulate(tmp_path, "a"), simulate(tmp_path, "b")
    assert a == b
    assert a["num_requests"]["ok"] == len(a["requests"]) > 12  # multi-turn: later turns were sent
    assert a["errors"]["count"] == 0
    assert {"ttft_ms", "tbt_ms", "jct_ms", "cached_token_ratio", "by_turn", "throughput"} <= a.keys()
    assert a["cached_token_ratio"] > 0.2  # later turns reuse their history's KV
    assert simulate(tmp_path, "c", "--seed", "4") != a


def test_caching_off_computes_every_prompt_token(tmp_path):
    off = simulate(tmp_path, "off", "--no-prefix-cache")
    assert off["cached_token_ratio"] == 0
    on = simulate(tmp_path, "on")
    assert on["ttft_ms"]["mean"] < off["ttft_ms"]["mean"]


def test_the_simulator_never_imports_torch():
    code = ("import sys, memserve.sim.cli, memserve.sim.simulator, memserve.cli; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
