"""What the simulator keeps per instance and per request in flight, shared by the
simulation loop (``simulator.py``) and its disaggregated flow (``pd_flow.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from memserve.gateway.routing.route_types import RouteRequest
from memserve.ipc.messages import AddRequest, MemPoolStats, TierStats, WorkerStats
from memserve.kvcache.address import Tier
from memserve.kvcache.mirror import PromptTreeMirror
from memserve.sim.plain_decodes import PlainDecodes
from memserve.sim.runner import SimulatedRunner
from memserve.workers.engine.engine import Engine
from memserve.workload.records import RequestRecord


@dataclass
class SimInstance:
    """One simulated worker: the real engine over a cost-model runner, and the gateway's
    mirror of its prompt tree."""

    engine: Engine
    runner: SimulatedRunner
    mirror: PromptTreeMirror
    role: str = "colocated"  # colocated | prefill | decode (sim/pd_flow.py)
    busy: bool = False  # a step event is scheduled
    step_end: float = 0.0  # when its latest step ends (a prefix push waits for it)
    state: str = "ok"  # as the gateway sees it: ok | degraded | dead (sim/node_loss.py)
    lost: bool = False  # its host is gone: it runs and sends nothing
    plain: PlainDecodes = field(init=False)  # its plain decode steps, for the run-ahead
    _device: dict[str, int] | None = field(default=None, init=False, repr=False)  # counted by the latest take_stats
    _stats: WorkerStats = field(default_factory=WorkerStats, init=False, repr=False)  # the report last built
    _built: dict[str, int] | None = field(default=None, init=False, repr=False)  # the counts it was built from
    _adapters: list[str] = field(default_factory=list, init=False, repr=False)  # its slots' at the latest take_stats

    def __post_init__(self) -> None:
        self.plain = PlainDecodes(self.engine, self.runner)

    def take_stats(self) -> None:
        """Count its device blocks (and note the LoRA adapters its slots hold) for its stats
        report, as a heartbeat does (about as often as its steps end); the report is built
        when the router reads it."""
        self._device = self.engine.mempool.tier_stats(Tier.DEVICE)
        slots = self.runner.adapters
        self._adapters = slots.held() if slots is not None else []

    @property
    def stats(self) -> WorkerStats:
        """Its stats report as the router reads it: its device blocks and adapters as of the
        latest ``take_stats`` (none before the first)."""
        if self._built is not self._device and self._device is not None:
            slots = self.runner.adapters
            self._stats = WorkerStats(mempool=MemPoolStats(tiers={"device": TierStats(**self._device)}),
                                      lora_adapters=self._adapters, lora_load_s=slots.load_s if slots else 0.0)
            self._built = self._device
        return self._stats


@dataclass
class InFlight:
    """A request in flight: its record, what the session needs to go on, and what a move
    to another worker starts from (``sim/node_loss.py``)."""

    record: RequestRecord
    session: int
    turn: int
    instance: int
    messages: list[tuple[str, list[int] | str]]
    add: AddRequest  # as first sent
    route: RouteRequest  # as first routed
    output: list[int] = field(default_factory=list)
    moves: int = 0  # to another worker, its worker having died
    cached_told: int | None = None  # moved after its first tokens: the cached tokens its client was told
