"""The gateway's router on hand-built worker views and mirrors (no model, no torch):
only healthy workers, degraded ones as a last resort, none left is a 503 with
Retry-After; each policy's choice by hand-computed expectation (least-load, session,
prompt-tree, cost = MemServe eqs. 1-2 with its pull flipping exactly at the predicted
break-even, priced over the measured link of the two workers when there is one); the
load-imbalance guard; the queued-work ledger (chunked prefills); the /metrics export."""

from __future__ import annotations

import pytest
from helpers.routing import BS, PROMPT, linear_cost, view
from prometheus_client import CollectorRegistry, generate_latest

from memserve.costmodel.model import BandwidthCost
from memserve.gateway.engine_protocol import EngineUnavailable
from memserve.gateway.routing.policies import exec_s
from memserve.gateway.routing.queued_work import QueuedWork
from memserve.gateway.routing.route_types import (
    Balance,
    Candidate,
    RouteDecision,
    RoutingContext,
    WorkerView,
)
from memserve.gateway.routing.router import LeastLoad, Router, RouteRequest
from memserve.gateway.routing_metrics import RouterStatsCollector
from memserve.ipc.messages import WorkerStats

REQ = RouteRequest("r1", [1, 2, 3, 4])


# ------------------------------------------------------------------ mechanics
def test_least_load_picks_the_fewest_in_flight_then_the_lowest_id():
    router = Router(LeastLoad())
    assert router.route(REQ, [view(0, in_flight=3), view(1, in_flight=1), view(2, in_flight=1)]).instance == 1


def test_unhealthy_workers_are_skipped_and_degraded_ones_are_a_last_resort():
    router = Router.named("least-load")
    workers = [view(0, "dead"), view(1, "degraded"), view(2, "ok", in_flight=9), view(3, "starting")]
    assert router.route(REQ, workers).instance == 2
    assert router.route(REQ, [view(0, "dead"), view(1, "degraded", in_flight=4)]).instance == 1


def test_decode_only_workers_never_take_a_new_prompt():
    """Prefill side of disaggregation: the longest prefix on a decode worker does not count."""
    workers = [view(0, in_flight=3), view(1, cached=PROMPT), view(2, in_flight=1)]
    workers[1].role = "decode"
    assert Router.named("prompt-tree").route(RouteRequest("r", PROMPT), workers) == RouteDecision(2, "load")


def test_no_live_worker_is_unavailable_with_a_retry_hint():
    with pytest.raises(EngineUnavailable) as exc:
        Router(LeastLoad()).route(REQ, [view(0, "dead"), view(1, "starting")])
    assert exc.value.retry_after_s and exc.value.retry_after_s > 0


def test_an_injected_policy_chooses_among_healthy_workers_only():
    seen: list[list[int]] = []

    class Last:
        name = "last"
        uses_cache = False

        def choose(self, request: RouteRequest, candidates: list[Candidate], ctx: RoutingContext) -> RouteDecision:
            seen.append([c.instance_id for c in candidates])
            return RouteDecision(candidates[-1].instance_id, "load")

    assert Router(Last()).route(REQ, [view(0), view(1, "dead"), view(2)]).instance == 2
    assert seen == [[0, 2]]


def test_unknown_router_names_are_refused_and_cost_needs_a_cost_model():
    with pytest.raises(ValueError, match="least-load"):
        Router.named("random")
    with pytest.raises(ValueError, match="cost model"):
        Router.named("cost")


# ------------------------------------------------------------------ session
def test_session_sticks_to_its_first_worker_and_moves_only_when_it_is_gone():
    router = Router.named("session")
    a = RouteRequest("a1", PROMPT, session_id="alice")
    assert router.route(a, [view(0, in_flight=2), view(1), view(2, in_flight=1)]).instance == 1  # unknown: least load
    busy_home = [view(0), view(1, in_flight=5), view(2)]
    assert router.route(RouteRequest("a2", PROMPT, session_id="alice"), busy_home) == RouteDecision(1, "cache_hit")
    home_dead = [view(0, in_flight=1), view(1, "dead"), view(2)]
    assert router.route(RouteRequest("a3", PROMPT, session_id="alice"), home_dead).instance == 2
    assert router.route(RouteRequest("a4", PROMPT, session_id="alice"), [view(0), view(1), view(2, in_flight=3)]).instance == 2
    # No session: plain least-load, remembered nowhere.
    assert router.route(RouteRequest("b", PROMPT), [view(0, in_flight=1), view(1), view(2)]).instance == 1


