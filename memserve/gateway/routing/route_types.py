"""What a routing policy sees and what it answers: the request, each worker as the
gateway knows it, the live workers scored with their cached prefix and queued work, and
the decision (which worker, why, and whether to pull a longer prefix there first).
Kept apart from ``router.py`` so policies and the router can import them both."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from memserve.costmodel.model import BandwidthCost, CostModel
from memserve.ipc.messages import WorkerStats
from memserve.kvcache.mirror import PromptTreeMirror

# Why a worker was chosen; /metrics counts decisions by policy and reason.
CACHE_HIT = "cache_hit"  # it holds the longest cached prefix (or the session lives there)
LOAD = "load"  # nothing cached anywhere that matters: the least loaded one
PULL = "pull"  # it pulls a longer prefix from another worker first (MemServe eq. 2)
FALLBACK = "fallback"  # the load-imbalance guard overrode the policy's choice
REASONS = (CACHE_HIT, LOAD, PULL, FALLBACK)


@dataclass
class RouteRequest:
    request_id: str
    prompt_token_ids: list[int]
    session_id: str | None = None
    slo: dict = field(default_factory=dict)
    max_tokens: int | None = None  # per choice; None: unknown (the ledger assumes a default)
    n: int = 1  # choices decoded from the one prompt
    cache_salt: str | None = None  # names the prompt's blocks apart (kvcache/hashing.py)
    lora_name: str | None = None  # the LoRA adapter it runs through (None: the base model)


@dataclass
class WorkerView:
    instance_id: int
    state: str  # ok | degraded | starting | dead (cluster.WorkerHandle.state)
    in_flight: int  # requests this gateway has there now
    stats: WorkerStats  # the worker's last heartbeat's
    mirror: PromptTreeMirror
    role: str = "colocated"  # colocated | prefill | decode: new requests go to the first two only


@dataclass
class Candidate:
    """A worker the request may go to, scored for this request."""

    view: WorkerView
    cached_blocks: int = 0  # its longest cached prefix of the prompt (0 for a worker that is not ok)
    queued_s: float = 0.0  # predicted work of the requests in flight there (0 without a cost model)
    step_s: float = 0.0  # predicted length of its current step (0 without a cost model)
    decode_s: float = 0.0  # predicted length of one step of its decode batch (0 without a cost model)
    # Of cached_blocks, the blocks it holds only as prompts routed there and not yet in its mirror
    # (``pending_prefixes``): skipped by this request once computed, but not there to pull yet.
    pending_blocks: int = 0
    # Device KV blocks it can still allocate (free plus evictable at its last report, less
    # what the requests routed there and not started yet compute); None: not reported.
    free_blocks: int | None = None
    kv_blocks: int | None = None  # its device KV pool, in blocks; None: not reported
    adapter_load_s: float = 0.0  # reading the request's LoRA adapter in there first (0: it holds it)

    @property
    def instance_id(self) -> int:
        return self.view.instance_id

    @property
    def in_flight(self) -> int:
        return self.view.in_flight

    @property
    def stored_blocks(self) -> int:
        """The cached prefix its mirror shows: what a prefix pull can move from it now."""
        return self.cached_blocks - self.pending_blocks


@dataclass(frozen=True)
class Balance:
    """Locality against load, as SGLang's cache-aware router weighs them. The guard: a
    cache-seeking choice is overridden by the least loaded worker when the chosen one has
    more than ``abs_threshold`` requests in flight beyond the least loaded *and* more than
    ``rel_threshold`` times as many. ``cache_threshold``: prompt-tree follows a cached
    prefix only when it covers at least this share of the prompt, so that a short prefix
    every prompt shares (a chat template's default system prompt) does not send every new
    conversation to the first worker that cached it."""

    abs_threshold: int = 16
    rel_threshold: float = 1.5
    cache_threshold: float = 0.5

    def worth_following(self, cached_blocks: int, block_size: int, prompt_tokens: int) -> bool:
        """Whether a cached prefix of ``cached_blocks`` covers ``cache_threshold`` of the prompt."""
        return cached_blocks > 0 and cached_blocks * block_size >= self.cache_threshold * prompt_tokens

    def overloaded(self, chosen: Candidate, candidates: list[Candidate]) -> bool:
        least = min(c.in_flight for c in candidates)
        return chosen.in_flight - least > self.abs_threshold and chosen.in_flight > self.rel_threshold * least


@dataclass(frozen=True)
class RoutingContext:
    """What the router lends its policy besides the candidates."""

    cost: CostModel | None
    balance: Balance
    block_size: int
    step_tokens: int | None = None  # the workers' token budget per step: longer prefills run in chunks
    # The KV links the gateway measured, by (source, destination) worker (gateway/link_probe.py).
    links: Mapping[tuple[int, int], BandwidthCost] = field(default_factory=dict)

    def transfer_s(self, src: int, dst: int, blocks: int) -> float:
        """MemServe eq. 2's transfer() of ``blocks`` KV blocks from worker ``src`` to
        ``dst``: over their link as measured when it was, else as the cost model's profile
        measured a transfer between two processes of one machine."""
        assert self.cost is not None, "transfers are priced by a cost model"
        nbytes = blocks * self.block_size * self.cost.kv_bytes_per_token
        link = self.links.get((src, dst))
        return link(nbytes) if link is not None and nbytes > 0 else self.cost.transfer_s(nbytes)


@dataclass(frozen=True)
class RouteDecision:
    instance: int
    reason: str
    pull_from: int | None = None  # have this worker push its cached prefix to ``instance`` first
    pull_blocks: int = 0  # blocks the pull is expected to move


class RoutingPolicy(Protocol):
    name: str
    uses_cache: bool  # whether it needs each candidate's cached prefix

    def choose(self, request: RouteRequest, candidates: list[Candidate], ctx: RoutingContext) -> RouteDecision:
        """A decision naming one of ``candidates`` (never empty)."""
        ...
