"""The gateway's ``Router`` from ``memserve up``'s options: the policy by name, the load
guard, and the cost model (``--cost-model``, else the newest ``memserve profile`` of the
served model). Without a cost model routing works but predicts nothing, and a policy
that needs one (``cost``) routes as ``COST_FALLBACK`` until one arrives
(``Router.use_cost_model``, after the background profile of ``auto_profile.py``): a
missing profile never stops a start.

A profile is looked up by the name ``memserve profile`` writes it under (the model's own
name, whatever ``--served-model-name`` says), before the gateway replaces the model
option by its prepared folder."""

from __future__ import annotations

from pathlib import Path

from memserve.config import EngineConfig, ServeConfig, served_model_name
from memserve.costmodel.model import CostModel
from memserve.costmodel.store import find_profile, load_cost_model
from memserve.gateway.routing.route_types import Balance
from memserve.gateway.routing.router import Router

DTYPES = ("float32", "bfloat16", "float16")
# Routes for ``cost`` until its cost model arrives: the cache-aware policy that needs none.
COST_FALLBACK = "prompt-tree"


class RouterConfigError(ValueError):
    """The routing options cannot work (unknown policy, a cost model that cannot be loaded)."""


def build_router(cfg: ServeConfig) -> Router:
    try:
        if cfg.cost_model:
            cost: CostModel | None = load_cost_model(cfg.cost_model)
        else:
            found = find_cost_model(cfg.engine)
            cost = found[1] if found else None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RouterConfigError(f"cannot load the cost model {cfg.cost_model or 'profile'}: {exc}") from exc
    try:
        return Router.named(cfg.router, cost, Balance(cfg.router_balance_abs, cfg.router_balance_rel,
                                                      cfg.router_cache_threshold),
                            step_tokens=cfg.engine.prefill_chunk_tokens, fallback=COST_FALLBACK)
    except ValueError as exc:
        raise RouterConfigError(str(exc)) from exc


def profile_model_name(engine: EngineConfig) -> str:
    """The name ``memserve profile --model engine.model`` keys its cost model by."""
    return served_model_name(ServeConfig(engine=EngineConfig(model=engine.model)))


def find_cost_model(engine: EngineConfig) -> tuple[Path, CostModel] | None:
    """The newest profile of ``engine``'s model and dtype (any dtype's when ``auto``), at
    its tensor-parallel size, and the cost model in it; None when there is none."""
    name = profile_model_name(engine)
    for d in DTYPES if engine.dtype == "auto" else (engine.dtype,):
        path = find_profile(name, d, tensor_parallel_size=engine.tensor_parallel_size)
        if path is not None:
            return path, load_cost_model(path)
    return None