# ------------------------------------------------------------------ prompt tree
def test_prompt_tree_picks_the_longest_cached_prefix():
    router = Router.named("prompt-tree")
    workers = [view(0, cached=PROMPT[:8]), view(1, in_flight=3, cached=PROMPT[:40]), view(2, cached=[7] * 64)]
    assert router.route(RouteRequest("r", PROMPT), workers) == RouteDecision(1, "cache_hit")


def test_prompt_tree_ties_and_no_prefix_go_to_the_least_loaded():
    router = Router.named("prompt-tree")
    tie = [view(0, in_flight=2, cached=PROMPT[:32]), view(1, in_flight=1, cached=PROMPT[:32]), view(2)]
    assert router.route(RouteRequest("r", PROMPT), tie) == RouteDecision(1, "cache_hit")
    cold = [view(0, in_flight=2), view(1, in_flight=1, cached=[9] * 16), view(2, in_flight=1)]
    assert router.route(RouteRequest("r", PROMPT), cold) == RouteDecision(1, "load")


def test_prompt_tree_ignores_prefixes_below_the_cache_threshold():
    """A short prefix every prompt shares (a template's system prompt) is not followed:
    28 of 64 tokens cached is under half, 32 is not."""
    router = Router.named("prompt-tree")
    short = [view(0, in_flight=1, cached=PROMPT[:28]), view(1)]
    assert router.route(RouteRequest("r", PROMPT), short) == RouteDecision(1, "load")
    half = [view(0, in_flight=1, cached=PROMPT[:32]), view(1)]
    assert router.route(RouteRequest("r", PROMPT), half) == RouteDecision(0, "cache_hit")


def test_stale_trees_do_not_attract_traffic():
    """A dead worker is never chosen however much it holds; a degraded one (heartbeats
    late) is a last resort whose tree is ignored."""
    router = Router.named("prompt-tree")
    assert router.route(RouteRequest("r", PROMPT), [view(0, "dead", cached=PROMPT), view(1, in_flight=4)]).instance == 1
    degraded = [view(0, "degraded", in_flight=3, cached=PROMPT), view(1, "degraded", in_flight=1)]
    assert router.route(RouteRequest("r", PROMPT), degraded) == RouteDecision(1, "load")


def test_the_imbalance_guard_overrides_a_hot_prefix():
    router = Router.named("prompt-tree", balance=Balance(abs_threshold=4, rel_threshold=2.0))
    hot = [view(0, in_flight=7, cached=PROMPT), view(1, in_flight=2), view(2, in_flight=3)]
    assert router.route(RouteRequest("r", PROMPT), hot) == RouteDecision(1, "fallback")  # 7-2 > 4 and 7 > 2*2
    warm = [view(0, in_flight=6, cached=PROMPT), view(1, in_flight=2), view(2, in_flight=3)]
    assert router.route(RouteRequest("r", PROMPT), warm) == RouteDecision(0, "cache_hit")  # 6-2 = 4: not more


# ------------------------------------------------------------------ cost (eqs. 1-2)
def test_cost_prefers_the_cached_worker_when_its_queue_allows():
    # exec(64, 0.5) = 32 on worker 0 beats exec(64, 0) = 64 on worker 1; pulling to 1 costs 32 + 32 = 64.
    router = Router.named("cost", cost=linear_cost())
    assert router.route(RouteRequest("r", PROMPT), [view(0, cached=PROMPT[:32]), view(1)]) == RouteDecision(0, "cache_hit")


def _queued_behind_4_then_96_tokens(router: Router) -> None:
    """Worker 0 has exec(4, 0) + exec(96, 0) = 100 s to prefill; its current step is the first, 4 s."""
    router.ledger.admit("first", 0, 4, 0, max_tokens=8)
    router.ledger.admit("second", 0, 96, 0, max_tokens=8)


