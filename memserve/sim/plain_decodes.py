"""Plain decode steps: which of an instance's next engine steps are plain decodes, and
which of those the simulator records on the engine's requests instead of stepping it
(its run-ahead, ``Simulation._run_ahead``).

A *plain* decode step is an ``Engine.step`` in which every running request decodes one
token and nothing else happens: nothing waits or loads, no request finishes. If it also
needs no block (every running request has a slot for its token in the blocks it holds),
it allocates nothing, so it preempts nothing, and all ``Engine.step`` does is, request
after request: append the sampled token, count it computed, and offer a block it filled
to the index (``KVCacheManager.cache_full_blocks``). ``take`` does just that. A step that
needs a block runs through ``Engine.step``, where the scheduler allocates it (or
preempts).

A step that fills no block touches neither the KV pool nor the clock (*quiet*), so
``take`` records a run of quiet steps together with the step after them when that one
needs no block either: only the last step of a ``take`` moves blocks, on its own clock.

What this relies on (``steps`` and ``room`` say 0 where it does not hold):
- the KV manager's invariant that full blocks are offered to the index as soon as they
  are computed: a running request that computed ``c`` tokens has indexed ``c //
  block_size`` blocks (with prefix caching), so the step that completes a block indexes
  it and none before;
- the schedule policy's hooks do nothing while nothing waits (``INERT_POLICIES``), and
  the policy has no say over KV growth (no ``KVGate``);
- no drafts (speculative decoding), no look-ahead window, no retention, no disk store,
  no pins held, no saves to commit or in flight (a saver that copies in the call, or the
  simulator's timed one, ``sim/saver.py``, whose jobs in flight are known) and no load in
  flight: nothing else runs between steps or reads the clock;
- no token ends a request (no stop tokens, EOS ignored), so only the length limits
  end one and the steps before the first limit finish nothing.

``tests/sim/test_plain_decodes.py`` compares the engine's states with ``Engine.step``'s
step by step, ``tests/sim/test_run_ahead.py`` the simulation's results with those of one
event per step.
"""

from __future__ import annotations

from memserve.sim.runner import SimulatedRunner
from memserve.sim.saver import TimedSaver
from memserve.workers.engine.engine import Engine

# Schedule policies whose ``make_room`` and ``begin_step`` do nothing while nothing
# waits (no preemption, no reordering, the whole budget, no state of their own).
INERT_POLICIES = frozenset({"fcfs", "lpm"})


class PlainDecodes:
    """One simulated instance's engine, as its run-ahead sees it."""

    def __init__(self, engine: Engine, runner: SimulatedRunner) -> None:
        self.engine = engine
        self.runner = runner
        scheduler, pool = engine.scheduler, engine.mempool
        self.enabled = (scheduler.policy.name in INERT_POLICIES and scheduler.kv.gate is None
                        and scheduler.proposer is None and engine.lookahead is None and engine.retention is None
                        and pool.disk is None and (pool.saver.inline or isinstance(pool.saver, TimedSaver)))

    def steps(self) -> int:
        """How many of the next engine steps, at most, are plain decodes (0: the next is
        not one): every running request is decoding, nothing waits or loads, and none
        reaches a length limit before the last of them (the step that does finishes it)."""
        engine = self.engine
        scheduler = engine.scheduler
        running = scheduler.running
        if (not self.enabled or not running or scheduler.num_waiting or self.runner.next_load_done() is not None
                or len(running) > scheduler.config.max_num_batched_tokens or engine.mempool.saver.pending()):
            return 0
        steps = max_len = scheduler.config.max_model_len
        eos = engine.eos_token_ids
        for seq in running:
            params = seq.params
            num_tokens = seq.num_tokens
            if seq.num_computed_tokens != num_tokens - 1 or params.stop_token_ids or (eos and not params.ignore_eos):
                return 0
            steps = min(steps, params.max_tokens - len(seq.output_token_ids), max_len - num_tokens)
        return max(steps - 1, 0)

    def room(self) -> int:
        """How many of the next plain decode steps ``take`` may record at once: those for
        which every running request has a slot in the blocks it holds, up to the first
        that fills a block (with prefix caching). None while a pin is held (its expiry
        is a matter of the clock)."""
        pins = self.engine.mempool.pins
        if pins is not None and len(pins):
            return 0
        kv = self.engine.scheduler.kv
        bs, caching, block_ids = kv.block_size, kv.enable_caching, kv.block_ids
        room = -1
        for seq in self.engine.scheduler.running:
            computed = seq.num_computed_tokens
            steps = len(block_ids(seq.request_id)) * bs - computed
            if caching:
                steps = min(steps, bs - computed % bs)
            room = steps if room < 0 else min(room, steps)
        return max(room, 0)

    def take(self, tokens: list[list[int]]) -> None:
        """What ``Engine.step`` leaves behind after plain decode steps within ``room`` in
        which running request i sampled ``tokens[i]``, a token a step; the engine's clock
        reads the start of the last of them."""
        cache_full_blocks = self.engine.scheduler.kv.cache_full_blocks
        for seq, sampled in zip(self.engine.scheduler.running, tokens):
            seq.output_token_ids += sampled
            seq.num_computed_tokens += len(sampled)
            cache_full_blocks(seq)
        self.engine.num_steps += len(tokens[0])
