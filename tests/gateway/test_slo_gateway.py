"""SLOs at the HTTP layer on the scripted fake engine: body fields, ``x-slo-*`` and
``x-priority`` headers and server defaults reach the engine with body > header >
default precedence; bad headers are 400 naming the header; a refusal is a 429 OpenAI
error with Retry-After; attainment of finished requests and the admission, preemption
and predictor figures appear on /metrics."""

from __future__ import annotations

import pytest
from helpers.fake_engine import FakeEngine, async_test, post, serve
from prometheus_client.parser import text_string_to_metric_families

from memserve.gateway.engine_protocol import RequestRejected

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def chat(client, body: dict = CHAT, headers: dict | None = None) -> tuple[int, dict, dict]:
    async with client.post("/v1/chat/completions", json=body, headers=headers or {}) as resp:
        return resp.status, await resp.json(), dict(resp.headers)


@async_test
async def test_headers_body_and_defaults_with_precedence(tokenizer):
    engine = FakeEngine(tokenizer)
    async with serve(engine, tokenizer, slo_defaults={"ttft_ms": 900.0, "tbt_ms": 90.0}) as client:
        assert (await chat(client))[0] == 200
        assert (await chat(client, headers={"x-slo-ttft-ms": "250", "x-slo-tbt-ms": "40.5", "x-priority": "-2"}))[0] == 200
        body = {**CHAT, "slo_ttft_ms": 100, "priority": 3}
        assert (await chat(client, body, headers={"X-SLO-TTFT-MS": "250", "x-priority": "7"}))[0] == 200
    assert [r["slo"] for r in engine.requests] == [
        {"ttft_ms": 900.0, "tbt_ms": 90.0},
        {"ttft_ms": 250.0, "tbt_ms": 40.5, "priority": -2},
        {"ttft_ms": 100.0, "tbt_ms": 90.0, "priority": 3},
    ]


@async_test
async def test_no_slo_anywhere_sends_none(tokenizer):
    engine = FakeEngine(tokenizer)
    async with serve(engine, tokenizer) as client:
        status, _, _ = await post_completion(client)
        assert status == 200
    assert engine.requests[0]["slo"] is None


async def post_completion(client):
    async with client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}) as resp:
        return resp.status, await resp.json(), dict(resp.headers)


@pytest.mark.parametrize("header,value", [("x-slo-ttft-ms", "soon"), ("x-slo-ttft-ms", "0"),
                                          ("x-slo-tbt-ms", "-5"), ("x-slo-tbt-ms", "inf"),
                                          ("x-slo-tbt-ms", "nan"), ("x-priority", "1.5")])
@async_test
async def test_bad_slo_headers_are_400_naming_the_header(tokenizer, header, value):
    engine = FakeEngine(tokenizer)
    async with serve(engine, tokenizer) as client:
        status, body, _ = await chat(client, headers={header: value})
    assert status == 400 and body["error"]["param"] == header
    assert body["error"]["type"] == "BadRequestError" and engine.requests == []


@async_test
async def test_bad_slo_body_field_is_400(tokenizer):
    async with serve(FakeEngine(tokenizer), tokenizer) as client:
        status, body = await post(client, "/v1/chat/completions", {**CHAT, "slo_ttft_ms": -1})
    assert status == 400 and body["error"]["param"] == "slo_ttft_ms"


@async_test
async def test_a_refusal_is_429_with_retry_after_in_openai_shape(tokenizer):
    engine = FakeEngine(tokenizer)
    engine.exception = RequestRejected("the server is too busy to meet this request's TTFT SLO", 2.2)
    async with serve(engine, tokenizer) as client:
        for stream in (False, True):
            status, body, headers = await chat(client, {**CHAT, "stream": stream},
                                               headers={"x-slo-ttft-ms": "100"})
            assert status == 429 and headers["Retry-After"] == "3"
            assert body["error"]["type"] == "TooManyRequestsError" and "TTFT SLO" in body["error"]["message"]


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@async_test
async def test_attainment_admission_preemptions_and_predictor_on_metrics(tokenizer):
    engine = FakeEngine(tokenizer)
    engine.delay_s = 0.02  # every gap between tokens is at least 20 ms
    engine.workers[0].stats.preemptions = {"swap": 2, "recompute": 1}
    stats = engine.stats
    engine.stats = lambda: {**stats(), "admission": {"mode": "queue", "held": 3, "max_held": 8,
                                                       "rejected": {"queue_full": 4}, "admitted": {"held": 5}},
                            "predictor": {"predictions": 9, "observed": 7, "refits": 1, "mean_abs_error": 12.5,
                                          "arrival_rate": 0.5, "confidence": None}}
    async with serve(engine, tokenizer) as client:
        assert (await chat(client, headers={"x-slo-ttft-ms": "60000", "x-slo-tbt-ms": "60000"}))[0] == 200
        assert (await chat(client, headers={"x-slo-ttft-ms": "1", "x-slo-tbt-ms": "5"}))[0] == 200
        assert (await chat(client))[0] == 200  # no SLO: not counted
        async with client.get("/metrics") as resp:
            got = samples(await resp.text())
    slo = "memserve_slo_requests_total"
    assert got[(slo, (("outcome", "met"), ("slo", "ttft")))] == 1
    assert got[(slo, (("outcome", "missed"), ("slo", "ttft")))] == 1
    assert got[(slo, (("outcome", "met"), ("slo", "tbt")))] == 1
    assert got[(slo, (("outcome", "missed"), ("slo", "tbt")))] == 1
    assert got[("memserve_admission_rejections_total", (("reason", "queue_full"),))] == 4
    assert got[("memserve_admission_admitted_total", (("path", "held"),))] == 5
    assert got[("memserve_admission_queue_depth", ())] == 3
    assert got[("memserve_admission_queue_capacity", ())] == 8
    assert got[("memserve_preemptions_total", (("instance", "0"), ("kind", "swap")))] == 2
    assert got[("memserve_predictor_predictions_total", ())] == 9
    assert got[("memserve_predictor_mean_abs_error_tokens", ())] == 12.5
    assert ("memserve_predictor_padding_confidence", ()) not in got  # not known yet
