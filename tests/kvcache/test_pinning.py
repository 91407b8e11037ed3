"""Per-request retention (``cache_control``, ``kvcache/pinning.py``) on an injected clock:
a pinned conversation survives pressure that evicts its unpinned twin, goes down a tier
instead of being dropped, loses its pin when the TTL runs out, and a pin past
``--max-pinned-fraction`` or one key's ``--max-pinned-fraction-per-key`` is refused whole,
the cap named, while the request is served unpinned."""

from __future__ import annotations

from helpers.mempool import BS, Clock, cache, make_pool, prompt
from helpers.scripted_engine import ScriptedRunner, run_to_end
from helpers.tiers import settle, tiered_pool, tiers_of

from memserve.config import EngineConfig
from memserve.ipc.messages import AddRequest, SamplingParams
from memserve.kvcache.address import Tier
from memserve.kvcache.hashing import block_hashes
from memserve.workers.engine.engine import Engine

TTL = 300.0


def names(tokens: list[int]) -> list[int]:
    return block_hashes(tokens, BS)


def cached_blocks(pool, tokens: list[int]) -> int:
    return len(pool.match(tokens, take_ref=False))


def test_a_pinned_conversation_survives_pressure_that_evicts_its_unpinned_twin():
    for pin in (False, True):
        clock = Clock()
        pool = make_pool(device=16, clock=clock, max_pinned_fraction=0.25)
        kept, twin = prompt(1, 3), prompt(2, 3)
        cache(pool, kept)  # least recently used: plain LRU gives it up first
        clock.now = 1.0
        cache(pool, twin)
        if pin:
            assert pool.pins is not None and pool.pins.pin(names(kept), TTL) is None
        clock.now = 2.0
        held = pool.alloc_mem(13)  # 10 free blocks: three cached ones must go
        assert cached_blocks(pool, kept) == (3 if pin else 0)
        assert cached_blocks(pool, twin) == (0 if pin else 3)
        pool.free_mem(held)


def test_pinned_blocks_go_last_and_only_when_nothing_else_is_left():
    clock = Clock()
    pool = make_pool(device=8, clock=clock, max_pinned_fraction=0.5)
    kept = prompt(3, 4)
    cache(pool, kept)
    assert pool.pins is not None and pool.pins.pin(names(kept), TTL) is None
    held = pool.alloc_mem(6)  # a running request needs more than the unpinned room: pins never block it
    assert cached_blocks(pool, kept) == 2  # the conversation's tail went, its prefix stays
    pool.free_mem(held)
    assert pool.stats()["device"]["pinned"] == 2


def test_pinned_blocks_are_demoted_to_the_host_before_they_are_dropped(tmp_path):
    pool, _ = tiered_pool(tmp_path, device=4, host=4, disk_blocks=8, watermark=0.0, max_pinned_fraction=1.0)
    assert pool.pins is not None
    kept = prompt(4, 2)
    cache(pool, kept)
    settle(pool)
    assert pool.pins.pin(names(kept), TTL) is None
    held = pool.alloc_mem(4)  # the whole device: the asynchronous saver demotes the pinned blocks
    assert tiers_of(pool, kept) == [Tier.HOST, Tier.HOST]
    assert pool.stats()["host"]["pinned"] == 2
    pool.free_mem(held)
    pool.close()


def test_the_pin_expires_with_its_ttl_on_the_injected_clock():
    clock = Clock()
    pool = make_pool(device=16, clock=clock, max_pinned_fraction=0.25)
    kept, twin = prompt(5, 3), prompt(6, 3)
    cache(pool, kept)
    clock.now = 1.0
    cache(pool, twin)
    assert pool.pins is not None and pool.pins.pin(names(kept), TTL) is None
    clock.now = TTL - 1
    assert pool.pins.sweep() == 0 and len(pool.pins) == 3
    clock.now = TTL + 1
    assert pool.pins.sweep() == 3 and len(pool.pins) == 0
    held = pool.alloc_mem(13)  # unpinned again: LRU order, the older conversation goes
    assert cached_blocks(pool, kept) == 0 and cached_blocks(pool, twin) == 3
    pool.free_mem(held)


