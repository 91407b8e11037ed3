"""Which worker takes a request. The ``Router`` keeps the mechanics every policy shares
(only healthy colocated or prefill workers; degraded ones only when no worker is
healthy; none at all is ``EngineUnavailable``), scores the live workers for the request (the longest cached
prefix in each mirrored radix tree, i.e. the global prompt tree, and the queued work
priced by the cost model) and asks an injected ``RoutingPolicy`` (``routing_policies``)
to choose. It keeps the ledger of the requests it routed, counts its decisions and
measures the cost model's TTFT predictions against the real first tokens.

Only workers that are ``ok`` show their trees: a worker whose heartbeats are late may
have evicted what its mirror still shows, so its stale tree must not attract traffic
(the gateway resets the mirror when the worker is declared dead).

Pure Python on an injected clock: the simulator routes with the same code."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

from memserve.gateway.cost_model import CostModel
from memserve.gateway.engine_protocol import EngineUnavailable
from memserve.gateway.queued_work import QueuedWork
from memserve.gateway.route_types import (
    PULL,
    Balance,
    Candidate,
    RouteDecision,
    RouteRequest,
    RoutingContext,
    RoutingPolicy,
    WorkerView,
)
from memserve.gateway.routing_metrics import TTFTErrors
from memserve.gateway.routing_policies import ROUTING_POLICIES, LeastLoad, exec_s
from memserve.kvcache.hashing import block_hashes
from memserve.registry import make

__all__ = ["ROUTING_POLICIES", "Balance", "LeastLoad", "RouteDecision", "RouteRequest", "Router", "WorkerView"]

# Seconds a client is asked to wait when every worker is restarting.
RESTART_RETRY_AFTER_S = 5.0


class Router:
    def __init__(self, policy: RoutingPolicy, cost: CostModel | None = None, balance: Balance | None = None,
                 clock: Callable[[], float] = time.monotonic, step_tokens: int | None = None) -> None:
        if getattr(policy, "needs_cost", False) and cost is None:
            raise ValueError(f"the {policy.name} router needs a cost model: run `memserve profile` "
                             "or pass --cost-model")
        self.policy = policy
        self.cost = cost
        self.balance = balance or Balance()
        self.ledger = QueuedWork(cost, clock, step_tokens)  # step_tokens: the workers' max_num_batched_tokens
        self.decisions: Counter[str] = Counter()  # by reason
        self.routed: Counter[int] = Counter()  # by instance
        self.pulls: Counter[str] = Counter()
        self.ttft = TTFTErrors()

    @classmethod
    def named(cls, name: str, cost: CostModel | None = None, balance: Balance | None = None,
              clock: Callable[[], float] = time.monotonic, step_tokens: int | None = None) -> Router:
        return cls(make(ROUTING_POLICIES, name, "router"), cost, balance, clock, step_tokens)

    def candidates(self, request: RouteRequest, workers: list[WorkerView]) -> list[Candidate]:
        """The workers that may take ``request`` now, scored with their cached prefix and
        queued work (admission control judges the request on the same scores)."""
        workers = [w for w in workers if w.role != "decode"]  # a prompt starts on a prefill-capable worker
        live = [w for w in workers if w.state == "ok"] or [w for w in workers if w.state == "degraded"]
        if not live:
            raise EngineUnavailable("no live worker: the workers are restarting", RESTART_RETRY_AFTER_S)
        block_size = live[0].mirror.block_size
        scored = self.policy.uses_cache or self.cost is not None
        hashes = block_hashes(request.prompt_token_ids, block_size) if scored else []
        return [Candidate(w, len(w.mirror.match_hashes(hashes)) if scored and w.state == "ok" else 0,
                          self.ledger.work_s(w.instance_id), self.ledger.step_s(w.instance_id),
                          self.ledger.decode_s(w.instance_id))
                for w in live]

    def route(self, request: RouteRequest, workers: list[WorkerView]) -> RouteDecision:
        candidates = self.candidates(request, workers)
        block_size = candidates[0].view.mirror.block_size
        ctx = RoutingContext(self.cost, self.balance, block_size, self.ledger.step_tokens)
        decision = self.policy.choose(request, candidates, ctx)
        self._record(request, decision, candidates, block_size)
        return decision

    def _record(self, request: RouteRequest, decision: RouteDecision, candidates: list[Candidate],
                block_size: int) -> None:
        x = len(request.prompt_token_ids)
        chosen = next(c for c in candidates if c.instance_id == decision.instance)
        cached_blocks = decision.pull_blocks if decision.reason == PULL else chosen.cached_blocks
        predicted = None
        if self.cost is not None:
            predicted = chosen.queued_s + exec_s(self.cost, x, cached_blocks, block_size, self.ledger.step_tokens,
                                                 chosen.decode_s)
            if decision.reason == PULL:
                source = next(c for c in candidates if c.instance_id == decision.pull_from)
                predicted += source.step_s + self.cost.transfer_s(cached_blocks * block_size
                                                                  * self.cost.kv_bytes_per_token)
        self.ledger.admit(request.request_id, decision.instance, x, min(cached_blocks * block_size, max(x - 1, 0)),
                          request.max_tokens, request.n, predicted)
        self.decisions[decision.reason] += 1
        self.routed[decision.instance] += 1

    def observe(self, request_id: str, new_tokens: int, at: float | None = None) -> None:
        """A request produced tokens (``at``: when, on the router's clock; default now)."""
        sample = self.ledger.observe(request_id, new_tokens, at)
        if sample is not None:
            self.ttft.add(sample.predicted_s, sample.actual_s)

    def release(self, request_id: str) -> None:
        """The request ended (finished, failed or aborted): its work leaves the ledger."""
        self.ledger.release(request_id)

    def pull_done(self, ok: bool) -> None:
        self.pulls["ok" if ok else "failed"] += 1

    def stats(self) -> dict:
        return {"policy": self.policy.name, "decisions": dict(self.decisions), "routed": dict(self.routed),
                "pulls": dict(self.pulls),
                "ttft_prediction": self.ttft.to_dict(), "in_flight": len(self.ledger)}