@pytest.mark.parametrize("latency, expected", [
    (11.0, RouteDecision(1, "pull", pull_from=0, pull_blocks=8)),  # 4 + 11 + 16 = 31 <= 64 - 32: pull
    (12.5, RouteDecision(1, "load")),  # 32.5 > 32: no pull, worker 1 recomputes
])
def test_cost_pulls_exactly_when_eq2_holds(latency: float, expected: RouteDecision):
    """Worker 0 holds 8 blocks (32 tokens) but has 100 s queued: 100 + 32 = 132. Worker 1
    pulls the 8 blocks (32 bytes at 2 bytes/s: 16 s, after worker 0's current 4 s step
    and the link latency) when 4 + latency + 16 <= exec(64, 0) - exec(64, 0.5) = 32 (eq.
    2): the choice flips at a latency of 12 s. Either way worker 1 makes a second copy of
    worker 0's 8 blocks and is charged their recompute, 32 s, once more: pulling costs
    4 + 11 + 16 + 32 + 32 = 95, recomputing 64 + 32 = 96, both below 132."""
    router = Router.named("cost", cost=linear_cost(2.0, transfer_latency_s=latency))
    _queued_behind_4_then_96_tokens(router)
    assert router.route(RouteRequest("r", PROMPT), [view(0, cached=PROMPT[:32]), view(1)]) == expected


def test_a_pull_is_priced_by_the_link_measured_between_its_two_workers():
    """As above, worker 0 holds 8 blocks (32 bytes) with 100 s queued behind a 4 s step,
    and the cost model moves 2 bytes/s: idle workers 1 and 2 would both pull (4 + 16 =
    20 <= 32) and tie, worker 1 winning on its id. The links measured from worker 0 move
    0.5 bytes/s to worker 1 (4 + 64 > 32: no pull there, 64 + 32 = 96 with the copy
    charge) and 8 bytes/s to worker 2 (4 + 4 + 32 + 32 = 72): worker 2 pulls, and the
    TTFT predicted for the request counts its link: 4 + 4 + exec(64, 0.5) = 40. Once
    worker 2 restarts its links are forgotten: a pull to it is priced by the cost model
    again, 4 + 16 + 32 = 52."""
    router = Router.named("cost", cost=linear_cost(2.0), clock=lambda: 0.0)
    router.use_links({(0, 1): BandwidthCost(0.0, 0.5), (1, 0): BandwidthCost(0.0, 0.5),
                      (0, 2): BandwidthCost(0.0, 8.0), (2, 0): BandwidthCost(0.0, 8.0)})
    _queued_behind_4_then_96_tokens(router)
    workers = [view(0, cached=PROMPT[:32]), view(1), view(2)]
    assert router.route(RouteRequest("r", PROMPT), workers) == RouteDecision(2, "pull", pull_from=0, pull_blocks=8)
    router.observe("r", 1, at=50.0)
    assert router.ttft.predicted_sum_s == 40.0

    router.release("r")
    router.forget_links(2)
    assert set(router.links) == {(0, 1), (1, 0)}
    assert router.route(RouteRequest("r2", PROMPT), workers) == RouteDecision(2, "pull", pull_from=0, pull_blocks=8)
    router.observe("r2", 1, at=50.0)
    assert router.ttft.predicted_sum_s == 40.0 + 52.0


def test_a_pull_is_charged_as_a_copy():
    """With 40 s queued on worker 0 (72 in all), eq. 2 holds for worker 1 (4 + 0 + 16 =
    20 <= 32), and eq. 1 alone would send the request there to pull (20 + 32 = 52). The
    pull makes a second copy of the 8 blocks: 52 + 32 = 84 > 72, so it stays."""
    router = Router.named("cost", cost=linear_cost(2.0))
    router.ledger.admit("first", 0, 4, 0, max_tokens=8)
    router.ledger.admit("second", 0, 36, 0, max_tokens=8)
    assert router.route(RouteRequest("r", PROMPT), [view(0, cached=PROMPT[:32]), view(1)]) == \
        RouteDecision(0, "cache_hit")


