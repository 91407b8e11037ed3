"""Benchmark metrics on hand-made timelines with exact expected values, and the SSE
parsing that produces those timelines."""

from __future__ import annotations

import asyncio

import pytest

from memserve.bench.client import (
    OpenAIClient,
    RequestSpec,
    SSEDecoder,
    error_message,
    normalize_base_url,
)
from memserve.workload.metrics import (
    by_turn,
    cached_token_ratio,
    compute_metrics,
    jct_ms,
    normalized_latency_ms,
    slo_attainment,
    summarize,
    tbt_attainment_ceiling,
    tbt_gaps_ms,
    tpot_ms,
    ttft_ms,
)
from memserve.workload.records import RequestRecord
from memserve.workload.report import RunPoint, baselines, compare_table, lookup


def rec(session="s", turn=1, start=0.0, chunks=(), tokens=None, end=None, prompt=None, cached=None,
        completion=None, status="ok", slo_ttft=None, slo_tbt=None) -> RequestRecord:
    return RequestRecord(
        session_id=session, turn=turn, start=start, end=end, chunk_times=list(chunks),
        chunk_tokens=list(tokens) if tokens is not None else [1] * len(chunks), prompt_tokens=prompt,
        completion_tokens=completion, cached_tokens=cached, status=status, slo_ttft_ms=slo_ttft,
        slo_tbt_ms=slo_tbt,
    )


# A: first token at 100 ms, gaps 20/30/50 ms, done at 210 ms.
A = rec("a", 1, 0.0, [0.100, 0.120, 0.150, 0.200], end=0.210, prompt=100, cached=40, completion=4,
        slo_ttft=150, slo_tbt=40)
# B: turn 2 of a session, first token at 300 ms, one gap of 10 ms.
B = rec("a", 2, 1.0, [1.300, 1.310], end=1.320, prompt=50, cached=0, completion=2, slo_ttft=150, slo_tbt=40)
# C: rejected.
C = rec("b", 1, 2.0, end=2.010, status="429", slo_ttft=150, slo_tbt=40)


def test_per_request_latencies():
    assert ttft_ms(A) == pytest.approx(100.0)
    assert tbt_gaps_ms(A) == pytest.approx([20.0, 30.0, 50.0])
    assert tpot_ms(A) == pytest.approx(100.0 / 3)
    assert jct_ms(A) == pytest.approx(210.0)
    assert normalized_latency_ms(A) == pytest.approx(52.5)
    assert (ttft_ms(B), tpot_ms(B), jct_ms(B), normalized_latency_ms(B)) == pytest.approx((300, 10, 320, 160))


def test_multi_token_chunk_counts_one_gap_but_all_tokens_in_tpot():
    r = rec(chunks=[0.1, 0.2], tokens=[1, 3], end=0.25, completion=4)
    assert tbt_gaps_ms(r) == pytest.approx([100.0])
    assert tpot_ms(r) == pytest.approx(100.0 / 3)
    assert r.output_tokens == 4
    assert rec(chunks=[0.1, 0.2], tokens=[1, 3], end=0.25).output_tokens == 4  # no usage: sum of chunks


def test_single_token_and_empty_outputs():
    one = rec(chunks=[0.05], end=0.06, completion=1)
    assert tbt_gaps_ms(one) == [] and tpot_ms(one) is None and ttft_ms(one) == pytest.approx(50)
    empty = rec(end=0.07, completion=0)
    assert ttft_ms(empty) is None and normalized_latency_ms(empty) is None


def test_summary_percentiles_interpolate_linearly():
    s = summarize(range(1, 11))
    assert s == {"mean": 5.5, "p50": 5.5, "p90": pytest.approx(9.1), "p99": pytest.approx(9.91), "max": 10.0,
                 "count": 10}
    assert summarize([]) == {"mean": None, "p50": None, "p90": None, "p99": None, "max": None, "count": 0}
    assert summarize([7.0])["p99"] == 7.0


def test_slo_attainment_rules():
    # A: TTFT 100 <= 150 ok, but one gap of 50 > 40 fails TBT. B: TTFT 300 fails, gap 10 ok. C failed: neither.
    att = slo_attainment([A, B, C])
    assert att == {"ttft": pytest.approx(1 / 3), "tbt": pytest.approx(1 / 3), "both": 0.0}
    # a TBT SLO is met only if every gap meets it: exactly at the limit counts as met
    edge = rec(chunks=[0.1, 0.14, 0.18], end=0.2, completion=3, slo_tbt=40.0 + 1e-9)
    assert slo_attainment([edge])["tbt"] == 1.0
    # no output at all is judged by its JCT for TTFT
    silent = rec(start=0.0, end=0.09, completion=0, slo_ttft=100)
    assert slo_attainment([silent])["ttft"] == 1.0
    assert slo_attainment([rec(chunks=[0.1], end=0.1)]) == {"ttft": None, "tbt": None, "both": None}


