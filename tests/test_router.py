"""The gateway's router on hand-built worker views: only healthy workers, degraded ones
as a last resort, none left is a 503 with Retry-After, least-load by default, and any
injected policy sees the views it needs (mirrors included)."""

from __future__ import annotations

import pytest

from memserve.gateway.engine_protocol import EngineUnavailable
from memserve.gateway.router import LeastLoad, RouteRequest, Router, WorkerView
from memserve.kvcache.mirror import PromptTreeMirror

REQ = RouteRequest("r1", [1, 2, 3, 4])


def view(i: int, state: str = "ok", in_flight: int = 0) -> WorkerView:
    return WorkerView(i, state, in_flight, {}, PromptTreeMirror(i, 4))


def test_least_load_picks_the_fewest_in_flight_then_the_lowest_id():
    router = Router(LeastLoad())
    assert router.route(REQ, [view(0, in_flight=3), view(1, in_flight=1), view(2, in_flight=1)]) == 1


def test_unhealthy_workers_are_skipped_and_degraded_ones_are_a_last_resort():
    router = Router.named("least-load")
    workers = [view(0, "dead"), view(1, "degraded"), view(2, "ok", in_flight=9), view(3, "starting")]
    assert router.route(REQ, workers) == 2
    assert router.route(REQ, [view(0, "dead"), view(1, "degraded", in_flight=4)]) == 1


def test_no_live_worker_is_unavailable_with_a_retry_hint():
    with pytest.raises(EngineUnavailable) as exc:
        Router(LeastLoad()).route(REQ, [view(0, "dead"), view(1, "starting")])
    assert exc.value.retry_after_s and exc.value.retry_after_s > 0


def test_an_injected_policy_chooses_among_healthy_workers_only():
    seen: list[list[int]] = []

    class Last:
        name = "last"

        def choose(self, request: RouteRequest, workers: list[WorkerView]) -> int:
            seen.append([w.instance_id for w in workers])
            return workers[-1].instance_id

    assert Router(Last()).route(REQ, [view(0), view(1, "dead"), view(2)]) == 2
    assert seen == [[0, 2]]


def test_unknown_router_names_are_refused():
    with pytest.raises(ValueError, match="least-load"):
        Router.named("random")
