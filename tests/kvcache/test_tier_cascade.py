"""The tier cascade device -> host -> disk -> dropped on a pure MemPool over real files:
saves run on a background thread ahead of need, and an allocation that finds them behind
waits for them and demotes rather than dropping; a block being saved
stays readable where it is and is freed only once its copy is written; bytes come back
bit-exact; every block is accounted for after each test."""

from __future__ import annotations

import threading
import time

import pytest
from helpers.mempool import (
    Clock,
    assert_accounting,
    prompt,
    random_workload,
)
from helpers.tiers import (
    BLOCK_NBYTES,
    assert_no_leaks,
    cache_filled,
    settle,
    tiered_pool,
    tiers_of,
)

from memserve.kvcache.address import Tier, addr_tier
from memserve.kvcache.events import MOVED, REMOVED
from memserve.kvcache.mempool import OutOfBlocks


def test_round_trip_device_host_disk_device_is_bit_exact(tmp_path):
    pool, memory = tiered_pool(tmp_path)
    tokens = prompt(1, 4)
    want = cache_filled(pool, memory, tokens, seed=1)
    pool.kick_saves()  # watermark 100%: every idle block leaves the device...
    pool.flush_saves()
    assert tiers_of(pool, tokens) == [Tier.HOST] * 4
    settle(pool)  # ...and the host, for the disk
    assert tiers_of(pool, tokens) == [Tier.DISK] * 4
    files = sorted(p.name for p in pool.disk.dir.iterdir())
    assert files == sorted(f"{n.hash:016x}.kv" for n in pool.index.nodes())
    hit = pool.match(tokens)
    back = pool.swap_in(hit)
    pool.free_mem(hit)
    assert memory.get(back) == want
    assert tiers_of(pool, tokens) == [Tier.DEVICE] * 4
    pool.free_mem(back)
    io = pool.stats()["tier_io"]
    assert io["disk"]["write_bytes"] == io["disk"]["read_bytes"] == 4 * BLOCK_NBYTES
    assert io["disk"]["hits"] == 4
    assert_no_leaks(pool)
    pool.close()


def test_alloc_mem_waits_for_a_save_in_flight_and_demotes_rather_than_drops(tmp_path):
    pool, memory = tiered_pool(tmp_path, device=8, host=8, watermark=0.5, slow=Tier.DEVICE)
    first, second = prompt(1, 4), prompt(2, 4)
    want_first = cache_filled(pool, memory, first, seed=1)
    want_second = cache_filled(pool, memory, second, seed=2)
    pool.drain_events()
    pool.kick_saves()  # starts saving the 4 LRU blocks (the first prompt); the copy hangs
    assert pool.stats()["tier_io"]["device"]["saving"] == 4
    assert tiers_of(pool, first) == [Tier.DEVICE] * 4  # still readable where it is
    threading.Timer(0.3, pool.slow.release.set).start()
    started = time.perf_counter()
    got = pool.alloc_mem(4)  # waits for the save in flight: its blocks come free, nothing is dropped
    assert time.perf_counter() - started >= 0.25
    assert tiers_of(pool, first) == [Tier.HOST] * 4
    assert tiers_of(pool, second) == [Tier.DEVICE] * 4
    more = pool.alloc_mem(4)  # no save in flight: the idle second prompt is demoted on demand
    assert tiers_of(pool, second) == [Tier.HOST] * 4
    with pytest.raises(OutOfBlocks):
        pool.alloc_mem(1)  # every device block is held
    assert [e.type for e in pool.drain_events()] == [MOVED, MOVED]
    assert pool.stats()["tier_io"]["device"]["dropped_unsaved"] == 0
    for tokens, want in ((first, want_first), (second, want_second)):
        hit = pool.match(tokens)
        assert memory.get(hit) == want
        pool.free_mem(hit)
    pool.free_mem(got + more)
    assert_no_leaks(pool)
    pool.close()


def test_blocks_are_dropped_unsaved_only_when_the_slower_tier_is_full_of_blocks_in_use(tmp_path):
    pool, memory = tiered_pool(tmp_path, device=4, host=4, watermark=0.0)
    held = pool.alloc_mem(4, Tier.HOST)  # the host tier is all in use
    tokens = prompt(3, 4)
    cache_filled(pool, memory, tokens, seed=3)
    got = pool.alloc_mem(4)
    assert tiers_of(pool, tokens) == []
    assert pool.stats()["tier_io"]["device"]["dropped_unsaved"] == 4
    pool.free_mem(got + held)
    assert_no_leaks(pool)
    pool.close()


