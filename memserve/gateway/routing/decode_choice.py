"""Which decode instance takes a disaggregated request (MemServe §5.1): shared by the
gateway's disaggregated flow and the simulator's."""

from __future__ import annotations

from collections.abc import Sequence

from memserve.gateway.engine_protocol import EngineUnavailable
from memserve.gateway.routing.policies import PromptTree
from memserve.gateway.routing.route_types import (
    Balance,
    Candidate,
    RouteRequest,
    RoutingContext,
    WorkerView,
)
from memserve.kvcache.hashing import block_hashes

# The decode choice's load-imbalance guard: a decode instance with more than 2 requests in
# flight beyond the least loaded one is passed over whatever it caches. Tighter than the
# router's (16 by default): each request in a decode batch lengthens every step of it, while
# a prefix D holds saves only a transfer (benchmarks/simulated/pd_sim.py, long-doc-qa, 4 P + 4 D: with
# 16, 2-5% higher P99 JCT than least-loaded; with 2, within 2% and half the blocks sent).
DECODE_BALANCE = Balance(abs_threshold=2, rel_threshold=1.0)


def pick_decode(views: list[WorkerView], exclude: int | None = None, prompt: Sequence[int] | None = None,
                balance: Balance = DECODE_BALANCE, cache_salt: str | None = None) -> int:
    """The live decode instance to take a request, avoiding ``exclude`` unless it is the
    only one left.

    Given the ``prompt`` (pd-caching-2/3, where decode instances cache), the prompt-tree
    rule among the decode instances: the one whose mirrored tree holds the longest prefix
    of it, so that P sends only the blocks D lacks and a conversation's turns keep
    meeting their earlier KV on one D (MemServe §5.1 (c), §6). Ties, a prefix shorter than
    ``balance.cache_threshold`` of the prompt and a choice the load-imbalance guard
    overrides go by load. Without a prompt: the least loaded (fewest in flight)."""
    decode = [v for v in views if v.role == "decode"]
    live = [v for v in decode if v.state == "ok"] or [v for v in decode if v.state == "degraded"]
    if not live:
        raise EngineUnavailable("no live decode instance")
    others = [v for v in live if v.instance_id != exclude] or live
    block_size = others[0].mirror.block_size if prompt else 1
    hashes = block_hashes(prompt, block_size, salt=cache_salt) if prompt else []  # the request's salt names them
    candidates = [Candidate(v, len(v.mirror.match_hashes(hashes)) if hashes and v.state == "ok" else 0)
                  for v in others]
    request = RouteRequest("", list(prompt or ()))
    return PromptTree().choose(request, candidates, RoutingContext(None, balance, block_size)).instance