def test_a_renewed_pin_costs_nothing_and_a_pin_past_the_cap_is_refused_whole():
    pool = make_pool(device=16, clock=Clock(), max_pinned_fraction=0.25)  # a cap of 4 blocks
    pins = pool.pins
    assert pins is not None and pins.cap == 4
    first, second = prompt(7, 3), prompt(8, 2)
    assert pins.pin(names(first), TTL) is None
    assert pins.pin(names(first), TTL) is None  # renewing: the same 3 blocks
    refusal = pins.pin(names(second), TTL)  # 3 + 2 > 4
    assert refusal is not None and "cap of 4" in refusal and "--max-pinned-fraction 0.25" in refusal
    assert len(pins) == 3 and all(h not in pins for h in names(second))


def test_one_key_cannot_take_every_other_keys_share_of_pins():
    clock = Clock()
    pool = make_pool(device=16, clock=clock, max_pinned_fraction=0.5, max_pinned_fraction_per_key=0.25)
    pins = pool.pins
    assert pins is not None and (pins.cap, pins.key_cap) == (8, 4)
    mine, more, theirs = prompt(11, 3), prompt(12, 2), prompt(13, 4)
    assert pins.pin(names(mine), TTL, owner="key-a") is None
    refusal = pins.pin(names(more), TTL, owner="key-a")  # 3 + 2 > key-a's 4
    assert refusal is not None and "--max-pinned-fraction-per-key 0.25" in refusal and "cap of 4" in refusal
    assert pins.pin(names(theirs), TTL, owner="key-b") is None  # key-b's share is its own
    assert pins.pin(names(mine), TTL, owner="key-b") is not None  # another key's pin counts against key-b too
    assert (pins.owned("key-a"), pins.owned("key-b"), len(pins)) == (3, 4, 7)
    clock.now = TTL + 1
    assert pins.sweep() == 7 and pins.owned("key-a") == pins.owned("key-b") == 0
    assert pins.pin(names(more), TTL, owner="key-a") is None


def test_the_engine_serves_a_request_whose_pin_passes_the_cap_unpinned_and_says_why():
    clock = Clock()
    cfg = EngineConfig(block_size=BS, num_blocks=32, max_num_batched_tokens=64, max_pinned_fraction=0.25)
    engine = Engine(cfg, ScriptedRunner(32), {999}, clock=clock)  # a cap of 8 blocks
    small = SamplingParams(max_tokens=2, temperature=0.0, pin_tokens=6 * BS, pin_ttl_s=TTL)
    assert engine.add_request(AddRequest("a", prompt(9, 6), small)) is None
    run_to_end(engine)
    big = SamplingParams(max_tokens=2, temperature=0.0, pin_tokens=3 * BS, pin_ttl_s=TTL)
    assert engine.add_request(AddRequest("b", prompt(10, 4), big)) is None  # queued all the same
    outs = run_to_end(engine)
    assert outs and all(o.error is None for o in outs) and sum(len(o.new_token_ids) for o in outs) == 2
    refusal = outs[0].pin_refused
    assert refusal is not None and "--max-pinned-fraction 0.25" in refusal and "cap of 8" in refusal
    stats = engine.stats()["mempool"]["device"]
    assert stats["pinned"] == 6 and stats["used"] == 0  # nothing of b's was pinned, and it holds nothing
    clock.now = TTL + 1
    assert engine.add_request(AddRequest("c", prompt(10, 4), big)) is None  # the first pin expired
    outs = run_to_end(engine)
    assert all(o.pin_refused is None for o in outs)
    assert engine.stats()["mempool"]["device"]["pinned"] == 3
