"""The gateway's routing policies (MemServe Table 6 and §5.3), chosen with ``--router``:

- ``least-load``: fewest requests in flight; locality-blind.
- ``session``: a session (``session_id`` field or ``x-session-id`` header) sticks to the
  worker its first request went to; caching within a session only.
- ``prompt-tree``: the longest cached prefix in the mirrored worker trees, ties broken by
  load; caching across sessions.
- ``cost``: MemServe eq. 1, the worker minimising its queued predicted work plus
  ``exec(x, y_p)``, with eq. 2 folded in: a worker may pull a longer prefix from another
  first when the transfer costs less than the recompute it saves.

Both cache-aware policies count a prompt routed to a worker and not yet in its mirror
(pending, ``pending_prefixes``) as cached there.

``prompt-tree`` and ``cost`` yield to the load-imbalance guard (``Balance``)."""

from __future__ import annotations

import math
from collections import OrderedDict

from memserve.gateway.cost_model import CostModel
from memserve.gateway.queued_work import expected_output_tokens, prefill_chunks_s
from memserve.gateway.route_types import (
    CACHE_HIT,
    FALLBACK,
    LOAD,
    PULL,
    Candidate,
    RouteDecision,
    RouteRequest,
    RoutingContext,
)

# Sessions the session policy remembers; the least recently routed are forgotten first.
MAX_SESSIONS = 100_000


def least_loaded(candidates: list[Candidate]) -> Candidate:
    """Fewest requests in flight, then least queued work, then the lowest id."""
    return min(candidates, key=lambda c: (c.in_flight, c.queued_s, c.instance_id))


class LeastLoad:
    name = "least-load"
    uses_cache = False

    def choose(self, request: RouteRequest, candidates: list[Candidate], ctx: RoutingContext) -> RouteDecision:
        return RouteDecision(least_loaded(candidates).instance_id, LOAD)


class SessionAffinity:
    """Session-ID routing: an unknown session goes to the least loaded worker and stays
    there while that worker is a candidate; requests without a session are least-load."""

    name = "session"
    uses_cache = False

    def __init__(self) -> None:
        self._home: OrderedDict[str, int] = OrderedDict()

    def choose(self, request: RouteRequest, candidates: list[Candidate], ctx: RoutingContext) -> RouteDecision:
        sid = request.session_id
        home = self._home.get(sid) if sid is not None else None
        if home is not None and any(c.instance_id == home for c in candidates):
            self._home.move_to_end(sid)  # type: ignore[arg-type]
            return RouteDecision(home, CACHE_HIT)
        chosen = least_loaded(candidates).instance_id
        if sid is not None:
            self._home[sid] = chosen
            self._home.move_to_end(sid)
            while len(self._home) > MAX_SESSIONS:
                self._home.popitem(last=False)
        return RouteDecision(chosen, LOAD)


class PromptTree:
    """The longest cached prefix, ties broken by load; the least loaded worker when no
    prefix covers ``cache_threshold`` of the prompt."""

    name = "prompt-tree"
    uses_cache = True

    def choose(self, request: RouteRequest, candidates: list[Candidate], ctx: RoutingContext) -> RouteDecision:
        best = min(candidates, key=lambda c: (-c.cached_blocks, c.in_flight, c.queued_s, c.instance_id))
        x = len(request.prompt_token_ids)
        if not best.cached_blocks or best.cached_blocks * ctx.block_size < ctx.balance.cache_threshold * x:
            return RouteDecision(least_loaded(candidates).instance_id, LOAD)
        if ctx.balance.overloaded(best, candidates):
            return RouteDecision(least_loaded(candidates).instance_id, FALLBACK)
        return RouteDecision(best.instance_id, CACHE_HIT)


