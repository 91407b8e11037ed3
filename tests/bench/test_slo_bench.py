"""Per-request SLOs in `memserve bench` (``--slo-scale``, CacheOpt §5's uniform scale)
and the arithmetic of benchmarks/real/slo_serving.py (pooled means, scoring a run against
SLOs afterwards, the sustainable rate), by hand-computed expectation."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from memserve.bench.cli import configure_parser, replay_options
from memserve.workload.records import RequestRecord
from memserve.workload.replay import ReplayOptions

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "real"))
import slo_serving


def test_without_a_scale_every_request_gets_the_base_slos():
    options = ReplayOptions(slo_ttft_ms=200.0, slo_tbt_ms=None)
    assert options.slos("s1", 1) == (200.0, None)


def test_a_scale_is_drawn_per_request_and_applies_to_both_slos():
    options = ReplayOptions(slo_ttft_ms=200.0, slo_tbt_ms=50.0, slo_scale=(0.5, 2.5), seed=3)
    draws = [options.slos(f"s{i}", 1) for i in range(200)]
    scales = [ttft / 200.0 for ttft, _ in draws]
    assert all(0.5 <= s <= 2.5 for s in scales)
    assert all(tbt == pytest.approx(ttft / 4) for ttft, tbt in draws)  # one scale for both
    assert min(scales) < 0.7 and max(scales) > 2.3  # spread over the range
    assert options.slos("s7", 1) == draws[7]  # the same request, the same SLOs, in any order
    assert options.slos("s7", 2) != draws[7]
    assert ReplayOptions(slo_ttft_ms=200.0, slo_scale=(0.5, 2.5), seed=4).slos("s7", 1) != draws[7]


def test_the_bench_flag_reaches_the_replay_options():
    parser = argparse.ArgumentParser()
    configure_parser(parser)
    args = parser.parse_args(["--slo-ttft-ms", "100", "--slo-scale", "0.5:2.5"])
    assert replay_options(args, 1.0).slo_scale == (0.5, 2.5)
    for bad in ("2.5:0.5", "0:1", "fast"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--slo-scale", bad])


def point(rate: float, ttft_att: float, tbt_att: float) -> dict:
    return {"rate": rate, "slo_attainment": {"ttft": ttft_att, "tbt": tbt_att}}


def test_sustainable_rate_interpolates_where_attainment_crosses():
    points = [point(0.5, 1.0, 0.99), point(1.0, 0.95, 0.97), point(2.0, 0.85, 0.6)]
    # min attainment 0.95 at 1/s, 0.6 at 2/s: 0.9 is crossed 0.05/0.35 of the way.
    assert slo_serving.sustainable_rate(points, 0.9) == pytest.approx(1.0 + 0.05 / 0.35)
    assert slo_serving.sustainable_rate([point(1.0, 0.8, 1.0)], 0.9) is None
    assert slo_serving.sustainable_rate(points[:2], 0.9) == 1.0


def test_pooled_mean_weights_each_rate_by_its_samples():
    sweep = [{"ttft_ms": {"mean": 100.0, "count": 3}}, {"ttft_ms": {"mean": 200.0, "count": 1}},
             {"ttft_ms": {"mean": None, "count": 0}}]
    assert slo_serving.pooled_mean(sweep, "ttft_ms") == pytest.approx(125.0)


def test_a_run_without_slos_is_scored_against_the_slos_it_would_have_carried():
    fast = RequestRecord("a", 1, 0.0, end=1.0, chunk_times=[0.1, 0.12, 0.14], chunk_tokens=[1, 1, 1])
    slow = RequestRecord("b", 1, 0.0, end=2.0, chunk_times=[1.5, 1.9], chunk_tokens=[1, 1])
    sweep = [{"rate": 1.0, "duration_s": 2.0, "requests": [fast.to_json(), slow.to_json()]}]
    slos = ReplayOptions(slo_ttft_ms=500.0, slo_tbt_ms=100.0)
    [scored] = slo_serving.scored(sweep, slos)
    # a: TTFT 100 ms, gaps 20 ms: both met. b: TTFT 1500 ms, gap 400 ms: both missed.
    assert scored["rate"] == 1.0 and scored["slo_attainment"] == {"ttft": 0.5, "tbt": 0.5, "both": 0.5}
