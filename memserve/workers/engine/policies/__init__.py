"""Scheduling policies: the order in which waiting requests are admitted, which running
request is preempted when KV blocks run out and how (swap or recompute), and optionally
how many KV blocks each request may hold (a ``KVGate``). The scheduler keeps the
mechanics (budgets, blocks, chunking) and calls these hooks, so policies can be swapped
by a flag (``--schedule-policy``, ``--schedule-policy-options``) and compared in the
simulator on the same engine. The hooks are declared in ``base.py``; ``fcfs`` (vLLM's
baseline), ``lpm`` (SGLang's longest prefix match) and ``cacheopt`` (CacheOpt §3.3-3.5, a
subpackage) implement them in modules of their own, which this package registers by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from memserve.workers.engine.policies.base import PreemptKind, SchedulePolicy
from memserve.workers.engine.policies.cacheopt.options import CacheOptOptions
from memserve.workers.engine.policies.cacheopt.policy import CacheOpt
from memserve.workers.engine.policies.fcfs import FCFS
from memserve.workers.engine.policies.lpm import LongestPrefixMatch

if TYPE_CHECKING:
    from memserve.costmodel.model import CostModel

__all__ = ["SCHEDULE_POLICIES", "PreemptKind", "SchedulePolicy", "make_schedule_policy"]


def _fcfs(options: str, cost: CostModel | None) -> SchedulePolicy:
    if options:
        raise ValueError("the fcfs schedule policy takes no options")
    return FCFS()


def _cacheopt(options: str, cost: CostModel | None) -> SchedulePolicy:
    return CacheOpt(CacheOptOptions.parse(options), cost)


def _lpm(options: str, cost: CostModel | None) -> SchedulePolicy:
    if options:
        raise ValueError("the lpm schedule policy takes no options")
    return LongestPrefixMatch()


SCHEDULE_POLICIES: dict[str, Callable[[str, CostModel | None], SchedulePolicy]] = {
    "fcfs": _fcfs, "lpm": _lpm, "cacheopt": _cacheopt}


def make_schedule_policy(name: str, options: str = "", cost: CostModel | None = None) -> SchedulePolicy:
    """Policy ``name`` with its ``options`` string and, for policies that weigh swap
    against recompute, the instance's ``CostModel`` (None: none known)."""
    if name not in SCHEDULE_POLICIES:
        raise ValueError(f"unknown schedule policy {name!r}; expected one of {sorted(SCHEDULE_POLICIES)}")
    return SCHEDULE_POLICIES[name](options, cost)
