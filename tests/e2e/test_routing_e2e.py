"""Routing on a real `memserve up --cpu-workers 3` (real model, ZeroMQ, KV events): under
``--router prompt-tree`` a conversation's next turn goes to the worker holding its
prefix even when another is idle, and a killed holder stops receiving requests at once;
under ``--router cost`` a busy holder makes the next turn go to an idle worker that
pulls the prefix first (MemServe eq. 2) and is served from it; greedy outputs are the
same whichever path served them."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from helpers.paths import REPO
from helpers.routed_chat import (
    HEARTBEAT_S,
    MAX_TOKENS,
    ask,
    chat,
    decisions,
    holder_of_last_request,
    messages,
    routed,
    routed_counts,
    router_metrics,
    second_turn_after_a_busy_start,
)
from openai import AsyncOpenAI

from memserve.bench.server_process import start_server, stop_server
from memserve.costmodel.model import (
    AttentionCost,
    BandwidthCost,
    CostKey,
    CostModel,
    DecodeCost,
    OperatorCost,
)

NUM_BLOCKS = 128
_reference: dict[str, list[str]] = {}  # texts of the conversation, per policy


def server_args(router: str, *extra: str) -> tuple[str, ...]:
    return ("--cpu-workers", "3", "--num-blocks", str(NUM_BLOCKS), "--max-num-seqs", "4", "--router", router, *extra)


@pytest.fixture(scope="module")
def tree_server(tmp_path_factory):
    handle = start_server(server_args("prompt-tree"), tmp_path_factory.mktemp("tree") / "memserve.log", cwd=REPO)
    yield handle
    stop_server(handle)


@pytest.fixture(scope="module")
def cost_server(tmp_path_factory):
    """A cost model where a prefill costs 1 ms per new token and a transfer nothing, so
    eqs. 1-2 can be worked out from token counts (see the test)."""
    tmp = tmp_path_factory.mktemp("cost")
    model = CostModel(CostKey("SmolLM2-135M-Instruct", "float32", "test"), 16, kv_bytes_per_token=1,
                      operators={"gemm": OperatorCost(per_token=1e-3)}, attention=AttentionCost(0, 0, 0, 0),
                      decode=DecodeCost(0.0, 0.0, 0.0), copy=BandwidthCost(0.0, 1e12),
                      transfer=BandwidthCost(0.0, 1e12))
    handle = start_server(server_args("cost", "--cost-model", str(model.save(tmp / "cost.json"))), tmp / "memserve.log",
                          cwd=REPO)
    yield handle
    stop_server(handle)


@pytest.fixture(scope="module")
def tree_conversation(tree_server):
    """The prompt-tree tests' conversation, run once by whichever of them comes first."""
    turn = asyncio.run(second_turn_after_a_busy_start(tree_server))
    _reference["prompt-tree"] = turn.texts
    return turn


def test_next_turn_goes_to_the_worker_holding_its_prefix(tree_conversation):
    turn = tree_conversation
    assert turn.first_on != 0  # worker 0 was busy: the conversation started elsewhere
    assert turn.second_on == turn.first_on  # all idle: least-load would take worker 0
    assert turn.cache_hits == 1 and turn.cached_tokens > 0


def test_a_killed_holder_stops_receiving_requests_at_once(tree_server, tree_conversation):
    """The holder of the conversation is SIGKILLed; one heartbeat window later (while it
    restarts) its next turn goes to another worker and gets the same greedy text."""
    first, second = tree_conversation.texts
    workers = {w["instance_id"]: w for w in tree_server.get_json("/health")["workers"]}
    before = routed_counts(tree_server)

    assert chat(tree_server, messages([first], 1))[0] == second  # cached: it goes to the holder
    holder = holder_of_last_request(tree_server, before)
    os.kill(workers[holder]["pid"], signal.SIGKILL)
    time.sleep(HEARTBEAT_S)
    before = routed_counts(tree_server)
    assert chat(tree_server, messages([first], 1))[0] == second
    assert routed(tree_server, holder) == before[holder]
    assert decisions(tree_server, "fallback") == 0


@pytest.mark.slow  # a second 3-worker server: about a minute on 2 busy cores
def test_cost_router_pulls_the_prefix_to_an_idle_worker(cost_server):
    """Worker 0 holds the conversation's c cached tokens and gets two follow-ups of
    f = c/2 + ~20 new tokens each (f < c: cheaper there than anywhere). While both wait,
    the next turn would queue behind 2f > c of prefill on worker 0, more than the c it
    saves there (eq. 1), whereas worker 1 can pull the prefix once worker 0's current
    step (f) ends, f < c (eq. 2): it pulls, and its prefill starts from the pulled prefix."""
    async def scenario() -> list[str]:
        async with AsyncOpenAI(base_url=cost_server.base_url + "/v1", api_key="x") as client:
            r = await client.chat.completions.create(model=cost_server.model, messages=messages([], 0),
                                                     max_tokens=MAX_TOKENS, temperature=0)
            first, cached_len = r.choices[0].message.content, r.usage.prompt_tokens // 16 * 16
            filler = messages([first], 1, last=" ".join(["the"] * (cached_len // 2)))
            fillers = [asyncio.create_task(client.chat.completions.create(
                model=cost_server.model, messages=filler, max_tokens=2, temperature=0)) for _ in range(2)]
            await asyncio.sleep(0.1)  # both routed to worker 0, neither prefilled yet
            answer, cached = await ask(client, cost_server, messages([first], 1))
            await asyncio.gather(*fillers)
            assert decisions(cost_server, "pull") == 1
            assert router_metrics(cost_server)['memserve_router_prefix_pulls_total{outcome="ok"}'] == 1.0
            assert routed(cost_server, 0) == 3 and routed(cost_server, 1) == 1
            assert cached > 0  # worker 1 never computed this prefix: it was pulled
            return [first, answer]

    texts = asyncio.run(scenario())
    if "prompt-tree" in _reference:  # greedy: the same text whichever path served it
        assert texts == _reference["prompt-tree"]
