"""Prompts routed but not yet in their worker's KV events (gateway/routing/pending_prefixes.py):
two copies of a prompt sent back to back go to one worker under prompt-tree and cost
(hand-computed on the exact linear cost model of helpers/routing.py); a claim ends when the
worker's events cover it, when its request ends, or after its TTL on the injected
clock; memory is bounded; cost copies a prefix or places a new prompt only where KV
headroom stays."""

from __future__ import annotations

import pytest
from helpers.routing import BS, PROMPT, linear_cost, mirror, view
from prometheus_client import CollectorRegistry, generate_latest

from memserve.gateway.routing.pending_prefixes import PendingPrefixes
from memserve.gateway.routing.route_types import RouteDecision
from memserve.gateway.routing.router import Router, RouteRequest, WorkerView
from memserve.gateway.routing_metrics import RouterStatsCollector
from memserve.ipc.messages import MemPoolStats, TierStats, WorkerStats
from memserve.kvcache.events import STORED, KVEvent
from memserve.kvcache.hashing import block_hashes
from memserve.kvcache.mirror import PromptTreeMirror

HASHES = block_hashes(PROMPT, BS)  # 16 blocks


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# ------------------------------------------------------------------ the record
def test_a_claim_covers_the_leading_blocks_of_its_prompt_on_its_instance_only():
    pending = PendingPrefixes(Clock())
    pending.add("a", 1, HASHES[:10])
    assert pending.match(1, HASHES) == 10
    assert pending.match(0, HASHES) == 0
    other = block_hashes(PROMPT[:4] + [7] * 4 + PROMPT[8:], BS)  # differs in block 1: the chained names differ from there on
    assert pending.match(1, other) == 1


def test_a_claim_ends_when_the_workers_events_cover_it_or_its_request_ends():
    pending = PendingPrefixes(Clock())
    pending.add("a", 1, HASHES)
    pending.add("b", 1, HASHES[:4])
    m = PromptTreeMirror(1, BS)
    m.apply_event(KVEvent(STORED, HASHES[:8], None, [(1 << 40) + k for k in range(8)]))
    pending.settle(m)  # covers b's 4 blocks, not a's 16
    assert len(pending) == 1 and pending.match(1, HASHES) == 16
    pending.settle(mirror(0, PROMPT))  # another instance's events cover nothing here
    assert len(pending) == 1
    pending.discard("a")
    assert len(pending) == 0 and pending.num_blocks == 0 and pending.match(1, HASHES) == 0


def test_a_claim_expires_after_its_ttl():
    clock = Clock()
    pending = PendingPrefixes(clock, ttl_s=10.0)
    pending.add("a", 0, HASHES)
    clock.now = 5.0
    pending.add("b", 0, HASHES[:2])
    clock.now = 9.9
    assert pending.match(0, HASHES) == 16
    clock.now = 10.0
    assert pending.match(0, HASHES) == 2 and len(pending) == 1
    clock.now = 15.0
    assert pending.match(0, HASHES) == 0 and len(pending) == 0


def test_memory_is_bounded_oldest_claims_first():
    pending = PendingPrefixes(Clock(), max_blocks=20)
    pending.add("a", 0, HASHES[:8])
    pending.add("b", 1, HASHES[:8])
    pending.add("c", 2, HASHES[:8])  # 24 > 20: a goes
    assert pending.num_blocks == 16 and pending.match(0, HASHES) == 0 and pending.match(2, HASHES) == 8
    pending.add("d", 3, block_hashes(list(range(200)), BS))  # 50 blocks: claims its first 20 only, alone
    assert pending.num_blocks == 20 and len(pending) == 1


