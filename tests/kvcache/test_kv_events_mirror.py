"""KV events through msgpack keep the gateway's prompt-tree mirror equal to the worker's
index."""

from __future__ import annotations

import pytest
from helpers.mempool import (
    BS,
    Clock,
    cache,
    make_pool,
    prompt,
    random_workload,
    workload_prompts,
)

from memserve.ipc.messages import decode, encode
from memserve.kvcache.address import Tier, make_addr
from memserve.kvcache.events import REMOVED, STORED, KVEvent, KVEvents
from memserve.kvcache.hashing import block_hashes
from memserve.kvcache.mirror import PromptTreeMirror


def ship(pool, mirror: PromptTreeMirror) -> int:
    """Drain the pool's events, send them through the wire codec, apply them."""
    events = pool.drain_events()
    mirror.apply(decode(encode(KVEvents(pool.instance_id, events))))
    return len(events)


def test_events_round_trip_through_msgpack():
    batch = KVEvents(3, [KVEvent(STORED, [2**64 - 1, 5], None, [make_addr(3, Tier.HOST, 9), 1]), KVEvent(REMOVED, [5])])
    back = decode(encode(batch))
    assert back == batch
    assert back.events[0].tiers == [Tier.HOST, Tier.DEVICE] and back.events[0].instances == [3, 0]


def test_mirror_follows_a_random_workload_under_eviction_pressure():
    clock = Clock()
    pool = make_pool(device=24, host=12, disk=12, instance=2, clock=clock)
    mirror = PromptTreeMirror(2, BS)
    shipped = 0
    for step, _ in enumerate(random_workload(pool, clock, seed=11, steps=500)):
        if step % 37 == 0:
            shipped += ship(pool, mirror)
            assert mirror.entries() == pool.index.entries()
    shipped += ship(pool, mirror)
    assert mirror.entries() == pool.index.entries()
    assert len(mirror.entries()) > 10 and shipped > 100
    tiers = {tier for _, _, tier in mirror.entries()}
    assert tiers == {Tier.DEVICE, Tier.HOST, Tier.DISK}
    hits = []
    for tokens in workload_prompts(11):  # the router's question gets the worker's answer
        tokens = tokens + [1, 2, 3, 4, 5]
        hits.append(len(mirror.match(tokens)))
        assert mirror.match(tokens) == pool.match(tokens, take_ref=False)
        assert mirror.cached_tokens(tokens) == len(pool.match(tokens, take_ref=False)) * BS
        assert mirror.match_hashes(block_hashes(tokens, BS)) == mirror.match(tokens)
    assert max(hits) >= 3


def test_mirror_rejects_events_that_do_not_fit():
    pool = make_pool(instance=1)
    mirror = PromptTreeMirror(1, BS)
    cache(pool, prompt(1, 3))
    events = pool.drain_events()
    with pytest.raises(ValueError, match="instance 1 sent to the mirror of 4"):
        PromptTreeMirror(4, BS).apply(KVEvents(1, events))
    mirror.apply(KVEvents(1, events))
    with pytest.raises(ValueError, match="already indexed"):
        mirror.apply(KVEvents(1, events))  # the same chain stored twice
    root_hash = events[0].hashes[0]
    with pytest.raises(ValueError, match="does not fit"):
        mirror.apply_event(KVEvent(REMOVED, [root_hash]))  # still has children
    with pytest.raises(ValueError, match="not in the mirror"):
        mirror.apply_event(KVEvent(REMOVED, [12345]))
    mirror.reset()
    assert mirror.entries() == set()