def test_tbt_attainment_ceiling_is_the_share_of_slos_at_or_above_one_step():
    # base 20 ms x U[0.5, 2.5]: SLOs 10-50 ms; a 15 ms step floor rules out scales below 0.75
    assert tbt_attainment_ceiling(20.0, (0.5, 2.5), 15.0) == pytest.approx(1.75 / 2.0)
    assert tbt_attainment_ceiling(20.0, (0.5, 2.5), 5.0) == 1.0  # every SLO is above the floor
    assert tbt_attainment_ceiling(20.0, (0.5, 2.5), 60.0) == 0.0  # none is
    assert tbt_attainment_ceiling(20.0, (1.0, 1.0), 20.0) == 1.0  # one fixed SLO, exactly one step
    assert tbt_attainment_ceiling(20.0, (1.0, 1.0), 21.0) == 0.0


def test_cached_ratio_is_token_weighted_over_reporting_successes():
    assert cached_token_ratio([A, B, C]) == pytest.approx(40 / 150)
    assert cached_token_ratio([rec(chunks=[0.1], end=0.1, prompt=10)]) is None  # server reports no cached_tokens


def test_by_turn_aggregation():
    A2 = rec("c", 1, 0.0, [0.300], end=0.31, prompt=60, cached=0, completion=1)
    rows = by_turn([A, B, C, A2])
    assert [r["turn"] for r in rows] == [1, 2]
    t1, t2 = rows
    assert (t1["requests"], t1["ok"]) == (3, 2)
    assert t1["ttft_ms"]["mean"] == pytest.approx(200.0) and t1["ttft_ms"]["count"] == 2
    assert t1["cached_token_ratio"] == pytest.approx(40 / 160)
    assert t1["prompt_tokens_mean"] == pytest.approx(80.0)
    assert t2["ttft_ms"]["p50"] == pytest.approx(300.0) and t2["cached_token_ratio"] == 0.0
    returning = compute_metrics([A, B, C, A2], duration_s=1.0)["returning_ttft_ms"]
    assert returning["count"] == 1 and returning["mean"] == pytest.approx(300.0)  # turn 2 only


