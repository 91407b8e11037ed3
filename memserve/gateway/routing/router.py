"""Which worker takes a request. The ``Router`` keeps the mechanics every policy shares
(only healthy colocated or prefill workers; degraded ones only when no worker is
healthy; none at all is ``EngineUnavailable``), scores the live workers for the request (the longest cached
prefix in each mirrored radix tree, i.e. the global prompt tree, and the queued work
priced by the cost model) and asks an injected ``RoutingPolicy`` (``policies.py``)
to choose. It keeps the ledger of the requests it routed, counts its decisions and
measures the cost model's TTFT predictions against the real first tokens. A prompt it
routed counts as cached on its instance until that instance's KV events show it
(``pending_prefixes``), so a second copy arriving during the first one's prefill
follows it instead of prefilling the same blocks elsewhere.

A policy that prices by the cost model (``cost``) may be given a ``fallback`` to route
by while there is none yet (the gateway profiles one in the background on a first
start); ``use_cost_model`` hands it over once it exists, and from then on the queued
work is priced and the waiting policy routes.

Only workers that are ``ok`` show their trees: a worker whose heartbeats are late may
have evicted what its mirror still shows, so its stale tree must not attract traffic
(the gateway resets the mirror when the worker is declared dead).

Pure Python on an injected clock: the simulator routes with the same code."""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Sequence

from memserve.costmodel.model import BandwidthCost, CostModel
from memserve.gateway.engine_protocol import EngineUnavailable
from memserve.gateway.routing.pending_prefixes import PendingPrefixes
from memserve.gateway.routing.policies import ROUTING_POLICIES, LeastLoad, exec_s
from memserve.gateway.routing.queued_work import QueuedWork
from memserve.gateway.routing.route_types import (
    PULL,
    Balance,
    Candidate,
    RouteDecision,
    RouteRequest,
    RoutingContext,
    RoutingPolicy,
    WorkerView,
)
from memserve.gateway.routing.ttft_errors import TTFTErrors
from memserve.ipc.messages import TierStats
from memserve.kvcache.hashing import block_hashes
from memserve.kvcache.mirror import PromptTreeMirror
from memserve.registry import make

__all__ = ["ROUTING_POLICIES", "Balance", "LeastLoad", "RouteDecision", "RouteRequest", "Router", "WorkerView"]

# Seconds a client is asked to wait when every worker is restarting.
RESTART_RETRY_AFTER_S = 5.0


