"""Which decode instance takes a handoff (``pick_decode``): the least loaded live one,
or where decode instances cache (pd-caching-2/3) the one whose mirrored prompt tree holds
the longest prefix of the prompt, ties and the load-imbalance guard going by load; in
the gateway's flow and, through the same function, in the simulator."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from helpers.sim_pd import conversation, simulate

from memserve.gateway.engine_protocol import EngineUnavailable
from memserve.gateway.pd_flow import PDFlow, pick_decode
from memserve.gateway.routing.route_types import Balance, WorkerView
from memserve.ipc.messages import WorkerStats
from memserve.kvcache.events import STORED, KVEvent
from memserve.kvcache.hashing import block_hashes
from memserve.kvcache.mirror import PromptTreeMirror

BS = 4
PROMPT = list(range(100, 120))  # 5 full blocks; half the prompt is 10 tokens
OTHER = list(range(500, 520))


def view(i: int, in_flight: int, cached: list[int] | None = None, state: str = "ok",
         role: str = "decode") -> WorkerView:
    """Instance ``i`` whose mirror holds the full blocks of ``cached`` (named as workers name them)."""
    mirror = PromptTreeMirror(i, BS)
    hashes = block_hashes(cached or [], BS)
    if hashes:
        mirror.apply_event(KVEvent(STORED, hashes, None, list(range(len(hashes)))))
    return WorkerView(i, state, in_flight, WorkerStats(), mirror, role)


def test_least_loaded_without_a_prompt():
    views = [view(0, 0, PROMPT, role="prefill"), view(1, 2, PROMPT), view(2, 1), view(3, 0, state="degraded")]
    assert pick_decode(views) == 2  # fewest in flight among the healthy decode instances
    assert pick_decode(views, exclude=2) == 1
    assert pick_decode([view(1, 0)], exclude=1) == 1  # the only one left
    assert pick_decode([view(1, 0, state="dead"), view(3, 5, state="degraded")]) == 3
    with pytest.raises(EngineUnavailable):
        pick_decode([view(0, 0, role="prefill"), view(1, 0, state="starting")])
    with pytest.raises(EngineUnavailable):
        pick_decode([view(0, 0, role="prefill"), view(1, 0, state="starting")], prompt=PROMPT)


def test_longest_cached_prefix_wins_over_load():
    # 1 holds 2 blocks of the prompt, 2 holds 4 (a diverging 5th), 3 holds another prompt.
    views = [view(0, 0, PROMPT, role="prefill"), view(1, 1, PROMPT[:8]), view(2, 2, PROMPT[:16] + [7, 7, 7, 7]),
             view(3, 0, OTHER)]
    assert pick_decode(views, prompt=PROMPT) == 2
    assert pick_decode(views) == 3  # blind to the prompt: least loaded
    # Without 2, instance 1's 8 tokens are under half the 20-token prompt: by load.
    assert pick_decode(views, exclude=2, prompt=PROMPT) == 3
    views[1] = view(1, 2, PROMPT[:12])  # 12 of 20 tokens: enough, though busier than 3
    assert pick_decode(views, exclude=2, prompt=PROMPT) == 1
    assert pick_decode(views, prompt=OTHER) == 3


def test_ties_go_to_the_less_loaded():
    views = [view(1, 2, PROMPT), view(2, 1, PROMPT), view(3, 0)]
    assert pick_decode(views, prompt=PROMPT) == 2
    views = [view(1, 1, PROMPT), view(2, 1, PROMPT)]
    assert pick_decode(views, prompt=PROMPT) == 1  # then the lowest id


def test_imbalance_guard_falls_back_to_least_loaded():
    # DECODE_BALANCE: passed over with more than 2 in flight beyond the least loaded.
    views = [view(1, 4, PROMPT), view(2, 2), view(3, 3)]
    assert pick_decode(views, prompt=PROMPT) == 1  # 2 more: within the guard
    views[0] = view(1, 5, PROMPT)
    assert pick_decode(views, prompt=PROMPT) == 2
    # The router's default guard: more than 16 beyond and more than 1.5x the least loaded.
    views[0] = view(1, 18, PROMPT)
    assert pick_decode(views, prompt=PROMPT, balance=Balance()) == 1
    views[0] = view(1, 19, PROMPT)
    assert pick_decode(views, prompt=PROMPT, balance=Balance()) == 2


def test_degraded_instances_are_picked_by_load_only():
    # The router scores only healthy workers' mirrors; so does pick_decode.
    views = [view(1, 3, PROMPT, state="degraded"), view(2, 1, state="degraded"), view(3, 0, state="dead")]
    assert pick_decode(views, prompt=PROMPT) == 2


@pytest.mark.parametrize(("mode", "expected"), [("pd-basic", 2), ("pd-caching-1", 2), ("pd-caching-2", 1),
                                                ("pd-caching-3", 1)])
def test_gateway_follows_the_prefix_only_where_decode_caches(mode, expected):
    views = [view(0, 0, PROMPT, role="prefill"), view(1, 1, PROMPT), view(2, 0)]
    client = SimpleNamespace(views=lambda: views, router=SimpleNamespace(balance=Balance()))
    assert PDFlow(client, mode)._pick_decode(PROMPT) == expected  # type: ignore[arg-type]
    assert PDFlow(client, mode)._pick_decode(PROMPT, exclude=expected) == 3 - expected  # type: ignore[arg-type]


def test_simulated_turns_meet_their_prefix_on_one_of_two_decode_instances():
    """With two decode instances each later turn goes where its conversation's KV is, so
    it skips as many blocks as with a single decode instance that holds everything."""
    sessions = [conversation(i, 4) for i in range(4)]
    one = simulate(["prefill", "decode"], "pd-caching-2", sessions, num_blocks=512).pd.stats()
    two = simulate(["prefill", "decode", "decode"], "pd-caching-2", sessions, num_blocks=512).pd.stats()
    assert one["blocks_skipped"] > 0
    assert two["blocks_skipped"] == one["blocks_skipped"]
    assert two["blocks_sent"] == one["blocks_sent"]
