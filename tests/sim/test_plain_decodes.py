"""Plain decode steps as the simulator takes them (``sim/plain_decodes.py``: those that
need no block recorded by ``PlainDecodes.take``, the others run by ``Engine.step``) leave
the engine as ``Engine.step`` alone does: run side by side on the simulator's runner, the
two give the same tokens, slots, cached blocks, KV events, counts and clock stamps,
through evictions of a full pool, and end before a request would finish."""

from __future__ import annotations

from memserve.config import EngineConfig
from memserve.costmodel.store import load_cost_model
from memserve.ipc.messages import AddRequest, SamplingParams
from memserve.kvcache.events import REMOVED, KVEvent
from memserve.sim.plain_decodes import PlainDecodes
from memserve.sim.runner import SimulatedRunner
from memserve.workers.engine.engine import Engine

BLOCK = 16
NUM_BLOCKS = 16


class Side:
    """An engine on the simulator's runner, its own virtual clock and its KV events."""

    def __init__(self, prompts: list[list[int]], max_tokens: list[int]) -> None:
        self.now = 0.0
        cost = load_cost_model("llama2-13b-h800")
        self.runner = SimulatedRunner(cost, NUM_BLOCKS, BLOCK, 1 << 14, lambda: self.now)
        self.engine = Engine(EngineConfig(block_size=BLOCK, num_blocks=NUM_BLOCKS), self.runner, set(), 0,
                             lambda: self.now)
        self.plain = PlainDecodes(self.engine, self.runner)
        self.events: list[KVEvent] = []
        for k, (prompt, limit) in enumerate(zip(prompts, max_tokens)):
            params = SamplingParams(max_tokens=limit, temperature=0.0, ignore_eos=True)
            assert self.engine.add_request(AddRequest(f"r{k}", prompt, params), 0.0) is None

    def step(self) -> None:
        self.runner.last_step_s = 0.0
        self.engine.step()
        self.now += self.runner.last_step_s
        self.events += self.engine.drain_kv_events()

    def run_plain(self, max_steps: int, other: Side) -> tuple[int, int]:
        """This engine's next plain steps as the simulator takes them, and as many ``step``
        of ``other``, their states compared after each take or step; returns how many
        spans of steps were recorded, and how many of them filled a block."""
        seqs = self.engine.scheduler.running
        start = self.now
        ends, answers = self.runner.decode_run([s.output_token_ids[-1] for s in seqs],
                                               [s.num_computed_tokens for s in seqs], max_steps, start, float("inf"))
        done = spans = filled = 0
        while done < len(ends):
            span = min(self.plain.room(), len(ends) - done)
            last = done + max(span, 1) - 1
            self.now = ends[last - 1] if last else start  # the clock of the last step's start
            if span:
                self.plain.take([a[done:done + span] for a in answers])
            else:
                self.engine.step()
            events = self.engine.drain_kv_events()
            spans, filled = spans + bool(span), filled + bool(span and events)
            self.events += events
            self.now = ends[last]
            for _ in range(max(span, 1)):
                other.step()
            assert other.state() == self.state()
            done = last + 1
        return spans, filled

    def state(self) -> tuple:
        pool = self.engine.mempool
        seqs = [(s.request_id, list(s.output_token_ids), s.num_computed_tokens) for s in self.engine.scheduler.running]
        stamps = sorted((n.hash, n.last_access, n.born, n.lock) for n in pool.index.nodes())
        return seqs, pool.stats(), stamps, self.events, self.engine.num_steps, self.now


def test_plain_steps_do_what_steps_do():
    # Four prompts, two sharing their first block, in a pool that the two long answers
    # fill after the short ones finished: their cached blocks are evicted for them.
    prompts = [list(range(1, 49)), list(range(1, 17)) + list(range(500, 516)), list(range(700, 720)),
               list(range(900, 920))]
    limits = [8, 10, 100, 90]
    stepped, plain = Side(prompts, limits), Side(prompts, limits)
    spans = filled = 0
    while stepped.engine.has_work:
        max_steps = plain.plain.steps()
        if max_steps:
            taken, indexing = plain.run_plain(max_steps, stepped)
            spans, filled = spans + taken, filled + indexing
            assert not stepped.plain.steps()  # the step after them finishes a request
        for side in (stepped, plain):
            side.step()
        assert stepped.state() == plain.state()
    assert not plain.engine.has_work
    assert spans > 5 and filled > 5  # recorded steps, some of them filling blocks
    assert any(e.type == REMOVED for e in plain.events)  # through evictions
