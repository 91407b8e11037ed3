"""Which worker takes a request. The ``Router`` keeps the mechanics every policy shares
(only healthy workers; degraded ones only when no worker is healthy; none at all is
``EngineUnavailable``) and asks an injected ``RoutingPolicy`` to choose among the rest.
A policy sees each worker's state, the requests this gateway has in flight there, its
last heartbeat stats and the mirror of its radix index (the global prompt tree), so
locality- and cost-aware policies (MemServe §6) plug in without touching the client.
Pure Python: the simulator routes with the same code."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from memserve.gateway.engine_protocol import EngineUnavailable
from memserve.kvcache.mirror import PromptTreeMirror
from memserve.registry import make

# Seconds a client is asked to wait when every worker is restarting.
RESTART_RETRY_AFTER_S = 5.0


@dataclass
class RouteRequest:
    request_id: str
    prompt_token_ids: list[int]
    session_id: str | None = None
    slo: dict = field(default_factory=dict)


@dataclass
class WorkerView:
    instance_id: int
    state: str  # ok | degraded | starting | dead (cluster.WorkerHandle.state)
    in_flight: int  # requests this gateway has there now
    stats: dict  # the worker's last heartbeat stats
    mirror: PromptTreeMirror


class RoutingPolicy(Protocol):
    name: str

    def choose(self, request: RouteRequest, workers: list[WorkerView]) -> int:
        """The instance id of one of ``workers`` (never empty)."""
        ...


class LeastLoad:
    """Fewest requests in flight from this gateway; ties to the lowest id."""

    name = "least-load"

    def choose(self, request: RouteRequest, workers: list[WorkerView]) -> int:
        return min(workers, key=lambda w: (w.in_flight, w.instance_id)).instance_id


ROUTING_POLICIES: dict[str, type] = {"least-load": LeastLoad}


class Router:
    def __init__(self, policy: RoutingPolicy) -> None:
        self.policy = policy

    @classmethod
    def named(cls, name: str) -> Router:
        return cls(make(ROUTING_POLICIES, name, "router"))

    def route(self, request: RouteRequest, workers: list[WorkerView]) -> int:
        candidates = [w for w in workers if w.state == "ok"] or [w for w in workers if w.state == "degraded"]
        if not candidates:
            raise EngineUnavailable("no live worker: the workers are restarting", RESTART_RETRY_AFTER_S)
        return self.policy.choose(request, candidates)
