"""Swap or recompute a preempted request (CacheOpt §3.5): the sweet spot S_s where
recomputing a sequence of S tokens, L_r(S), costs as much as swapping it, L_s(S).

CacheOpt fits L_r(S) = α·S^β + κ·S + ε and L_s(S) = γ·S + δ to profiled latencies;
``memserve profile`` already fits the same shapes per operator class, so both come from
the instance's ``CostModel``:

- L_r(S): the extra time prefilling S tokens adds to a step (the operators' per-token
  and per-sequence terms plus the sequence's quadratic attention; the step's fixed
  costs are paid by the step anyway, since a recompute rides along with other work);
- L_s(S): copying S tokens' KV out to the host tier and back in (``copy_s`` twice).

Above S_s swapping is cheaper. ``sweet_spot`` returns None when recompute is cheaper at
every length up to the context window (never swap)."""

from __future__ import annotations

from memserve.costmodel.model import CostModel


def recompute_s(cost: CostModel, tokens: int) -> float:
    """L_r(S)."""
    ops = sum(op.per_token * tokens + op.per_seq for op in cost.operators.values())
    return ops + cost.attention(tokens, 0.0)


def swap_s(cost: CostModel, tokens: int) -> float:
    """L_s(S): out and back in."""
    return 2 * cost.copy_s(tokens * cost.kv_bytes_per_token)


def sweet_spot(cost: CostModel, max_tokens: int) -> int | None:
    """The least S in [1, max_tokens] with L_r(S) >= L_s(S), by bisection (L_r - L_s
    is convex in S, and found negative at 1 whenever the search runs)."""
    if recompute_s(cost, 1) >= swap_s(cost, 1):
        return 1
    if recompute_s(cost, max_tokens) < swap_s(cost, max_tokens):
        return None
    lo, hi = 1, max_tokens  # L_r < L_s at lo, >= at hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if recompute_s(cost, mid) >= swap_s(cost, mid):
            hi = mid
        else:
            lo = mid
    return hi
