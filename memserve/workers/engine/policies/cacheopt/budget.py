"""How many prompt tokens a step computes beside the decodes: the chunked-prefill budget
that keeps the running requests' TBT SLOs (CacheOpt §3.3.2: requests join the batch
"until ... the SLO of any request in the batch is violated", the iteration time
estimated from profiled data) while prefills still progress.

Why: a step that decodes the running requests and prefills T new tokens takes, by the
cost model (the one ``memserve profile`` fits, and the simulator's clock),
decode(batch) + prefill(T) less the fixed cost the two share (``CostModel.step_s``:
the weights are read once), and prefill(T) grows with T: a long chunk breaks every
running request's next-token deadline.

The rule (``step_prefill_tokens``), with the decodes' deadlines as slacks from now:

- TBT: the tightest deadline that a step with ``min_chunk`` prompt tokens can still
  meet allows the largest T whose step meets it;
- progress: tighter deadlines are given up (no step with prompt tokens meets them, the
  fixed prefill cost alone being most of a decode step), so a step carries at least
  ``min_chunk`` prompt tokens whenever prompts wait: prefills are never starved by a
  stream of tight-SLO decodes;
- critical requests first (§3.3.2), by TTFT: at least the chunk with which every
  prompt, served in admission order, finishes by its TTFT deadline (``ttft_chunk``);
  as a deadline nears this grows to the rest of the prompt, over the TBT bound, and a
  prompt already late gets the whole budget. Prefills wait at most until their own
  deadline, whatever the decode load."""

from __future__ import annotations

import math
from collections.abc import Iterable

from memserve.costmodel.model import CostModel


def _prefill_terms(cost: CostModel) -> tuple[float, float]:
    """Prefill's cost beside the decodes, linear in its tokens: (fixed s, s per token).
    Its per-step cost shared with the decodes (``CostModel.step_s``) is not paid twice;
    attention's quadratic term is left out, a chunk being short."""
    fixed = sum(op.per_step + op.per_seq for op in cost.operators.values()) + cost.attention.d - cost.shared_step_s()
    return fixed, sum(op.per_token for op in cost.operators.values()) + cost.attention.c


def prefill_tokens_within(cost: CostModel, seconds: float, num_decodes: int, context_tokens: int,
                          longest_context: int) -> int:
    """The most prompt tokens one step can prefill, beside ``num_decodes`` decoding
    requests, within ``seconds`` (0 when even the decodes alone take longer)."""
    fixed, per_token = _prefill_terms(cost)
    left = seconds - cost.decode_step_s(num_decodes, context_tokens, longest_context)
    if left <= fixed:
        return 0
    return int((left - fixed) / per_token + 1e-6)  # 70.99999... tokens of float error are 71


def ttft_chunk(cost: CostModel, prefills: Iterable[tuple[float, int]], decode_s: float, limit: int) -> int:
    """The smallest chunk T (at most ``limit``) with which ``prefills`` — (seconds to
    the TTFT deadline, prompt tokens left), in the order they are served — each finish
    by their deadline, every step taking ``decode_s`` + prefill(T): the k-th is done
    after ceil(N_k / T) steps, N_k the tokens up to it, so it needs the largest step
    count n with n (decode_s + fixed + per_token ceil(N_k / n)) <= slack_k, and
    T >= ceil(N_k / n). One that even a single step of all N_k tokens would not finish
    in time is late: ``limit``, as soon as possible."""
    fixed, per_token = _prefill_terms(cost)
    step = decode_s + fixed
    need = chunk = 0
    for slack, tokens in prefills:
        need += tokens
        steps = int((slack - per_token * need) // step)  # n (step + per_token N / n) <= slack
        if steps < 1:
            return limit
        while steps > 1 and steps * (step + per_token * math.ceil(need / steps)) > slack:
            steps -= 1
        chunk = max(chunk, math.ceil(need / steps))
        if chunk >= limit:
            return limit
    return chunk


def step_prefill_tokens(cost: CostModel, slacks: Iterable[float], contexts: list[int],
                        prefills: Iterable[tuple[float, int]], limit: int, min_chunk: int) -> int:
    """Prompt tokens this step may compute beside decoding requests of ``contexts``
    tokens whose next-token deadlines are ``slacks`` seconds away, with ``prefills`` as
    in ``ttft_chunk``; at most ``limit`` (what the configured budget leaves after the
    decodes). The rule is the module's."""
    if not contexts:
        return limit
    num, total, longest = len(contexts), sum(contexts), max(contexts)
    allowances = [p for s in slacks if (p := prefill_tokens_within(cost, s, num, total, longest)) >= min_chunk]
    return min(limit, max(min(allowances, default=limit),
                          ttft_chunk(cost, prefills, cost.decode_step_s(num, total, longest), limit)))
