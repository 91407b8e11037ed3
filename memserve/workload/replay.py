"""How a replay of sessions is paced and what it returns: shared by the load generator
(``memserve bench``), which sends the requests over HTTP, and the simulator, which
replays the same sessions on a virtual clock.

- Sessions start by a Poisson process at ``rate`` sessions per second (session i starts
  after i exponential gaps; the first at once; ``inf`` starts all at once).
- Per-request SLOs are drawn from a seeded generator keyed by session and turn, so every
  run with the same seed asks the same of every request, whatever order they are sent in.
- With LoRA adapters, each session runs through one of them for all its turns, the same
  in both.
"""

from __future__ import annotations

import math
import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from memserve.workload.records import RequestRecord
from memserve.workload.workloads import Turn

DEFAULT_MAX_TOKENS = 256
LOAD_STATUSES = frozenset({"429", "503", "timeout"})


@dataclass
class ReplayOptions:
    rate: float = math.inf  # session starts per second
    concurrency: int | None = None
    duration_s: float | None = None
    max_tokens: int | None = None  # natural mode: DEFAULT_MAX_TOKENS when unset
    fixed_output_len: bool = False
    slo_ttft_ms: float | None = None
    slo_tbt_ms: float | None = None
    # Each request's SLOs are the ones above times a scale drawn uniformly from [lo, hi]
    # (one per request, for both), as CacheOpt §5 sets them (scale [0.5, 2.5]).
    slo_scale: tuple[float, float] | None = None
    think_time_s: float = 0.0  # mean of the exponential pause between turns
    seed: int = 0
    # LoRA adapters the conversations run through (vLLM bench's --lora-modules): each
    # conversation one, for all its turns (``session_adapter``); empty: the base model.
    lora_modules: tuple[str, ...] = ()

    def slos(self, session_id: str, turn: int) -> tuple[float | None, float | None]:
        """(TTFT, TBT) SLOs in ms of a session's turn (1-based); the same in every run
        with the same seed, whatever order requests are sent in."""
        if self.slo_scale is None:
            return self.slo_ttft_ms, self.slo_tbt_ms
        scale = random.Random(f"slo:{self.seed}:{session_id}:{turn}").uniform(*self.slo_scale)
        ttft, tbt = self.slo_ttft_ms, self.slo_tbt_ms
        return None if ttft is None else ttft * scale, None if tbt is None else tbt * scale

    def adapter_of(self, session_id: str) -> str | None:
        return session_adapter(session_id, self.lora_modules)

    def max_tokens_for(self, turn: Turn) -> int:
        """Natural: ``max_tokens`` (default 256). Fixed: the turn's target length, capped
        by ``max_tokens`` when that is set (a turn without one, such as a conversation's
        unanswered last message, falls back to the natural cap)."""
        if not self.fixed_output_len or turn.output_len is None:
            return self.max_tokens or DEFAULT_MAX_TOKENS
        return min(turn.output_len, self.max_tokens) if self.max_tokens else turn.output_len


def session_adapter(session_id: str, names: Sequence[str]) -> str | None:
    """The adapter of ``names`` a conversation runs through, spread evenly by a hash of its
    id (the same in every run and process); None without adapters."""
    if not names:
        return None
    return names[zlib.crc32(session_id.encode()) % len(names)]


@dataclass
class ReplayResult:
    records: list[RequestRecord]  # finished requests, successful or not, in finishing order
    duration_s: float
    cancelled: int = 0  # in flight when the run was halted
    interrupted: bool = False
    aborted: str | None = None  # why the run stopped early, if it did


def arrival_offsets(n: int, rate: float, rng: random.Random) -> list[float]:
    """Start times of n sessions from a Poisson process at ``rate``/s; the first at 0."""
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise ValueError("the arrival rate must be positive (or inf)")
    times = [0.0]
    for _ in range(n - 1):
        times.append(times[-1] + rng.expovariate(rate))
    return times