@pytest.mark.parametrize("step_tokens, expected", [
    (16, RouteDecision(1, "pull", pull_from=0, pull_blocks=8)),  # 16 + 0 + 16 = 32 <= 64 - 32: pull
    (None, RouteDecision(1, "load")),  # 100 + 0 + 16 = 116 > 32: no pull, worker 1 recomputes
])
def test_a_pull_waits_for_the_sources_current_chunk_not_its_whole_prefill(step_tokens, expected):
    """Worker 0 holds 8 blocks (32 tokens) and prefills 100 tokens in chunks of at most
    ``step_tokens``: it serves a push after its current step, the first 16-token chunk
    (16 s), not after all 100 s. With chunks eq. 2 holds (16 s wait + 16 s transfer <=
    exec(64, 0) - exec(64, 0.5) = 32) and idle worker 1 pulls; without them it fails and
    worker 1 recomputes. Both cost 96 with the copy charge, against worker 0's 132."""
    router = Router.named("cost", cost=linear_cost(2.0), step_tokens=step_tokens)
    router.ledger.admit("queued", 0, 100, 0, max_tokens=8)
    assert router.route(RouteRequest("r", PROMPT), [view(0, cached=PROMPT[:32]), view(1)]) == expected


def test_cost_queued_work_flips_the_choice_at_its_break_even():
    """Without a pull (transfer too slow), worker 0 (32 cached) wins while its queue is
    under what recomputing the prefix on idle worker 1 costs: exec(64, 0) - exec(64,
    0.5) = 32 s for the request, and the same again for the cluster, which would compute
    those blocks twice (64 s); past that, worker 1 takes it."""
    for queued, winner in ((63, 0), (65, 1)):
        router = Router.named("cost", cost=linear_cost(transfer_bytes_per_s=1e-3))
        router.ledger.admit("queued", 0, queued, 0, max_tokens=8)
        assert router.route(RouteRequest("r", PROMPT), [view(0, cached=PROMPT[:32]), view(1)]).instance == winner


def test_a_request_on_an_adapter_is_charged_its_load_where_it_is_not_ready():
    """Worker 1 holds adapter "a" in its slots; worker 0 would read it in first (its
    measured 5 s). With equal queues the request goes where the adapter is; once worker
    1's queue is longer than the load by more than that, it goes to worker 0. A base
    request, or one on an adapter no worker holds, is not charged."""
    def views() -> list[WorkerView]:
        ready, other = view(0), view(1)
        ready.stats = WorkerStats(lora_load_s=5.0)
        other.stats = WorkerStats(lora_adapters=["a"], lora_load_s=5.0)
        return [ready, other]

    for queued, winner in ((0, 1), (4, 1), (6, 0)):
        router = Router.named("cost", cost=linear_cost())
        if queued:
            router.ledger.admit("queued", 1, queued, 0, max_tokens=8)
        assert router.route(RouteRequest("r", PROMPT, lora_name="a"), views()).instance == winner, queued
    assert Router.named("cost", cost=linear_cost()).route(RouteRequest("r", PROMPT), views()).instance == 0


# ------------------------------------------------------------------ ledger and metrics
def test_the_current_step_is_the_oldest_waiting_prefill_with_the_decode_batch():
    cost = linear_cost(decode_per_step=0.5)
    ledger = QueuedWork(cost, lambda: 0.0)
    ledger.admit("decoding", 0, 10, 0, max_tokens=4)
    ledger.observe("decoding", 1)
    ledger.admit("first", 0, 6, 0, max_tokens=4)
    ledger.admit("second", 0, 30, 0, max_tokens=4)
    assert ledger.step_s(0) == 6 + 0.5
    assert ledger.step_s(1) == 0.0


def test_a_long_prefill_runs_in_chunks_of_the_step_budget():
    """With a budget of 16 tokens a step, a 40-token prefill takes three steps (16, 16,
    8): the current step is its first chunk, exec(16, 0) = 16, with the decode batch
    (0.5); the queue is its 40 s plus a decode step for each of its 3 chunks and for the
    new request's first: 40 + 4 * 0.5. A prefill with 32 of 40 tokens cached is one step."""
    cost = linear_cost(decode_per_step=0.5)
    ledger = QueuedWork(cost, lambda: 0.0, step_tokens=16)
    ledger.admit("decoding", 0, 10, 0, max_tokens=4)
    ledger.observe("decoding", 1)
    ledger.admit("long", 0, 40, 0, max_tokens=4)
    assert ledger.step_s(0) == 16 + 0.5
    assert ledger.work_s(0) == 40 + 4 * 0.5
    ledger.admit("cached", 1, 40, 32, max_tokens=4)
    assert ledger.step_s(1) == pytest.approx(8) and ledger.work_s(1) == pytest.approx(8)
    unchunked = QueuedWork(cost, lambda: 0.0)
    unchunked.admit("long", 0, 40, 0, max_tokens=4)
    assert unchunked.step_s(0) == 40 and unchunked.work_s(0) == 40