# ------------------------------------------------------------------ the router
def test_prompt_tree_sends_a_copy_arriving_mid_prefill_to_the_first_copys_worker():
    """The first copy goes to the least loaded worker (1); the second, routed before any
    KV event, follows it as a cache hit though worker 1 now has more in flight. Once
    the first copy ends unseen (no events), its claim is gone."""
    router = Router.named("prompt-tree")
    assert router.route(RouteRequest("a", PROMPT), [view(0, in_flight=1), view(1), view(2, in_flight=1)]) == \
        RouteDecision(1, "load")
    after = [view(0, in_flight=1), view(1, in_flight=1), view(2, in_flight=1)]
    assert router.route(RouteRequest("b", PROMPT), after) == RouteDecision(1, "cache_hit")
    assert router.stats()["pending_hits"] == 1
    router.release("a")
    router.release("b")
    assert router.route(RouteRequest("c", PROMPT), after) == RouteDecision(0, "load")


def test_once_the_events_arrive_the_mirror_takes_over_the_claim():
    router = Router.named("prompt-tree")
    workers = [view(0), view(1)]
    assert router.route(RouteRequest("a", PROMPT), workers).instance == 0
    workers[0] = WorkerView(0, "ok", 1, WorkerStats(), mirror(0, PROMPT))
    router.kv_events_applied(workers[0].mirror)
    assert len(router.pending) == 0
    assert router.route(RouteRequest("b", PROMPT), workers) == RouteDecision(0, "cache_hit")
    assert router.stats()["pending_hits"] == 0  # the mirror held it


def test_cost_sends_the_second_copy_behind_the_first_ones_prefill():
    """exec(x, y) = x(1 - y). Copy a goes to idle worker 0 (64 s each, lowest id). For copy
    b, worker 0 costs its queue, a's 64 s prefill, plus exec(64, 63/64) = 1 s (one token:
    the rest is pending): 65 s, predicted as its TTFT. Idle worker 1 costs exec(64, 0) =
    64 s, plus the 63 s it would spend again on blocks worker 0 is computing: 127 s. It
    cannot pull them (not stored yet). Eq. 1 alone would pick worker 1 at 64 < 65."""
    router = Router.named("cost", cost=linear_cost(), clock=Clock())
    workers = [view(0), view(1)]
    assert router.route(RouteRequest("a", PROMPT), workers) == RouteDecision(0, "load")
    assert router.route(RouteRequest("b", PROMPT), workers) == RouteDecision(0, "cache_hit")
    router.observe("a", 1, at=0.0)
    router.observe("b", 1, at=0.0)
    assert router.ttft.predicted_sum_s == 64 + 65


def test_cost_duplicates_the_prefill_when_the_first_copys_worker_is_far_behind():
    """With q more seconds queued on worker 0 behind copy a, copy b costs 65 + q there
    against 127 on worker 1: it stays while q < 62."""
    for queued, expected in ((61, RouteDecision(0, "cache_hit")), (63, RouteDecision(1, "load"))):
        router = Router.named("cost", cost=linear_cost())
        assert router.route(RouteRequest("a", PROMPT), [view(0), view(1)]).instance == 0
        router.ledger.admit("other", 0, queued, 0, max_tokens=8)
        assert router.route(RouteRequest("b", PROMPT), [view(0), view(1)]) == expected


def test_the_duplicate_charge_covers_blocks_stored_and_blocks_being_computed():
    """Worker 0 stores the first 8 blocks (its mirror) and is computing the other 8 for
    copy a (32 s queued). Copy b costs 32 + exec(64, 63/64) = 33 s there plus q more
    queued; on worker 1, exec(64, 0) = 64 s plus the duplicate of all 16 blocks worker 0
    holds or is computing, exec(64, 0) - exec(64, 63/64) = 63 s: 127 s. It flips at
    q = 94 (at 62 were only the blocks being computed charged)."""
    for queued, expected in ((93, 0), (95, 1)):
        router = Router.named("cost", cost=linear_cost(transfer_bytes_per_s=1e-3))
        router.ledger.admit("a", 0, 64, 32, max_tokens=8)
        router.pending.add("a", 0, HASHES)
        router.ledger.admit("other", 0, queued, 0, max_tokens=8)
        workers = [WorkerView(0, "ok", 2, WorkerStats(), mirror(0, PROMPT[:32])), view(1)]
        assert router.route(RouteRequest("b", PROMPT), workers).instance == expected


