"""The real Engine driven by a scripted runner and a fake clock (no model, no torch)."""

from __future__ import annotations

from helpers.mempool import NumpyBlockMover
from memserve.ipc.messages import AddRequest, RequestOutput, SamplingParams
from memserve.kvcache.address import Tier
from memserve.workers.engine.engine import Engine
from memserve.workers.engine.step_plan import KVLoad, StepPlan, StepResult

BS = 4
VOCAB = 1000
EOS = 999


class ScriptedRunner:
    """Samples token ``7`` for every request asked to sample; records every plan; copies
    loads through a numpy mover, completing them only when the test says so."""

    def __init__(self, num_blocks: int, num_host_blocks: int = 0) -> None:
        self.num_blocks = num_blocks
        self.vocab_size = VOCAB
        self.max_position_embeddings = 4096
        self.num_layers = 1
        self.saver = None  # saves synchronous and exact
        self.disk = None
        self.num_disk_blocks = 0
        tiers = {Tier.DEVICE: num_blocks, **({Tier.HOST: num_host_blocks} if num_host_blocks else {})}
        self.mover = NumpyBlockMover(tiers)
        self.plans: list[StepPlan] = []
        self.known: set[str] = set()
        self.loads: list[KVLoad] = []
        self.done_loads: list[str] = []

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        self.known -= set(plan.finished_ids)
        self.known |= {r.request_id for r in plan.new_requests}
        self.start_loads(plan.loads)
        assert all(c.request_id in self.known for c in plan.chunks), "a chunk of a request the runner never saw"
        return StepResult({c.request_id: 7 for c in plan.chunks if c.sample})

    def start_loads(self, loads: list[KVLoad]) -> None:
        self.loads += loads

    def complete_loads(self) -> None:
        for load in self.loads:
            for tier, src, dst in load.copies:
                self.mover.copy_blocks(Tier(tier), src, Tier.DEVICE, dst)
            self.done_loads.append(load.request_id)
        self.loads = []

    def finished_loads(self) -> list[str]:
        done, self.done_loads = self.done_loads, []
        return done

    def failed_loads(self) -> dict[str, BaseException]:
        return {}

    def streamable_loads(self) -> list[str]:
        return []


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def add(engine: Engine, rid: str, prompt: list[int], max_tokens: int = 3) -> None:
    assert engine.add_request(AddRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))) is None


def chunk_sizes(plan: StepPlan) -> dict[str, int]:
    return {c.request_id: len(c.token_ids) for c in plan.chunks}


def run_to_end(engine: Engine) -> list[RequestOutput]:
    outputs = []
    while engine.has_work:
        outputs += engine.step()
    return outputs


def assert_no_block_held(engine: Engine) -> None:
    for tier in engine.mempool.tiers:
        s = engine.mempool.stats()[tier.name.lower()]
        assert s["free"] + s["evictable"] == s["total"], (tier, s)