def test_a_new_requests_later_chunks_each_carry_a_decode_step():
    """exec of a new 40-token prompt in 16-token chunks where the decode batch takes 0.5 s
    a step: 16 + 16 + 8 s of prefill and two more decode steps (the first chunk's is in
    the queued work); 32 tokens cached leave one chunk; no budget, one step."""
    cost = linear_cost()
    assert exec_s(cost, 40, 0, BS, step_tokens=16, decode_s=0.5) == 40 + 2 * 0.5
    assert exec_s(cost, 40, 8, BS, step_tokens=16, decode_s=0.5) == pytest.approx(8)
    assert exec_s(cost, 40, 0, BS, decode_s=0.5) == 40


def test_queued_work_counts_prefills_and_the_running_decode_batch():
    now = [0.0]
    cost = linear_cost(decode_per_step=0.5)
    ledger = QueuedWork(cost, lambda: now[0])
    ledger.admit("waiting", 0, 20, 8, max_tokens=4, predicted_ttft_s=11.0)  # exec(20, 0.4) = 12
    ledger.admit("decoding", 0, 10, 0, max_tokens=4)
    ledger.admit("elsewhere", 1, 99, 0, max_tokens=4)
    assert ledger.work_s(0) == 12 + 10  # both wait; nothing is decoding yet
    now[0] = 3.0
    assert ledger.observe("decoding", 1) is None  # no prediction was made for it
    assert ledger.work_s(0) == 12 + 2 * 0.5  # one prefill left, behind a decode batch of one
    ledger.observe("decoding", 3)  # its 4 expected tokens are out: no longer decoding
    sample = ledger.observe("waiting", 2, at=12.5)
    assert (sample.predicted_s, sample.actual_s) == (11.0, 12.5)
    ledger.release("waiting")
    assert ledger.work_s(0) == 0.0 and len(ledger) == 2


def test_a_request_past_its_expected_length_is_expected_to_run_as_long_again():
    """Expected output is capped at 512 tokens; one still decoding there runs on to its
    max_tokens, or, without one, to twice what it has produced so far."""
    cost = linear_cost(decode_per_step=0.5)
    ledger = QueuedWork(cost, lambda: 0.0)
    ledger.admit("long", 0, 10, 0, max_tokens=1000)
    ledger.admit("open", 1, 10, 0, max_tokens=None)
    for rid in ("long", "open"):
        ledger.observe(rid, 512)
    assert ledger.decode_s(0) == ledger.decode_s(1) == 0.5  # both still decoding
    ledger.observe("long", 488)  # its max_tokens: done
    ledger.observe("open", 512)  # 1024: expected 2048 now
    assert (ledger.decode_s(0), ledger.decode_s(1)) == (0.0, 0.5)
    ledger.observe("open", 1023)
    assert ledger.decode_s(1) == 0.5
    ledger.observe("open", 1)
    assert ledger.decode_s(1) == 0.5  # 2048 produced: expected 4096


def test_decisions_pulls_and_ttft_error_are_exported():
    now = [0.0]
    router = Router.named("cost", cost=linear_cost(2.0, transfer_latency_s=12.0), clock=lambda: now[0])
    _queued_behind_4_then_96_tokens(router)
    router.route(RouteRequest("r", PROMPT), [view(0, cached=PROMPT[:32]), view(1)])  # pull: 4 + 28 + 32 = 64
    router.pull_done(True)
    now[0] = 80.0
    router.observe("r", 1)  # actual 80: error (64 - 80) / 80 = -0.2
    registry = CollectorRegistry()
    registry.register(RouterStatsCollector(lambda: {"router": router.stats()}))
    text = generate_latest(registry).decode()
    assert 'memserve_router_decisions_total{policy="cost",reason="pull"} 1.0' in text
    assert 'memserve_router_routed_requests_total{instance="1"} 1.0' in text
    assert 'memserve_router_prefix_pulls_total{outcome="ok"} 1.0' in text
    assert 'memserve_router_ttft_relative_error_bucket{le="-0.25"} 0.0' in text
    assert 'memserve_router_ttft_relative_error_bucket{le="-0.1"} 1.0' in text
    assert "memserve_router_ttft_predicted_seconds_total 64.0" in text
    assert "memserve_router_ttft_actual_seconds_total 80.0" in text
