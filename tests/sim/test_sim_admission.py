"""The gateway's admission control in ``memserve simulate``: a burst beyond one instance's
KV is answered with 429s (never a 5xx), the requests it admits meet their TTFT SLO, and
more of the burst meets its SLO than with every request admitted."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers.paths import SHARED_DATA

# 60 requests in 3 s on one instance of 400 KV blocks, every one with a 1 s TTFT SLO.
ARGS = ["--cost-model", "opt-13b-a100", "--workload", "sharegpt", "--dataset", str(SHARED_DATA / "sharegpt-sample.jsonl"),
        "--max-turns", "1", "--fixed-output-len", "--max-tokens", "128", "--num-requests", "60", "--rate", "20",
        "--num-blocks", "400", "--seed", "3", "--slo-ttft-ms", "1000", "--no-progress"]


def simulate(tmp_path, admission: str) -> dict:
    out = tmp_path / f"{admission}.json"
    subprocess.run([sys.executable, "-m", "memserve.cli", "simulate", *ARGS, "--admission", admission,
                    "--output", str(out)], check=True, capture_output=True)
    return json.loads(out.read_text())


def ttft_met(request: dict) -> bool:
    return (request["chunk_times"][0] - request["start"]) * 1000 <= request["slo_ttft_ms"]


@pytest.mark.parametrize("mode", ["reject", "queue"])
def test_a_burst_gets_429s_and_the_admitted_meet_their_slo(tmp_path, mode):
    off, gated = simulate(tmp_path, "off"), simulate(tmp_path, mode)
    assert off["num_requests"]["failed"] == 0 and off["slo_attainment"]["ttft"] < 0.7  # the burst overloads it
    statuses = {r["status"] for r in gated["requests"]}
    assert statuses == {"ok", "429"}
    admitted = [r for r in gated["requests"] if r["status"] == "ok"]
    refused = len(gated["requests"]) - len(admitted)
    assert 0 < refused < 30
    assert sum(gated["simulation"]["admission"]["rejected"].values()) == refused
    assert sum(map(ttft_met, admitted)) >= 0.95 * len(admitted)
    assert gated["slo_attainment"]["ttft"] > off["slo_attainment"]["ttft"] + 0.05
