"""What the simulator keeps per instance and per request in flight, shared by the
simulation loop (``simulator.py``) and its disaggregated flow (``pd_flow.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from memserve.ipc.messages import WorkerStats
from memserve.kvcache.mirror import PromptTreeMirror
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
    stats: WorkerStats = field(default_factory=WorkerStats)  # its device blocks as of its latest step (a heartbeat's)


@dataclass
class InFlight:
    """A request in flight: its record and what the session needs to go on."""

    record: RequestRecord
    session: int
    turn: int
    instance: int
    messages: list[tuple[str, list[int] | str]]
    output: list[int] = field(default_factory=list)
