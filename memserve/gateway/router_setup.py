"""The gateway's ``Router`` from ``memserve up``'s options: the policy by name, the load
guard, and the cost model (``--cost-model``, else the newest ``memserve profile`` of the
served model; without one, routing works but predicts nothing and ``cost`` is refused)."""

from __future__ import annotations

from memserve.config import ServeConfig
from memserve.costmodel.model import CostModel
from memserve.costmodel.store import find_profile, load_cost_model
from memserve.gateway.routing.route_types import Balance
from memserve.gateway.routing.router import Router

DTYPES = ("float32", "bfloat16", "float16")


class RouterConfigError(ValueError):
    """The routing options cannot work (unknown cost model, cost router without one)."""


def build_router(cfg: ServeConfig, model_name: str) -> Router:
    try:
        cost = load_cost_model(cfg.cost_model) if cfg.cost_model else _profiled(model_name, cfg.engine.dtype)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RouterConfigError(f"cannot load the cost model {cfg.cost_model or 'profile'}: {exc}") from exc
    try:
        return Router.named(cfg.router, cost, Balance(cfg.router_balance_abs, cfg.router_balance_rel,
                                                           cfg.router_cache_threshold),
                            step_tokens=cfg.engine.prefill_chunk_tokens)
    except ValueError as exc:
        raise RouterConfigError(str(exc)) from exc


def _profiled(model_name: str, dtype: str) -> CostModel | None:
    for d in DTYPES if dtype == "auto" else (dtype,):
        path = find_profile(model_name, d)
        if path is not None:
            return load_cost_model(path)
    return None
