"""Plain decode steps (``Engine.plain_steps``, ``plain_step``, ``add_quiet``) are what
``Engine.step`` does for a step in which every running request decodes a token and
nothing else happens: run side by side on the simulator's runner, the two give the same
tokens, slots, cached blocks, KV events, counts and clock stamps, through evictions of a
full pool, and stop before a request would finish."""

from __future__ import annotations

from memserve.config import EngineConfig
from memserve.costmodel.store import load_cost_model
from memserve.ipc.messages import AddRequest, SamplingParams
from memserve.kvcache.events import REMOVED, KVEvent
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
        self.events: list[KVEvent] = []
        for k, (prompt, limit) in enumerate(zip(prompts, max_tokens)):
            params = SamplingParams(max_tokens=limit, temperature=0.0, ignore_eos=True)
            assert self.engine.add_request(AddRequest(f"r{k}", prompt, params), 0.0) is None

    def step(self) -> None:
        self.runner.last_step_s = 0.0
        self.engine.step()
        self.now += self.runner.last_step_s
        self.events += self.engine.drain_kv_events()

    def run_plain(self, max_steps: int, quiet: int, other: Side) -> tuple[int, int]:
        """This engine's plain steps, as the simulator runs them, and as many ``step`` of
        ``other``, their states compared after each; returns (plain steps, quiet runs)."""
        seqs = self.engine.scheduler.running
        ends, answers = self.runner.decode_run([s.output_token_ids[-1] for s in seqs],
                                               [s.num_computed_tokens for s in seqs], max_steps, self.now, float("inf"))
        done = plain_steps = quiet_runs = 0
        while done < len(ends):
            if quiet:
                span = min(quiet, len(ends) - done)
                more, quiet = self.engine.add_quiet(span, [a[done:done + span] for a in answers])
                quiet_runs += 1
            else:
                span = 1
                more, quiet = self.engine.plain_step([a[done] for a in answers])
                self.events += self.engine.drain_kv_events()
                plain_steps += 1
            self.now = ends[done + span - 1]
            done += span
            for _ in range(span):
                other.step()
            assert other.state() == self.state()
            if not more:
                break
        return plain_steps, quiet_runs

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
    plain_steps = quiet_runs = 0
    while stepped.engine.has_work:
        max_steps, quiet = plain.engine.plain_steps()
        if max_steps:
            steps, runs = plain.run_plain(max_steps, quiet, stepped)
            plain_steps, quiet_runs = plain_steps + steps, quiet_runs + runs
            # The step after a run is no plain decode: a request finishes in it, or its blocks are short.
            assert not stepped.engine.plain_steps()[0]
        for side in (stepped, plain):
            side.step()
        assert stepped.state() == plain.state()
    assert not plain.engine.has_work
    assert plain_steps > 5 and quiet_runs > 5  # both kinds ran
    assert any(e.type == REMOVED for e in plain.events)  # through evictions