def _with_free(i: int, free: int, cached: list[int] | None = None, in_flight: int = 0) -> WorkerView:
    stats = WorkerStats(mempool=MemPoolStats(tiers={"device": TierStats(total=100, free=free)}))
    return WorkerView(i, "ok", in_flight, stats, mirror(i, cached) if cached else PromptTreeMirror(i, BS))


@pytest.mark.parametrize("shared", [0, 4])
def test_cost_places_a_prompt_cached_nowhere_only_where_kv_headroom_stays(shared: int):
    """The request needs 18 blocks (64 prompt + 8 output tokens), less the ``shared``
    leading blocks both workers hold (a chat template: 4 blocks are a quarter of the
    prompt, below the cache threshold, so the prompt counts as cached nowhere). A worker
    keeps its headroom (20 of its 100 blocks free or evictable after it) with 38 -
    shared free, not with one fewer. Worker 1 has 10 s queued, so eq. 1 prefers worker 0,
    which takes the request only while it keeps its headroom. When neither worker keeps
    it, the request goes to the one with fewer requests in flight, worker 1."""
    request = RouteRequest("r", PROMPT, max_tokens=8)
    cached = PROMPT[:shared * BS] or None

    def route(free0: int, free1: int) -> RouteDecision:
        router = Router.named("cost", cost=linear_cost(transfer_bytes_per_s=1e-3))
        router.ledger.admit("queued", 1, 10, 0, max_tokens=8)
        workers = [_with_free(0, free0 - shared, cached, in_flight=2), _with_free(1, free1 - shared + 3, cached)]
        return router.route(request, workers)  # + 3: the blocks "queued" computes

    assert route(38, 38) == RouteDecision(0, "load")  # "load": placed by eq. 1, no cache followed
    assert route(37, 38) == RouteDecision(1, "load")
    assert route(37, 37) == RouteDecision(1, "load")
    assert route(38, 37) == RouteDecision(0, "load")


def test_cost_copies_a_cached_prefix_only_where_kv_headroom_stays():
    """Worker 0 holds 8 of the prompt's 16 blocks with 65 s queued: 65 + 32 = 97 against
    recomputing on idle worker 1, 64 + 32 for the copy = 96 (test_router). Worker 1 needs
    18 blocks: it takes the copy with 38 free, not with 37; worker 0, holding the prefix,
    keeps the request without headroom of its own (5 free)."""
    request = RouteRequest("r", PROMPT, max_tokens=8)
    for free1, expected in ((38, RouteDecision(1, "load")), (37, RouteDecision(0, "cache_hit"))):
        router = Router.named("cost", cost=linear_cost(transfer_bytes_per_s=1e-3))
        router.ledger.admit("queued", 0, 65, 0, max_tokens=8)
        workers = [_with_free(0, 5 + 17, PROMPT[:32]), _with_free(1, free1)]  # 17: "queued"'s blocks
        assert router.route(request, workers) == expected


def test_requests_routed_since_the_last_report_use_up_free_blocks():
    """Worker 1 reported 34 free blocks; a 64-token request (16 blocks) routed there since
    leaves 18, just enough for the next 18-block request; two leave 2."""
    cost = linear_cost(transfer_bytes_per_s=1e-3)
    router = Router.named("cost", cost=cost)
    router.ledger.admit("earlier", 1, 64, 0, max_tokens=8)
    request = RouteRequest("r", PROMPT, max_tokens=8)
    assert router.candidates(request, [_with_free(0, 0), _with_free(1, 34)])[1].free_blocks == 18
    router.ledger.admit("earlier2", 1, 64, 0, max_tokens=8)
    assert router.candidates(request, [_with_free(0, 0), _with_free(1, 34)])[1].free_blocks == 2


def test_pending_hits_are_exported():
    router = Router.named("prompt-tree")
    router.route(RouteRequest("a", PROMPT), [view(0), view(1)])
    router.route(RouteRequest("b", PROMPT), [view(0, in_flight=1), view(1)])
    registry = CollectorRegistry()
    registry.register(RouterStatsCollector(lambda: {"router": router.stats()}))
    assert "memserve_router_pending_prefix_hits_total 1.0" in generate_latest(registry).decode()
