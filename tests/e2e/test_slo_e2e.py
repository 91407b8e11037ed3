"""SLO admission on a real `memserve up` (real model, ZeroMQ worker): a burst beyond
what the cost model says one worker can serve within a tight TTFT SLO is answered with
429s carrying Retry-After and never a 5xx, the admitted requests complete, the SLO
headers are honoured, and /metrics counts rejections and attainment; with
``--admission queue`` the held queue is bounded (``queue_full``) and drains back to 0.

The cost model is hand-made so the admission arithmetic is exact: a prefill costs 10 ms
per new token and decode steps nothing, so a 50-token prompt takes 0.5 s and a
1200 ms SLO admits a request only while at most one other prompt waits before it."""

from __future__ import annotations

import asyncio
import re
import urllib.request

import aiohttp
import pytest
from helpers.paths import REPO

from memserve.bench.server_process import start_server, stop_server
from memserve.costmodel.model import (
    AttentionCost,
    BandwidthCost,
    CostKey,
    CostModel,
    DecodeCost,
    OperatorCost,
)

PROMPT_TOKENS = 50
BURST = 12
SLO_MS = 1200


def cost_model() -> CostModel:
    return CostModel(CostKey("SmolLM2-135M-Instruct", "float32", "test"), 16, kv_bytes_per_token=1,
                     operators={"gemm": OperatorCost(per_token=1e-2)}, attention=AttentionCost(0, 0, 0, 0),
                     decode=DecodeCost(0.0, 0.0, 0.0), copy=BandwidthCost(0.0, 1e12), transfer=BandwidthCost(0.0, 1e12))


def start(tmp, admission: str):
    path = cost_model().save(tmp / "cost.json")
    return start_server(["--num-blocks", "256", "--cost-model", str(path), "--admission", admission,
                         "--admission-queue-size", "2"], tmp / f"memserve-{admission}.log", cwd=REPO)


@pytest.fixture(scope="module")
def reject_server(tmp_path_factory):
    handle = start(tmp_path_factory.mktemp("slo-reject"), "reject")
    yield handle
    stop_server(handle)


@pytest.fixture(scope="module")
def queue_server(tmp_path_factory):
    handle = start(tmp_path_factory.mktemp("slo-queue"), "queue")
    yield handle
    stop_server(handle)


def prompt(i: int) -> list[int]:
    """Distinct prompts (no shared cached prefix, so every prefill costs the full 0.5 s)."""
    return [1000 + 97 * i + k for k in range(PROMPT_TOKENS)]


async def complete(http: aiohttp.ClientSession, base_url: str, i: int, headers: dict) -> tuple[int, dict, dict]:
    body = {"prompt": prompt(i), "max_tokens": 4, "temperature": 0}
    async with http.post(base_url + "/v1/completions", json=body, headers=headers) as resp:
        return resp.status, await resp.json(content_type=None), dict(resp.headers)


async def burst(base_url: str, headers: dict, first: int = 0) -> list[tuple[int, dict, dict]]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        return await asyncio.gather(*(complete(http, base_url, first + i, headers) for i in range(BURST)))


def metrics(server) -> dict[str, float]:
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {m[0]: float(m[1]) for m in re.findall(r"^(memserve_(?:slo|admission)_\S+) (\S+)$", text, re.MULTILINE)}


def check_burst(results: list[tuple[int, dict, dict]]) -> list[tuple[int, dict, dict]]:
    """No 5xx; every 429 an OpenAI error with Retry-After; every 200 a full answer."""
    assert {status for status, _, _ in results} <= {200, 429}, [r[:2] for r in results]
    for status, body, headers in results:
        if status == 429:
            assert body["error"]["type"] == "TooManyRequestsError"
            assert int(headers["Retry-After"]) >= 1
        else:
            assert body["usage"]["completion_tokens"] >= 1 and body["choices"][0]["finish_reason"]
    return [r for r in results if r[0] == 429]


def test_a_burst_beyond_capacity_gets_429s_and_the_admitted_complete(reject_server):
    results = asyncio.run(burst(reject_server.base_url, {"x-slo-ttft-ms": str(SLO_MS)}))
    refused = check_burst(results)
    admitted = BURST - len(refused)
    # At most 2 wait at once within 1.2 s; more only once earlier ones got their first token.
    assert 1 <= admitted < BURST and len(refused) >= BURST // 2, [r[:2] for r in results]
    got = metrics(reject_server)
    assert got['memserve_admission_rejections_total{reason="slo_unattainable"}'] == len(refused)
    assert got['memserve_admission_admitted_total{path="direct"}'] == admitted
    ttft = sum(v for k, v in got.items() if k.startswith("memserve_slo_requests_total") and 'slo="ttft"' in k)
    assert ttft == admitted  # every admitted request finished and was judged against its SLO


def test_slo_headers_are_honoured_end_to_end(reject_server):
    before = metrics(reject_server)

    async def one() -> tuple[int, dict, dict]:
        async with aiohttp.ClientSession() as http:
            return await complete(http, reject_server.base_url, 100, {"x-slo-ttft-ms": "60000",
                                                                      "x-slo-tbt-ms": "60000"})

    status, _, _ = asyncio.run(one())
    assert status == 200
    after = metrics(reject_server)
    for slo in ("ttft", "tbt"):
        key = f'memserve_slo_requests_total{{outcome="met",slo="{slo}"}}'
        assert after[key] == before[key] + 1
    # A prefill alone longer than the SLO can never be met: refused without Retry-After.
    async def hopeless() -> tuple[int, dict, dict]:
        async with aiohttp.ClientSession() as http:
            return await complete(http, reject_server.base_url, 101, {"x-slo-ttft-ms": "100"})

    status, body, headers = asyncio.run(hopeless())
    assert status == 429 and "Retry-After" not in headers and "idle instance" in body["error"]["message"]


@pytest.mark.slow  # a second server: a minute more on a quiet machine
def test_the_admission_queue_is_bounded_and_drains(queue_server):
    results = asyncio.run(burst(queue_server.base_url, {"x-slo-ttft-ms": str(SLO_MS)}, first=200))
    refused = check_burst(results)
    got = metrics(queue_server)
    assert got['memserve_admission_rejections_total{reason="queue_full"}'] >= 1
    assert sum(v for k, v in got.items() if k.startswith("memserve_admission_rejections_total")) == len(refused)
    assert got["memserve_admission_queue_depth"] == 0 and got["memserve_admission_queue_capacity"] == 2
