"""Disaggregated prefill/decode in ``memserve simulate`` (sim/pd_flow.py, sim/transfer.py):
every PD mode completes every request, incremental transfers move only the blocks the
decode instance lacks, pd-caching-3's returned answer is cached at the prefill instance
on the next turn, and no instance holds a block once the run is over."""

from __future__ import annotations

import json

import pytest
from helpers.sim_pd import BLOCK_SIZE, conversation, simulate

from memserve.cli import main as memserve
from memserve.gateway.routing.pd_topology import PD_MODES
from memserve.sim.simulator import Simulation


def assert_nothing_held(sim: Simulation) -> None:
    """No block is held by a request, a parked handoff, a transfer or a pin anywhere."""
    for i, inst in enumerate(sim.instances):
        assert not inst.engine.has_work
        assert inst.engine.mempool.stats()["device"]["used"] == 0, f"instance {i} leaked blocks"
        if sim.pd is not None:
            assert sim.pd.senders[i].stats()["parked"] == sim.pd.senders[i].stats()["sending"] == 0
            assert sim.pd.receivers[i].stats()["holding"] == 0
            assert not sim.pd.network.endpoints[i].expected()


def by_turn(sim: Simulation) -> dict[tuple[str, int], object]:
    return {(r.session_id, r.turn): r for r in sim.records}


@pytest.mark.parametrize("mode", PD_MODES)
def test_every_mode_completes_every_request_and_frees_every_block(mode):
    sessions = [conversation(i, 3) for i in range(6)]
    sim = simulate(["prefill", "prefill", "decode", "decode"], mode, sessions)
    assert len(sim.records) == 18
    assert all(r.ok and r.completion_tokens == 40 for r in sim.records)
    for r in sim.records:  # the first token at P, the rest at D after the transfer
        assert r.chunk_times[0] < r.chunk_times[1] and sum(r.chunk_tokens) == 40
    stats = sim.pd.stats()
    assert stats["handoffs"] == 18 and stats.get("handoff_failed", 0) == 0
    assert stats["bytes_sent"] == stats["blocks_sent"] * sim.instances[0].engine.mempool.mover.block_nbytes
    # Decode instances never take a prompt: every handoff came from a prefill instance.
    assert sum(s.counts["handoffs"] for s in sim.pd.senders[2:]) == 0
    assert_nothing_held(sim)


def test_same_tokens_as_colocated_with_same_total_kv():
    sessions = [conversation(i, 3) for i in range(4)]
    colocated = by_turn(simulate(["colocated", "colocated"], "pd-basic", sessions, num_blocks=256))
    disaggregated = by_turn(simulate(["prefill", "decode"], "pd-caching-3", sessions, num_blocks=256))
    assert colocated.keys() == disaggregated.keys()
    for key, rec in colocated.items():
        assert (rec.prompt_tokens, rec.completion_tokens) == (disaggregated[key].prompt_tokens,
                                                              disaggregated[key].completion_tokens)


def test_incremental_transfer_moves_only_the_blocks_decode_lacks():
    sessions = [conversation(0, 4)]
    basic = simulate(["prefill", "decode"], "pd-basic", sessions).pd.stats()
    incremental = simulate(["prefill", "decode"], "pd-caching-2", sessions).pd.stats()
    assert basic["blocks_skipped"] == 0
    assert incremental["blocks_skipped"] > 0
    assert incremental["blocks_sent"] + incremental["blocks_skipped"] == basic["blocks_sent"]
    # Turns 2..4 send little more than their new user message: far fewer blocks in all.
    assert incremental["blocks_sent"] < basic["blocks_sent"] / 2
    assert incremental["link"]["bytes"] < basic["link"]["bytes"]


def test_pd_caching_3_caches_the_previous_answer_at_prefill():
    sessions = [conversation(0, 3)]
    two = simulate(["prefill", "decode"], "pd-caching-2", sessions, think_time_s=2.0)
    three = simulate(["prefill", "decode"], "pd-caching-3", sessions, think_time_s=2.0)
    assert three.pd.stats()["returned_blocks"] > 0 and two.pd.stats().get("returned_blocks", 0) == 0
    for sim in (two, three):
        assert_nothing_held(sim)
    t2, t3 = by_turn(two), by_turn(three)
    for turn in (2, 3):
        previous = t3[("s0", turn - 1)]
        answered = (previous.prompt_tokens + previous.completion_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
        # pd-caching-2's prefill instance holds the previous prompt only; pd-caching-3's the answer too.
        assert t2[("s0", turn)].cached_tokens <= previous.prompt_tokens
        assert t3[("s0", turn)].cached_tokens >= answered > previous.prompt_tokens


def test_cli_runs_roles_and_rejects_a_topology_without_decode(tmp_path, capsys):
    from helpers.paths import SHARED_DATA

    out = tmp_path / "pd.json"
    args = ["simulate", "--cost-model", "llama2-13b-h800", "--pd-mode", "pd-caching-2", "--workload", "sharegpt",
            "--dataset", str(SHARED_DATA / "sharegpt-sample.jsonl"), "--num-sessions", "4", "--max-turns", "2",
            "--max-tokens", "16", "--no-progress", "--num-blocks", "512", "--output", str(out)]
    assert memserve([*args, "--instances", "prefill"]) == 2
    assert memserve([*args, "--instances", "prefill,decode"]) == 0
    sim = json.loads(out.read_text())["simulation"]
    assert sim["roles"] == ["prefill", "decode"] and sim["pd"]["mode"] == "pd-caching-2"
    assert sim["pd"]["handoffs"] == json.loads(out.read_text())["num_requests"]["ok"]


def test_a_decode_instance_short_of_blocks_never_stalls_on_kv_held_by_its_queue():
    """Handoffs fail on a small decode pool, so the head of D's queue recomputes while
    requests behind it hold the KV they received and nothing runs: the scheduler releases
    that KV (those requests recompute too) instead of waiting forever."""
    sim = simulate(["prefill", "prefill", "decode"], "pd-caching-2", [conversation(i, 3) for i in range(8)],
                   num_blocks=64)
    assert len(sim.records) == 24 and all(r.ok for r in sim.records)
    assert_nothing_held(sim)