class Router:
    def __init__(self, policy: RoutingPolicy, cost: CostModel | None = None, balance: Balance | None = None,
                 clock: Callable[[], float] = time.monotonic, step_tokens: int | None = None,
                 fallback: RoutingPolicy | None = None) -> None:
        """``fallback``: what routes while ``policy`` needs a cost model and ``cost`` is
        None, until ``use_cost_model``; without one such a policy is refused."""
        self.awaiting: RoutingPolicy | None = None  # the policy chosen, waiting for a cost model
        if getattr(policy, "needs_cost", False) and cost is None:
            if fallback is None:
                raise ValueError(f"the {policy.name} router needs a cost model: run `memserve profile` "
                                 "or pass --cost-model")
            policy, self.awaiting = fallback, policy
        self.policy = policy
        self.cost = cost
        self.balance = balance or Balance()
        self.ledger = QueuedWork(cost, clock, step_tokens)  # step_tokens: the workers' max_num_batched_tokens
        self.pending = PendingPrefixes(clock)
        self.decisions: Counter[str] = Counter()  # by reason
        self.routed: Counter[int] = Counter()  # by instance
        self.pulls: Counter[str] = Counter()
        self.pending_hits = 0  # decisions that counted a prompt still in flight on the chosen worker as cached
        self.ttft = TTFTErrors()
        # Measured KV links by (source, destination): pulls over them are priced by their own
        # figure rather than the cost model's transfer() (gateway/link_probe.py).
        self.links: dict[tuple[int, int], BandwidthCost] = {}

    @classmethod
    def named(cls, name: str, cost: CostModel | None = None, balance: Balance | None = None,
              clock: Callable[[], float] = time.monotonic, step_tokens: int | None = None,
              fallback: str | None = None) -> Router:
        return cls(make(ROUTING_POLICIES, name, "router"), cost, balance, clock, step_tokens,
                   make(ROUTING_POLICIES, fallback, "router") if fallback else None)

    def use_cost_model(self, cost: CostModel) -> None:
        """Price by ``cost`` from now on (it arrived after start-up): the queued work is
        repriced, and the policy that waited for a cost model takes over from the fallback.
        Admission control judges by ``self.cost``, so it starts judging too."""
        self.cost = cost
        self.ledger.use_cost_model(cost)
        if self.awaiting is not None:
            self.policy, self.awaiting = self.awaiting, None

    def use_links(self, links: dict[tuple[int, int], BandwidthCost]) -> None:
        """Price pulls between these pairs of workers by their measured links from now on."""
        self.links.update(links)

    def forget_links(self, instance: int) -> None:
        """Worker ``instance`` is restarting, perhaps on another node: pulls to and from it
        are priced by the cost model again until its links are measured anew."""
        self.links = {pair: link for pair, link in self.links.items() if instance not in pair}

    def candidates(self, request: RouteRequest, workers: list[WorkerView]) -> list[Candidate]:
        """The workers that may take ``request`` now, scored with their cached prefix
        (mirrored or pending) and queued work (admission control judges the request on the
        same scores)."""
        return self._scored(request, workers)[0]

    def _scored(self, request: RouteRequest, workers: list[WorkerView]) -> tuple[list[Candidate], list[int]]:
        workers = [w for w in workers if w.role != "decode"]  # a prompt starts on a prefill-capable worker
        live = [w for w in workers if w.state == "ok"] or [w for w in workers if w.state == "degraded"]
        if not live:
            raise EngineUnavailable("no live worker: the workers are restarting", RESTART_RETRY_AFTER_S)
        block_size = live[0].mirror.block_size
        scored = self.policy.uses_cache or self.cost is not None
        hashes = block_hashes(request.prompt_token_ids, block_size, salt=request.cache_salt) if scored else []
        out = []
        for w in live:
            stored = pending = 0
            if scored and w.state == "ok":
                stored = len(w.mirror.match_hashes(hashes))
                pending = max(self.pending.match(w.instance_id, hashes) - stored, 0)
            device = w.stats.mempool.tiers.get("device") if self.cost is not None else None
            work = self.ledger.scores(w.instance_id)
            load_s = w.stats.lora_load_s if request.lora_name not in (None, *w.stats.lora_adapters) else 0.0
            out.append(Candidate(w, stored + pending, pending_blocks=pending, queued_s=work.work_s, step_s=work.step_s,
                                 decode_s=work.decode_s,
                                 free_blocks=self._free_blocks(device, work.waiting_tokens, block_size),
                                 kv_blocks=device.total if device is not None else None, adapter_load_s=load_s))
        return out, hashes

    def _free_blocks(self, device: TierStats | None, waiting_tokens: int, block_size: int) -> int | None:
        """Device KV blocks a worker can still allocate: free plus evictable by its last
        stats report (heartbeat, ``device``), less the blocks of the requests routed there
        that have not started (they may have been routed after that report): their
        ``waiting_tokens``."""
        if device is None:
            return None
        return device.free + device.evictable - math.ceil(waiting_tokens / block_size)

    def route(self, request: RouteRequest, workers: list[WorkerView]) -> RouteDecision:
        self.pending.discard(request.request_id)  # re-routed: its old claim was never computed
        candidates, hashes = self._scored(request, workers)
        block_size = candidates[0].view.mirror.block_size
        ctx = RoutingContext(self.cost, self.balance, block_size, self.ledger.step_tokens, self.links)
        decision = self.policy.choose(request, candidates, ctx)
        self._record(request, decision, candidates, ctx)
        self.pending.add(request.request_id, decision.instance, hashes)
        return decision

    def _record(self, request: RouteRequest, decision: RouteDecision, candidates: list[Candidate],
                ctx: RoutingContext) -> None:
        x = len(request.prompt_token_ids)
        block_size = ctx.block_size
        chosen = next(c for c in candidates if c.instance_id == decision.instance)
        cached_blocks = decision.pull_blocks if decision.reason == PULL else chosen.cached_blocks
        predicted = None
        if self.cost is not None:
            predicted = chosen.queued_s + exec_s(self.cost, x, cached_blocks, block_size, self.ledger.step_tokens,
                                                 chosen.decode_s)
            if decision.reason == PULL:
                source = next(c for c in candidates if c.instance_id == decision.pull_from)
                predicted += source.step_s + ctx.transfer_s(source.instance_id, decision.instance, cached_blocks)
        self.ledger.admit(request.request_id, decision.instance, x, min(cached_blocks * block_size, max(x - 1, 0)),
                          request.max_tokens, request.n, predicted)
        self.decisions[decision.reason] += 1
        self.pending_hits += decision.reason != PULL and chosen.pending_blocks > 0
        self.routed[decision.instance] += 1

    def observe(self, request_id: str, new_tokens: int, at: float | None = None) -> None:
        """A request produced tokens (``at``: when, on the router's clock; default now)."""
        sample = self.ledger.observe(request_id, new_tokens, at)
        if sample is not None:
            self.ttft.add(sample.predicted_s, sample.actual_s)

    def observe_each(self, request_id: str, times: Sequence[float]) -> None:
        """``observe`` of one token of the request at each of ``times``, in order (a run of
        decode steps' outputs)."""
        for sample in self.ledger.observe_each(request_id, times):
            self.ttft.add(sample.predicted_s, sample.actual_s)

    def release(self, request_id: str) -> None:
        """The request ended (finished, failed or aborted): its work leaves the ledger
        and its prompt no longer counts as pending."""
        self.ledger.release(request_id)
        self.pending.discard(request_id)

    def kv_events_applied(self, mirror: PromptTreeMirror) -> None:
        """``mirror`` took a batch of its worker's KV events: the pending prompts they
        cover are the mirror's from now on."""
        self.pending.settle(mirror)

    def pull_done(self, ok: bool) -> None:
        self.pulls["ok" if ok else "failed"] += 1

    def stats(self) -> dict:
        return {"policy": self.policy.name, "decisions": dict(self.decisions), "routed": dict(self.routed),
                "pulls": dict(self.pulls),
                "ttft_prediction": self.ttft.to_dict(), "in_flight": len(self.ledger),
                "pending_prefixes": len(self.pending), "pending_hits": self.pending_hits}
