"""How many tokens a step may compute without breaking a running request's TBT SLO
(CacheOpt §3.3.2: requests are added to the batch "until ... the SLO of any request in
the batch is violated", the iteration time estimated from profiled data). A step that
decodes the running requests and prefills T new tokens takes, by the cost model,
decode(batch) + prefill(T); the largest T that fits the tightest next-token deadline is
the step's prefill allowance. Chunked prefill then splits long prompts over steps."""

from __future__ import annotations

from memserve.gateway.cost_model import CostModel


def prefill_tokens_within(cost: CostModel, seconds: float, num_decodes: int, context_tokens: int,
                          longest_context: int) -> int:
    """The most prompt tokens one step can prefill, beside ``num_decodes`` decoding
    requests, within ``seconds`` (0 when even the decodes alone take longer). Linear in
    the tokens: attention's quadratic term is left out, a chunk being short."""
    left = seconds - cost.decode_step_s(num_decodes, context_tokens, longest_context)
    fixed = sum(op.per_step + op.per_seq for op in cost.operators.values()) + cost.attention.d
    per_token = sum(op.per_token for op in cost.operators.values()) + cost.attention.c
    if left <= fixed:
        return 0
    return int((left - fixed) / per_token)
