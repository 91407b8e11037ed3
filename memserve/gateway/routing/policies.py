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

import heapq

import math
from collections import OrderedDict

from memserve.costmodel.model import CostModel
from memserve.gateway.routing.queued_work import (
    expected_output_tokens,
    prefill_chunks_s,
)
from memserve.gateway.routing.route_types import (
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
# Share of a worker's device KV that must stay free or evictable after it takes a copy
# of a prefix another worker holds, or a prompt cached nowhere (CostAware). Values from
# 0.2 to 0.5 gave P99 TTFTs within the seed-to-seed noise of one another in the
# simulator (docs/benchmarks.md, "Routing").
KV_HEADROOM = 0.2


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
        if sid is not None and home is not None and any(c.instance_id == home for c in candidates):
            self._home.move_to_end(sid)
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
        if not ctx.balance.worth_following(best.cached_blocks, ctx.block_size, x):
            return RouteDecision(least_loaded(candidates).instance_id, LOAD)
        if ctx.balance.overloaded(best, candidates):
            return RouteDecision(least_loaded(candidates).instance_id, FALLBACK)
        return RouteDecision(best.instance_id, CACHE_HIT)


class CostAware:
    """MemServe eqs. 1-2 on the cost model: for each worker p, its queued work plus the
    cheaper of recomputing with its own cached ratio y_p and pulling the longest prefix
    held elsewhere (ratio y_p') then computing the rest. The pull is taken exactly when
    eq. 2 holds: ``transfer <= exec(x, y_p) - exec(x, y_p')``. The transfer is priced
    at every block the source holds, since a prefix push moves all of them, over the
    link between the two workers (``RoutingContext.transfer_s``), and starts when the
    source's current step ends (workers serve pushes between steps).

    A prefix pending on a worker (routed there, still being prefilled) is priced as
    cached on it: the request waits behind that prefill, which the worker's queued work
    already holds, then computes the rest. It cannot be pulled yet, so eq. 2 pulls only
    what a mirror shows (``stored_blocks``).

    Eq. 1 prices the request's own TTFT only. A worker that takes blocks another worker
    holds (stored or pending), by recomputing them or by pulling them, makes a second
    copy: recomputed, the cluster does that work twice, and either way the copy takes
    KV that other prefixes were cached in, which their next requests then recompute.
    So such a worker is charged the recompute of those blocks once more: it takes the
    request only when the holder's queue is longer by more than the copy and that
    charge together (about twice the recompute, or the transfer plus the recompute).

    KV memory, which eq. 1 does not price: a worker takes a copy of a prefix held
    elsewhere, or a prompt cached nowhere (no worker holds ``cache_threshold`` of it, as
    prompt-tree judges it), only while ``KV_HEADROOM`` of its device KV stays free or
    evictable after it (``has_headroom``); the worker holding the longest prefix may
    always take it. When no worker has headroom for a prompt cached nowhere,
    the cluster is KV-bound and it goes to the worker with the fewest requests in
    flight, as prompt-tree sends it: requests in flight hold the KV their sessions come
    back to, which placing by compute alone evicts. Measured on the simulator at the
    real run's setting (``benchmarks/simulated/kv_bound_routing_sim.py``: 3 CPU workers, 512
    blocks each, long-doc-qa, mean of 20 seeds; docs/benchmarks.md, "Routing"):
    without these rules a KV-bound cluster spread copies and new documents by queue,
    evicted documents whose next questions were queued, and its P99 TTFT was 1.4-1.6x
    prompt-tree's at 0.4-0.5 session starts/s; with them it is within 10% of it.

    A request on a LoRA adapter is charged, on a worker whose slots do not hold it, the
    time that worker takes to read an adapter in (its ``lora_load_s``), so that requests
    on one adapter gather where it is ready (llm-d's LoRA affinity) unless another
    worker's queue is shorter by more than that."""

    name = "cost"
    uses_cache = True
    needs_cost = True

    def choose(self, request: RouteRequest, candidates: list[Candidate], ctx: RoutingContext) -> RouteDecision:
        cost = ctx.cost
        assert cost is not None, "the Router refuses the cost policy without a cost model"
        x = len(request.prompt_token_ids)
        longest = max(c.cached_blocks for c in candidates)
        if not ctx.balance.worth_following(longest, ctx.block_size, x):
            longest = 0  # cached nowhere: at most a short prefix every prompt shares (a chat template)
        holders = {c.instance_id for c in candidates if longest and c.cached_blocks == longest}
        open_to = [c for c in candidates if c.instance_id in holders or has_headroom(request, c, ctx.block_size)]
        if not open_to:  # a prompt cached nowhere, and KV binds on every worker
            return RouteDecision(least_loaded(candidates).instance_id, LOAD)
        source = min((c for c in candidates if c.view.state == "ok"),
                     key=lambda c: (-c.stored_blocks, c.in_flight, c.instance_id), default=None)
        best: tuple[float, int, int] | None = None
        decision: RouteDecision | None = None
        times = PrefillTimes(cost, x, ctx.block_size, ctx.step_tokens)
        # The most any *other* worker holds, for each c: the largest, unless c alone holds it.
        top, second = (heapq.nlargest(2, (c.cached_blocks for c in candidates)) + [0])[:2]
        top_holders = sum(1 for c in candidates if c.cached_blocks == top)
        for c in open_to:
            own = times.exec_s(c.cached_blocks, c.decode_s)
            exec_here, pull = own, None
            if source is not None and source.stored_blocks > c.cached_blocks and c.view.state == "ok":
                pulled = times.exec_s(source.stored_blocks, c.decode_s)
                transfer = source.step_s + ctx.transfer_s(source.instance_id, c.instance_id, source.stored_blocks)
                if transfer <= own - pulled:  # eq. 2
                    exec_here, pull = transfer + pulled, source
            held = second if c.cached_blocks == top and top_holders == 1 else top
            copy = 0.0
            if held > c.cached_blocks:  # a second copy of what another worker holds or is computing
                copy = times.exec_s(c.cached_blocks) - times.exec_s(held)
            # eq. 1, and reading the request's LoRA adapter in where the worker does not hold it
            key = (c.queued_s + exec_here + copy + c.adapter_load_s, c.in_flight, c.instance_id)
            if best is None or key < best:
                best = key
                if pull is not None:
                    decision = RouteDecision(c.instance_id, PULL, pull.instance_id, pull.stored_blocks)
                else:
                    decision = RouteDecision(c.instance_id, CACHE_HIT if c.instance_id in holders else LOAD)
        assert decision is not None
        chosen = next(c for c in candidates if c.instance_id == decision.instance)
        if ctx.balance.overloaded(chosen, candidates):
            return RouteDecision(least_loaded(candidates).instance_id, FALLBACK)
        return decision


def has_headroom(request: RouteRequest, candidate: Candidate, block_size: int) -> bool:
    """Whether ``candidate`` keeps ``KV_HEADROOM`` of its device KV free or evictable
    after allocating ``request`` (True when it does not report its KV)."""
    if candidate.free_blocks is None or candidate.kv_blocks is None:
        return True
    left = candidate.free_blocks - kv_blocks_needed(request, candidate.cached_blocks, block_size)
    return left >= KV_HEADROOM * candidate.kv_blocks


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


class PrefillTimes:
    """``exec_s`` of one prompt at each cached length, each prefill priced once: a choice
    among many workers asks for the same few lengths (nothing cached, the longest prefix)
    once per worker."""

    def __init__(self, cost: CostModel, x: int, block_size: int, step_tokens: int | None) -> None:
        self.cost, self.x, self.block_size, self.step_tokens = cost, x, block_size, step_tokens
        self._chunks: dict[int, tuple[float, int]] = {}

    def exec_s(self, cached_blocks: int, decode_s: float = 0.0) -> float:
        total, count = self._chunks.get(cached_blocks) or self._price(cached_blocks)
        return total + (count - 1) * decode_s

    def _price(self, cached_blocks: int) -> tuple[float, int]:
        chunks = prefill_chunks_s(self.cost, self.x, cached_blocks * self.block_size, self.step_tokens)
        self._chunks[cached_blocks] = (sum(chunks), len(chunks))
        return self._chunks[cached_blocks]


def exec_s(cost: CostModel, x: int, cached_blocks: int, block_size: int, step_tokens: int | None = None,
           decode_s: float = 0.0) -> float:
    """exec(x, y) for a prompt with ``cached_blocks`` cached, as an engine with a budget
    of ``step_tokens`` a step runs it: chunk by chunk, each chunk after the first with
    one more step of the decode batch (``decode_s``; the first chunk's is in the queued
    work)."""
    chunks = prefill_chunks_s(cost, x, cached_blocks * block_size, step_tokens)
    return sum(chunks) + (len(chunks) - 1) * decode_s


ROUTING_POLICIES: dict[str, type] = {p.name: p for p in (LeastLoad, SessionAffinity, PromptTree, CostAware)}