def test_compute_metrics_run_level_numbers():
    m = compute_metrics([A, B, C], duration_s=2.0)
    assert m["num_requests"] == {"finished": 3, "ok": 2, "failed": 1}
    assert m["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert m["tbt_ms"]["count"] == 4 and m["tbt_ms"]["mean"] == pytest.approx(27.5)
    assert m["tbt_ms"]["p50"] == pytest.approx(25.0)
    assert m["tpot_ms"]["mean"] == pytest.approx((100 / 3 + 10) / 2)
    assert m["jct_ms"]["p50"] == pytest.approx(265.0)
    assert m["normalized_latency_ms_per_token"]["mean"] == pytest.approx((52.5 + 160) / 2)
    assert m["throughput"] == {"requests_per_s": 1.0, "output_tokens_per_s": 3.0, "prompt_tokens_per_s": 75.0}
    assert m["tokens"]["output_per_chunk_mean"] == 1.0
    assert m["cached_token_ratio"] == pytest.approx(40 / 150)
    assert m["errors"] == {"count": 1, "by_status": {"429": 1}, "first_message_by_status": {"429": ""}}
    assert len(m["by_turn"]) == 2


def test_record_json_round_trip_keeps_the_timeline():
    back = RequestRecord.from_json(A.to_json())
    assert ttft_ms(back) == pytest.approx(ttft_ms(A)) and tbt_gaps_ms(back) == pytest.approx(tbt_gaps_ms(A))
    assert "output_text" not in A.to_json()


def test_compare_ratios_use_the_same_rate_of_the_first_run():
    a1, a2 = RunPoint("a", 1.0, {"ttft_ms": {"mean": 100.0}}), RunPoint("a", 2.0, {"ttft_ms": {"mean": 200.0}})
    b1, b2 = RunPoint("b", 1.0, {"ttft_ms": {"mean": 50.0}}), RunPoint("b", 2.0, {"ttft_ms": {"mean": 300.0}})
    assert baselines([a1, a2, b1, b2]) == [a1, a2, a1, a2]
    assert lookup(b2.result, ("ttft_ms", "mean")) == 300.0 and lookup(b2.result, ("tbt_ms", "mean")) is None
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(compare_table([a1, a2, b1, b2]))
    text = console.export_text()
    assert "50.0 (0.50x)" in text and "300.0 (1.50x)" in text


def test_sse_decoder_handles_split_lines_crlf_multiline_and_comments():
    d = SSEDecoder()
    assert d.feed(b'data: {"a"') == []
    assert d.feed(b": 1}\r\n\r\n: keep-alive\n\ndata: x\ndata: y\n\nda") == ['{"a": 1}', "x\ny"]
    assert d.feed(b"ta:[DONE]") == []
    assert d.close() == ["[DONE]"]


def test_error_message_and_base_url_normalisation():
    assert error_message('{"error": {"message": "model  not\\nfound", "code": 404}}') == "model not found"
    assert error_message('{"detail": "Unexpected fields"}') == "Unexpected fields"
    assert error_message("plain text") == "plain text"
    assert normalize_base_url("localhost:8000/v1/") == "http://localhost:8000"


class _FakeContent:
    def __init__(self, pieces: list[bytes]):
        self.pieces = pieces

    async def iter_any(self):
        for p in self.pieces:
            yield p


class _FakeResponse:
    def __init__(self, pieces: list[bytes]):
        self.content = _FakeContent(pieces)


def test_stream_parsing_counts_tokens_per_chunk_from_continuous_usage():
    """A server that reports running usage in every chunk (vLLM's continuous_usage_stats):
    a chunk that carried 3 tokens is counted as 3 tokens but timed as one chunk."""
    pieces = [
        b'data: {"choices":[{"delta":{"role":"assistant"}}]}\n\n',
        b'data: {"choices":[{"delta":{"content":"Hi"}}],"usage":{"prompt_tokens":9,"completion_tokens":1}}\n\n',
        b'data: {"choices":[{"delta":{"content":" the re!"}}],"usage":{"prompt_tokens":9,"completion_tokens":4}}\n\n'
        b'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":4,'
        b'"prompt_tokens_details":{"cached_tokens":8}}}\n\ndata: [DONE]\n\n',
    ]
    client = OpenAIClient(base_url="http://x", model="m")
    record = RequestRecord(session_id="s", turn=1, start=0.0)
    asyncio.run(client._read_stream(_FakeResponse(pieces), record))
    assert record.ok and record.output_text == "Hi the re!"
    assert record.chunk_tokens == [1, 3] and len(record.chunk_times) == 2
    assert (record.prompt_tokens, record.completion_tokens, record.cached_tokens) == (9, 4, 8)


def test_stream_error_event_marks_the_request_failed():
    pieces = [b'data: {"choices":[{"delta":{"content":"a"}}]}\n\ndata: {"error": "worker died"}\n\n']
    client = OpenAIClient(base_url="http://x", model="m")
    record = RequestRecord(session_id="s", turn=1, start=0.0)
    asyncio.run(client._read_stream(_FakeResponse(pieces), record))
    assert record.status == "stream_error" and record.error == "worker died"


@pytest.mark.parametrize(
    "dialect,fixed,expected,absent",
    [
        ("memserve", True, {"ignore_eos": True, "session_id": "s1", "slo_ttft_ms": 200.0}, {"generation_config"}),
        ("openai", True, {"max_tokens": 7}, {"ignore_eos", "session_id", "slo_ttft_ms"}),
        ("transformers", True, {"max_tokens": 7}, {"ignore_eos", "session_id", "slo_ttft_ms"}),
        ("memserve", False, {"session_id": "s1"}, {"ignore_eos"}),
    ],
)
def test_request_body_per_dialect(dialect, fixed, expected, absent):
    client = OpenAIClient(base_url="http://x", model="m", dialect=dialect, extra_body={"top_p": 0.5})
    spec = RequestSpec(session_id="s1", turn=1, messages=[{"role": "user", "content": "hi"}], max_tokens=7,
                       fixed_output_len=fixed, slo_ttft_ms=200.0)
    body = client.body(spec)
    assert body.items() >= expected.items() and not (absent & body.keys())
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True} and body["top_p"] == 0.5
    if dialect == "transformers":
        assert '"min_new_tokens": 7' in body["generation_config"]


def test_lora_modules_spread_conversations_over_adapters_one_each():
    """vLLM bench's --lora-modules: every turn of a conversation names the same adapter,
    and conversations are spread over all of them."""
    client = OpenAIClient(base_url="http://x", model="base", lora_modules=["a", "b", "c", "d"])

    def model(session: str, turn: int) -> str:
        spec = RequestSpec(session_id=session, turn=turn, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        return client.body(spec)["model"]

    chosen = {s: model(f"s{s}", 1) for s in range(40)}
    assert all(model(f"s{s}", 3) == chosen[s] for s in range(40))
    counts = {name: list(chosen.values()).count(name) for name in "abcd"}
    assert min(counts.values()) >= 5, counts
    assert OpenAIClient(base_url="http://x", model="base").model_of("s1") == "base"
