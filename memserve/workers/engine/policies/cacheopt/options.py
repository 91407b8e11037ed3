"""The knobs of the ``cacheopt`` schedule policy, parsed from ``--schedule-policy-options``.

Defaults are CacheOpt §5's settings: B = 8 tokens of basic allocation and embedding
buffer, proactive allocation m = 2 iterations ahead, 8 blocks of global reserve. Each
component can be switched off by its ablation name (CacheOpt §5.2, Fig. 14), so the
simulator can run the ablation on the same engine:

- ``RSA``: SLO-aware request selection and KV allocation. Off: waiting requests are
  admitted first come first served and get their predicted demand whole or wait (RLP's
  allocation: no amortisation, no embedding, no cut of running requests' unused KV),
  running requests keep their order and steps their configured token budget.
- ``PA``: proactive allocation of the remaining demand m iterations before a request
  runs out of its allocation.
- ``GR``: the global reserve.
- ``PP``: the preemption order (loose TBT SLO, long remaining time, small KV). Off: the
  newest running request, as fcfs.
- ``PSS``: swap or recompute by the sweet spot. Off: always recompute.
- ``CKA`` (confidence-based padding) is the gateway's: the predictor pads the predicted
  length before it reaches the worker; ``memserve simulate --padding`` plays that part.

Syntax: ``key=value`` pairs separated by ``;`` or whitespace, e.g.
``disable=PA,GR;reserve=16;m=2;b=8``."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import ClassVar

COMPONENTS = ("RSA", "PA", "GR", "PP", "PSS")


@dataclass(frozen=True)
class CacheOptOptions:
    block_tokens: int = 8  # B: basic allocation of a critical request, and the embedding buffer b (tokens)
    lookahead: int = 2  # m: iterations ahead that proactive allocation tops a request up
    reserve_blocks: int = 8  # global reserve (KV blocks)
    min_prefill_tokens: int = 64  # TBT deadlines only a smaller chunk meets are given up (prefills progress)
    epsilon_ms: float = 5.0  # a request whose remaining time minus the longest step is below this is critical
    step_window: int = 64  # the longest step is taken over this many recent steps
    default_ttft_ms: float = 10_000.0  # SLOs of requests that carry none
    default_tbt_ms: float = 1_000.0
    priority_slack_ms: float = 1_000.0  # each priority level (lower first) moves a deadline this much
    disabled: frozenset[str] = field(default_factory=frozenset)

    _KEYS: ClassVar[dict[str, str]] = {
        "b": "block_tokens", "m": "lookahead", "reserve": "reserve_blocks", "min_prefill": "min_prefill_tokens",
        "epsilon_ms": "epsilon_ms", "step_window": "step_window", "default_ttft_ms": "default_ttft_ms",
        "default_tbt_ms": "default_tbt_ms", "priority_slack_ms": "priority_slack_ms"}

    def on(self, component: str) -> bool:
        return component not in self.disabled

    @classmethod
    def parse(cls, text: str) -> CacheOptOptions:
        values: dict = {}
        types = {f.name: f.type for f in fields(cls)}
        for item in text.replace(";", " ").split():
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"cacheopt option {item!r}: expected key=value")
            if key == "disable":
                names = frozenset(v.strip().lstrip("/").upper() for v in value.split(",") if v.strip())
                unknown = names - set(COMPONENTS)
                if unknown:
                    raise ValueError(f"cacheopt: unknown component(s) {sorted(unknown)}; expected {COMPONENTS}")
                values["disabled"] = names
            elif key in cls._KEYS:
                name = cls._KEYS[key]
                values[name] = float(value) if types[name] == "float" else int(value)
                if values[name] < 0:
                    raise ValueError(f"cacheopt option {key} must be >= 0")
            else:
                raise ValueError(f"unknown cacheopt option {key!r}; expected disable or one of {sorted(cls._KEYS)}")
        return cls(**values)
