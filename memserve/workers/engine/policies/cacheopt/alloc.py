"""CacheOpt's KV allocation arithmetic (§3.3), pure functions on token and block counts:
a request's demand, the amortised cut when demands exceed the free KV, and the choice
of a running request whose allocated-but-unused KV a new request can live in.

Amortisation. §3.3.2's text says a request with a looser SLO (longer remaining time
RT) and a longer predicted output should take a *larger cut* of its demand (it is less
delay-sensitive and will see KV freed before it needs it), and Table 2 defines the
excess ``E = sum(M_i) - A``. The printed formula ``A_i = A * w_i / sum(w)`` with
``w_i = RT_i/sum(RT) * s_i^p/sum(s^p)`` would instead give those requests *more*. We
follow the text: the excess is shared out as cuts in proportion to
``w_i = RT_i/sum(RT) * s_i^o/sum(s^o)``, no request cut below its basic need."""

from __future__ import annotations

import math
from dataclasses import dataclass

from memserve.workers.engine.sequence import Sequence


def demand_tokens(seq: Sequence, block_tokens: int) -> int:
    """M_i: the KV the request will hold when done, by the gateway's (padded) predicted
    output length; without a prediction, only its tokens so far plus B (it then grows on
    demand, as vLLM allocates). At least B more tokens, never past ``max_tokens``."""
    pred = seq.predicted_output_tokens
    if pred is None:
        return seq.num_tokens + block_tokens
    remaining = max(pred - len(seq.output_token_ids), block_tokens)
    return min(seq.num_tokens + remaining, seq.num_prompt_tokens + seq.params.max_tokens)


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def amortise(demands: list[int], floors: list[int], available: int, remaining_s: list[float],
             outputs: list[int]) -> list[int]:
    """Blocks for each request: its whole demand when the demands fit in ``available``;
    otherwise demand minus its share of the excess, shares weighted by remaining time to
    its SLO times predicted output length, never below ``floors[i]`` (a share a floor
    stops is spread over the others). Rounded down, so the sum never exceeds
    ``available``. The caller makes sure the floors fit."""
    excess: float = sum(demands) - available
    if excess <= 0:
        return list(demands)
    rt = [max(r, 1e-3) for r in remaining_s]
    out = [max(o, 1) for o in outputs]
    total_rt, total_out = sum(rt), sum(out)
    weights = [r / total_rt * o / total_out for r, o in zip(rt, out)]
    cuts = [0.0] * len(demands)
    open_ = [i for i in range(len(demands)) if demands[i] > floors[i]]
    while excess > 1e-9 and open_:
        total_w = sum(weights[i] for i in open_)
        share = {i: excess * weights[i] / total_w for i in open_}
        excess = 0.0
        still = []
        for i in open_:
            room = demands[i] - floors[i] - cuts[i]
            if share[i] >= room:
                cuts[i] += room
                excess += share[i] - room
            else:
                cuts[i] += share[i]
                still.append(i)
        open_ = still
    return [max(f, math.floor(d - c + 1e-9)) for d, f, c in zip(demands, floors, cuts)]


@dataclass(frozen=True)
class Host:
    """A running request that could host a new one in its allocated, unused KV."""

    request_id: str
    allocated_tokens: int  # a_j
    used_tokens: int  # u_j


def embedding_host(prompt_tokens: int, output_tokens: int, hosts: list[Host], buffer: int) -> Host | None:
    """§3.3.1: a new request (s^p prompt, s^o predicted output tokens) fits in host j's
    allocation when ``a_j - (u_j + s^o) - (s^p + s^o) >= b``: after both have run s^o
    steps, the new one is done and j is still b tokens short of its space. Of the hosts
    that fit, the one with the least unused allocation (least reserved waste left)."""
    fits = [h for h in hosts
            if h.allocated_tokens - (h.used_tokens + output_tokens) - (prompt_tokens + output_tokens) >= buffer]
    return min(fits, key=lambda h: h.allocated_tokens - h.used_tokens, default=None)