def test_a_block_used_while_saving_stays_where_it_is(tmp_path):
    pool, memory = tiered_pool(tmp_path, slow=Tier.DEVICE)
    tokens = prompt(3, 4)
    want = cache_filled(pool, memory, tokens, seed=3)
    pool.kick_saves()
    hit = pool.match(tokens)  # a request reads the blocks being saved
    assert [addr_tier(a) for a in hit] == [Tier.DEVICE] * 4 and memory.get(hit) == want
    pool.slow.release.set()
    pool.flush_saves()
    assert tiers_of(pool, tokens) == [Tier.DEVICE] * 4  # hot: the copies are given back
    assert pool.stats()["host"]["free"] == 4
    pool.free_mem(hit)
    assert_no_leaks(pool)
    pool.close()


def test_a_block_swapped_in_while_saving_down_is_freed_once(tmp_path):
    pool, memory = tiered_pool(tmp_path, slow=Tier.HOST)
    tokens = prompt(4, 4)
    want = cache_filled(pool, memory, tokens, seed=4)
    pool.kick_saves()
    pool.flush_saves()  # device -> host done; host -> disk now starts and hangs
    pool.kick_saves()
    assert tiers_of(pool, tokens) == [Tier.HOST] * 4
    hit = pool.match(tokens)
    back = pool.prepare_swap_in(hit)
    for tier, src, dst in pool.swap_in_copies(hit, back):
        memory.copy_blocks(tier, src, Tier.DEVICE, dst)
    assert pool.commit_swap_in(hit, back) == 4
    pool.free_mem(hit)
    pool.slow.release.set()
    pool.flush_saves()
    assert memory.get(back) == want and tiers_of(pool, tokens) == [Tier.DEVICE] * 4
    pool.free_mem(back)
    assert_no_leaks(pool)
    assert pool.stats()["host"]["free"] == 4 and pool.stats()["disk"]["free"] == pool.disk.num_blocks
    pool.close()


def test_full_disk_drops_its_least_recently_used_chains(tmp_path):
    pool, memory = tiered_pool(tmp_path, device=4, host=4, disk_blocks=4)
    prompts = [prompt(10 + i, 2) for i in range(6)]
    for i, tokens in enumerate(prompts):
        cache_filled(pool, memory, tokens, seed=i)
        settle(pool)
    assert len(list(pool.disk.dir.iterdir())) <= pool.disk.num_blocks  # the budget holds
    assert tiers_of(pool, prompts[0]) == []  # the oldest were dropped at the end of the cascade
    assert tiers_of(pool, prompts[-1]) in ([Tier.HOST] * 2, [Tier.DISK] * 2)
    assert_no_leaks(pool)
    pool.close()


def test_per_tier_figures_reach_the_metrics(tmp_path):
    from memserve.gateway.metrics import EngineStatsCollector

    pool, memory = tiered_pool(tmp_path)
    tokens = prompt(6, 2)
    cache_filled(pool, memory, tokens, seed=6)
    settle(pool)
    stats = pool.stats()
    worker = {"instance_id": 0, "kv_tiers": stats["tier_io"], "kv_save_queue": stats["save_queue"]}
    samples = {(s.name, s.labels.get("tier")): s.value
               for family in EngineStatsCollector(lambda: {"workers": [worker]}).collect() for s in family.samples}
    assert samples[("memserve_kv_tier_bytes_used", "disk")] == 2 * BLOCK_NBYTES
    assert samples[("memserve_kv_tier_write_bytes_total", "disk")] == 2 * BLOCK_NBYTES
    assert samples[("memserve_kv_tier_read_bytes_total", "device")] == 2 * BLOCK_NBYTES
    assert samples[("memserve_kv_tier_saving_blocks", "host")] == 0
    assert samples[("memserve_kv_save_queue", None)] == 0
    pool.close()


def test_random_workload_with_saves_in_flight_keeps_every_block_accounted_for(tmp_path):
    """Requests, swaps and deletes while the background saver moves blocks down: after
    each flush every block is indexed or held, and no child sits above its parent."""
    clock = Clock()
    pool, _ = tiered_pool(tmp_path, device=24, host=12, disk_blocks=12, watermark=0.25)
    pool.index._clock = clock  # the workload's clock drives LRU
    for step, running in enumerate(random_workload(pool, clock, seed=5, steps=300)):
        pool.kick_saves()
        if step % 3 == 0:
            pool.flush_saves()
            assert_accounting(pool, running)
    assert_no_leaks(pool)
    io = pool.stats()["tier_io"]
    assert io["host"]["write_bytes"] > 0 and io["disk"]["write_bytes"] > 0
    pool.close()
