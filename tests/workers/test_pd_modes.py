"""The four MemServe PD modes (Table 4) against colocated serving: `--instances` and
`--pd-mode` set each role's cache as the table says; on real workers, greedy multi-turn
ShareGPT conversations give the same tokens colocated and in every mode, and each mode
caches where the table says (prefill hits, blocks the decode side already held, decode-
phase KV returned to the prefill side)."""

from __future__ import annotations

import asyncio

import pytest
from helpers.pd_harness import BLOCK, collect, pd_cluster, settled, user_turns

from memserve.gateway.routing.pd_topology import PD_MODES, parse_instances, role_caches
from memserve.ipc.messages import PDStats, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def test_instances_spec():
    assert parse_instances("prefill,decode") == (["prefill", "decode"], None)
    assert parse_instances("prefill:2,prefill:0,decode:1") == (["prefill", "prefill", "decode"], [2, 0, 1])
    assert parse_instances("colocated,colocated") == (["colocated", "colocated"], None)
    assert parse_instances("prefill:0,decode:0") == (["prefill", "decode"], [0, 0])  # two on one GPU, when asked
    for bad in ("prefill,prefill", "decode", "prefill,decode,colocated", "prefill:0,decode", "prefil,decode"):
        with pytest.raises(ValueError):
            parse_instances(bad)


def test_table_4_caches():
    assert [(role_caches("prefill", m), role_caches("decode", m)) for m in PD_MODES] == [
        (False, False), (True, False), (True, True), (True, True)]
    assert role_caches("colocated", "pd-basic")


async def serve(roles: list[str], mode: str, conversations: list[list[str]],
                transfer_mode: str = "by-request-agg") -> tuple[list, dict, PDStats]:
    """Every turn's (answer, cached tokens), the gateway's and the prefill worker's PD counters."""
    async with pd_cluster(roles, mode, transfer_mode=transfer_mode) as (client, tok):
        out = []
        for n, users in enumerate(conversations):
            messages = []
            for i, user in enumerate(users):
                messages.append({"role": "user", "content": user})
                answer, cached, _, error = await collect(client.generate(f"{n}-{i}", tok.encode_chat(messages),
                                                                         GREEDY))
                assert error is None
                out.append((answer, cached))
                messages.append({"role": "assistant", "content": tok.decode(answer, skip_special_tokens=True)})
                while client.pd is not None and client.pd.pending_returns:  # pd-caching-3's, in the background
                    await asyncio.sleep(0.05)
        assert not any((await settled(client)).values())
        pd = client.pd.stats() if client.pd else {}
        return out, pd, client.cluster.workers[0].stats.pd


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_greedy_outputs_identical_across_modes():
    conversations = user_turns(2, 2)
    reference, _, _ = asyncio.run(serve(["colocated"], "pd-basic", conversations))
    by_mode = {mode: asyncio.run(serve(["prefill", "decode"], mode, conversations)) for mode in PD_MODES}
    for mode, (turns, _, _) in by_mode.items():
        assert [a for a, _ in turns] == [a for a, _ in reference], mode
    second_turn = {mode: turns[1][1] for mode, (turns, _, _) in by_mode.items()}
    assert second_turn["pd-basic"] == 0
    assert second_turn["pd-caching-1"] == second_turn["pd-caching-2"] >= BLOCK
    assert second_turn["pd-caching-3"] > second_turn["pd-caching-2"]
    skipped = {mode: gateway.get("blocks_skipped", 0) for mode, (_, gateway, _) in by_mode.items()}
    assert skipped["pd-basic"] == skipped["pd-caching-1"] == 0 < skipped["pd-caching-2"]
    assert by_mode["pd-caching-3"][1]["returned_blocks"] > 0


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_greedy_outputs_identical_across_transfer_modes():
    """by-request-agg, by-request and by-layer (one message per layer, during the
    prefill) give the colocated answers."""
    conversations = user_turns(2, 2)
    reference, _, _ = asyncio.run(serve(["colocated"], "pd-basic", conversations))
    for transfer_mode in ("by-request-agg", "by-request", "by-layer"):
        turns, gateway, prefill = asyncio.run(serve(["prefill", "decode"], "pd-caching-3", conversations,
                                                    transfer_mode))
        assert [a for a, _ in turns] == [a for a, _ in reference], transfer_mode
        assert gateway["handoffs"] == 4 and not gateway.get("handoff_failed"), transfer_mode
        if transfer_mode == "by-layer":
            assert prefill.messages == 30 * prefill.handoffs  # SmolLM2-135M's 30 layers