class CostAware:
    """MemServe eqs. 1-2 on the cost model: for each worker p, its queued work plus the
    cheaper of recomputing with its own cached ratio y_p and pulling the longest prefix
    held elsewhere (ratio y_p') then computing the rest. The pull is taken exactly when
    eq. 2 holds: ``transfer <= exec(x, y_p) - exec(x, y_p')``. The transfer is priced
    at every block the source holds, since a prefix push moves all of them, and starts
    when the source's current step ends (workers serve pushes between steps).

    A prefix pending on a worker (routed there, still being prefilled) is priced as
    cached on it: the request waits behind that prefill, which the worker's queued work
    already holds, then computes the rest. It cannot be pulled yet, so eq. 2 pulls only
    what a mirror shows (``stored_blocks``).

    Eq. 1 prices the request's own TTFT only. Recomputing on worker p a prefix that
    another worker stores or is computing does that work twice in the cluster and
    caches the prefix twice (crowding out other prefixes), and the requests that queue
    behind it on p pay for it. So a worker that would recompute blocks another worker
    holds (stored or pending, beyond what it pulls) is charged that duplicate work once
    more: it recomputes only when the cached worker's queue is longer by more than twice
    the recompute.
    Without the charge, a loaded cluster spread documents by recomputing them and fed
    its own load (simulated, 3 CPU workers with room for the documents, long-doc-qa
    share ratio 2: P99 TTFT 2-12% higher, cached-token ratio .77-.79 against .81;
    docs/benchmarks.md, stop 24). It assumes the holder keeps the prefix: at the edge
    of KV thrash, where queued requests lose their prefixes to eviction anyway, it did
    worse there. The charge ranks workers only; the TTFT prediction does not include it.

    KV memory: a worker whose free device blocks (``Candidate.free_blocks``) cannot hold
    the request's uncached prompt and expected output would evict cached prefixes or
    queue the request until blocks free up, neither of which exec() prices; it is
    skipped when another worker can hold the request (all are kept when none can). It
    may still be the source of a pull."""

    name = "cost"
    uses_cache = True
    needs_cost = True

    def choose(self, request: RouteRequest, candidates: list[Candidate], ctx: RoutingContext) -> RouteDecision:
        cost = ctx.cost
        assert cost is not None, "the Router refuses the cost policy without a cost model"
        x = len(request.prompt_token_ids)
        roomy = [c for c in candidates if c.free_blocks is None
                 or c.free_blocks >= kv_blocks_needed(request, c.cached_blocks, ctx.block_size)]
        source = min((c for c in candidates if c.view.state == "ok"),
                     key=lambda c: (-c.stored_blocks, c.in_flight, c.instance_id), default=None)
        best: tuple[float, int, int] | None = None
        decision: RouteDecision | None = None
        for c in roomy or candidates:
            own = exec_s(cost, x, c.cached_blocks, ctx.block_size, ctx.step_tokens, c.decode_s)
            exec_here, pull, blocks = own, None, c.cached_blocks
            if source is not None and source.stored_blocks > c.cached_blocks and c.view.state == "ok":
                pulled = exec_s(cost, x, source.stored_blocks, ctx.block_size, ctx.step_tokens, c.decode_s)
                transfer = source.step_s + cost.transfer_s(source.stored_blocks * ctx.block_size
                                                           * cost.kv_bytes_per_token)
                if transfer <= own - pulled:  # eq. 2
                    exec_here, pull, blocks = transfer + pulled, source, source.stored_blocks
            held = max((o.cached_blocks for o in candidates if o is not c), default=0)
            duplicate = 0.0
            if held > blocks:  # recomputing what another worker holds or is computing
                duplicate = (exec_s(cost, x, blocks, ctx.block_size, ctx.step_tokens)
                             - exec_s(cost, x, held, ctx.block_size, ctx.step_tokens))
            key = (c.queued_s + exec_here + duplicate, c.in_flight, c.instance_id)  # eq. 1
            if best is None or key < best:
                best = key
                if pull is not None:
                    decision = RouteDecision(c.instance_id, PULL, pull.instance_id, pull.stored_blocks)
                else:
                    decision = RouteDecision(c.instance_id, CACHE_HIT if c.cached_blocks else LOAD)
        assert decision is not None
        chosen = next(c for c in candidates if c.instance_id == decision.instance)
        if ctx.balance.overloaded(chosen, candidates):
            return RouteDecision(least_loaded(candidates).instance_id, FALLBACK)
        return decision


def kv_blocks_needed(request: RouteRequest, cached_blocks: int, block_size: int) -> int:
    """Device KV blocks a worker with ``cached_blocks`` of the prompt cached allocates for
    ``request``: its uncached prompt and its expected output (``max_tokens`` per choice,
    capped as the queued work caps it)."""
    output = expected_output_tokens(request.max_tokens, request.n)
    return max(math.ceil((len(request.prompt_token_ids) + output) / block_size) - cached_blocks, 0)


def cached_ratio(x: int, cached_blocks: int, block_size: int) -> float:
    """MemServe's y: the share of an ``x``-token prompt served from cache. At least one
    token is always computed (the engine needs its logits)."""
    return min(cached_blocks * block_size, x - 1) / x if x > 1 else 0.0


def exec_s(cost: CostModel, x: int, cached_blocks: int, block_size: int, step_tokens: int | None = None,
           decode_s: float = 0.0) -> float:
    """exec(x, y) for a prompt with ``cached_blocks`` cached, as an engine with a budget
    of ``step_tokens`` a step runs it: chunk by chunk, each chunk after the first with
    one more step of the decode batch (``decode_s``; the first chunk's is in the queued
    work)."""
    chunks = prefill_chunks_s(cost, x, cached_blocks * block_size, step_tokens)
    return sum(chunks) + (len(chunks) - 1) * decode_s


ROUTING_POLICIES: dict[str, type] = {p.name: p for p in (LeastLoad, SessionAffinity, PromptTree, CostAware)}
