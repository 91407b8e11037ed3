"""MemPool micro-benchmarks (MemServe §8.4, Figs. 9-10), pure Python, no model.

Prints, as medians over many repetitions (time.perf_counter_ns):

1. alloc + free, ns per block, by batch size: the raw ``BlockPool`` and the address-level
   ``MemPool.alloc_mem`` + ``free_mem`` (MemServe measured ~800 ns a block);
2. ``insert`` and ``match`` of a 4K-token prompt (256 blocks of 16), hashing included,
   at several cached ratios (MemServe: at most 0.7 ms to insert);
3. ``match`` latency against prompt length (512 .. 16K tokens), radix index versus a
   vLLM-style prefix cache (a dict from chained block hash to block, all blocks hashed
   up front, then looked up block by block), for a fully cached prompt and an uncached
   one (MemServe Fig. 10's case), with ratios.

    python -m benchmarks.mempool_micro [--reps N]     (from the repository root)
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from array import array
from collections.abc import Callable, Sequence
from functools import partial

from memserve.kvcache.address import Tier
from memserve.kvcache.blocks import BlockPool
from memserve.kvcache.hashing import block_hashes
from memserve.kvcache.mempool import KVFlags, MemPool
from memserve.kvcache.radix import RadixIndex

BLOCK_SIZE = 16


class HashPrefixCache:
    """The vLLM-style baseline: chained block hash -> block id, no tree."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.table: dict[int, int] = {}

    def insert(self, tokens: Sequence[int], blocks: Sequence[int]) -> None:
        for h, b in zip(block_hashes(tokens, self.block_size), blocks):
            self.table.setdefault(h, b)

    def match(self, tokens: Sequence[int]) -> list[int]:
        table = self.table
        out = []
        for h in block_hashes(tokens, self.block_size):
            block = table.get(h)
            if block is None:
                break
            out.append(block)
        return out


def interleaved(measures: list[Callable[[], int]], reps: int) -> list[float]:
    """Median of each measurement (a callable returning ns), taken in turns so that a
    busy moment on a shared machine hits all of them alike."""
    times: list[list[int]] = [[] for _ in measures]
    for _ in range(reps):
        for out, measure in zip(times, measures):
            out.append(measure())
    return [statistics.median(t) for t in times]


def _timed(run: Callable[[], object]) -> int:
    start = time.perf_counter_ns()
    run()
    return time.perf_counter_ns() - start


def tokens_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(128_000) for _ in range(n)]


def bench_alloc_free(reps: int) -> None:
    print("1. alloc + free, ns per block (MemServe: ~800 ns/block; target <= 100 ns)")
    print(f"   {'batch':>6} {'BlockPool':>10} {'MemPool':>10}")
    for batch in (16, 64, 256, 1024):
        pool = BlockPool(4096)
        mem = MemPool(0, {Tier.DEVICE: 4096}, BLOCK_SIZE)
        raw, api = interleaved(
            [lambda: _timed(lambda: pool.free(pool.alloc(batch))), lambda: _timed(lambda: mem.free_mem(mem.alloc_mem(batch)))],
            reps,
        )
        print(f"   {batch:>6} {raw / batch:>10.1f} {api / batch:>10.1f}")


def bench_insert_match_4k(reps: int) -> None:
    n_tokens = 4096
    n_blocks = n_tokens // BLOCK_SIZE
    print(f"\n2. {n_tokens}-token prompt ({n_blocks} blocks) by cached ratio, us (MemServe insert <= 700 us; target <= 100 us)")
    print("   tokens as: a list (hashed here) | an array('I') (hashed here) | names known (no hashing)")
    print(f"   {'cached':>6} {'insert':>8} {'match':>8} | {'insert':>8} {'match':>8} | {'insert':>8} {'match':>8}")
    tokens = tokens_of(n_tokens, seed=1)
    packed = array("I", tokens)
    hashes = block_hashes(tokens, BLOCK_SIZE)
    for ratio in (0.0, 0.5, 1.0):
        pool = MemPool(0, {Tier.DEVICE: 4 * n_blocks}, BLOCK_SIZE)
        cached = int(n_blocks * ratio)

        def reset() -> None:
            """Only the first ``cached`` blocks of the prompt are cached."""
            pool.delete(tokens)
            if cached:
                pool.insert(tokens[: cached * BLOCK_SIZE], pool.alloc_mem(cached), KVFlags.RELEASE)

        def insert_ns(prompt: Sequence[int], names: list[int] | None) -> int:
            reset()
            hit = pool.match(tokens, hashes=hashes)  # a request reuses the cached part,
            addrs = hit + pool.alloc_mem(n_blocks - len(hit))  # computes the rest
            start = time.perf_counter_ns()
            pool.insert(prompt, addrs, hashes=names)
            elapsed = time.perf_counter_ns() - start
            pool.free_mem(addrs)
            reset()
            return elapsed

        def match_ns(prompt: Sequence[int], names: list[int] | None) -> int:
            start = time.perf_counter_ns()
            addrs = pool.match(prompt, hashes=names)
            elapsed = time.perf_counter_ns() - start
            pool.free_mem(addrs)
            return elapsed

        variants = ((tokens, None), (packed, None), (tokens, hashes))
        cols = interleaved([partial(fn, p, h) for p, h in variants for fn in (insert_ns, match_ns)], reps)
        print(f"   {ratio:>6.0%} " + " | ".join(f"{cols[i] / 1e3:>8.1f} {cols[i + 1] / 1e3:>8.1f}" for i in (0, 2, 4)))


def bench_match_vs_hash(reps: int) -> None:
    print("\n3. match latency vs prompt length, us: radix index vs vLLM-style hash table")
    print(f"   {'tokens':>6} | {'cached: radix':>13} {'hash':>8} {'ratio':>6} | {'uncached: radix':>15} {'hash':>8} {'ratio':>6}")
    for n_tokens in (512, 1024, 2048, 4096, 8192, 16384):
        tokens = tokens_of(n_tokens, seed=n_tokens)
        other = tokens_of(n_tokens, seed=n_tokens + 1)
        blocks = list(range(n_tokens // BLOCK_SIZE))
        radix = RadixIndex(BLOCK_SIZE)
        hashes = block_hashes(tokens, BLOCK_SIZE)
        radix.add_chain(None, hashes, blocks)
        table = HashPrefixCache(BLOCK_SIZE)
        table.insert(tokens, blocks)
        assert len(radix.match(tokens)) == len(table.match(tokens)) == len(blocks)
        row = interleaved([lambda p=p, m=m: _timed(lambda: m(p)) for p in (tokens, other) for m in (radix.match, table.match)], reps)
        r_hit, h_hit, r_miss, h_miss = (t / 1e3 for t in row)
        print(
            f"   {n_tokens:>6} | {r_hit:>13.1f} {h_hit:>8.1f} {h_hit / r_hit:>5.2f}x"
            f" | {r_miss:>15.1f} {h_miss:>8.1f} {h_miss / r_miss:>5.1f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=400, help="repetitions per measurement (median reported)")
    args = parser.parse_args()
    bench_alloc_free(args.reps * 5)
    bench_insert_match_4k(args.reps)
    bench_match_vs_hash(args.reps)


if __name__ == "__main__":
    main()
