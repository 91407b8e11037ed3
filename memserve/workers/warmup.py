"""Warm-up: run representative engine steps once before a worker reports ready.

The first steps of a fresh process pay one-time costs (kernel selection and code paths
of the math libraries, the allocator growing its arenas for each new tensor shape), and
without this the first users would pay them. The steps run on a throwaway scheduler and
MemPool over the same runner and KV tensors, with caching off, so warm-up leaves no
cached block, no KV event and no statistic behind."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from memserve.ipc.messages import SamplingParams
from memserve.kvcache.address import Tier
from memserve.kvcache.mempool import MemPool
from memserve.workers.engine.sequence import Sequence

if TYPE_CHECKING:
    from memserve.workers.engine.engine import Engine

# Decode batch sizes and prompt lengths run once each (capped by the pool and context).
# The code paths matter, not the sizes: small shapes keep a restart after a crash fast.
BATCH_SIZES = (1, 4, 16)
PROMPT_LENS = (7, 20, 45)
DECODE_STEPS = 3
# The warm-up step budget, and a prompt that needs three chunks of it.
CHUNK_TOKENS = 64
CHUNKED_PROMPT_LEN = 150


def warm_up(engine: Engine, seed: int = 0) -> int:
    """Run warm-up requests to completion; returns the number of steps taken. Covers a
    prefill in several chunks, mixed prefill+decode steps and decode batches of several
    sizes, with greedy and sampled rows."""
    cfg = engine.cfg
    rng = random.Random(seed)
    runner = engine.runner
    mempool = MemPool(-1, {Tier.DEVICE: runner.num_blocks}, cfg.block_size, enable_caching=False,
                      mover=runner.mover, clock=engine.clock)
    scheduler = engine.make_scheduler(mempool, enable_prefix_caching=False, max_num_batched_tokens=CHUNK_TOKENS)
    limit = min(engine.max_model_len, runner.num_blocks * cfg.block_size) - DECODE_STEPS
    steps = 0

    def add(prompt_len: int, temperature: float) -> None:
        params = SamplingParams(max_tokens=DECODE_STEPS, temperature=temperature, ignore_eos=True)
        ids = [rng.randrange(runner.vocab_size) for _ in range(prompt_len)]
        scheduler.add(Sequence(f"warmup-{rng.getrandbits(32)}", ids, params, engine.clock()))

    def step() -> None:
        nonlocal steps
        plan = scheduler.schedule()
        result = runner.execute(plan)  # also tells the runner which warm-up requests ended
        if plan.chunks:
            scheduler.update(plan, result)
            steps += 1

    rounds = [[CHUNKED_PROMPT_LEN]]
    rounds += [[PROMPT_LENS[i % len(PROMPT_LENS)] for i in range(batch)] for batch in BATCH_SIZES]
    for lengths in rounds:
        if sum(lengths) + DECODE_STEPS * len(lengths) > limit:
            continue
        # The last request arrives one step late, so one step mixes prefill and decode.
        for i, length in enumerate(lengths[:-1]):
            add(length, 0.0 if i % 2 else 0.7)
        step()
        add(lengths[-1], 0.0)
        while scheduler.has_work:
            step()
    step()
    return steps
