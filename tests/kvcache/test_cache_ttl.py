"""Retention (``--cache-ttl``, ``kvcache/retention.py``) on an injected clock: a cached
conversation unused for the TTL leaves every tier (REMOVED events for the gateway's
mirror, disk files deleted), a request's ``cache_ttl_s`` keeps its own conversation
longer, blocks in use never expire; the body field is validated by the gateway."""

from __future__ import annotations

import pytest
from helpers.mempool import BS, Clock, prompt
from helpers.scripted_engine import ScriptedRunner, add, run_to_end
from helpers.tiers import cache_filled, settle, tiered_pool, tiers_of

from memserve.config import EngineConfig
from memserve.gateway.errors import APIError
from memserve.gateway.protocol import parse_chat_request
from memserve.ipc.messages import AddRequest, SamplingParams
from memserve.kvcache.address import Tier
from memserve.kvcache.events import REMOVED, KVEvents
from memserve.kvcache.mirror import PromptTreeMirror
from memserve.kvcache.retention import Retention
from memserve.workers.engine.engine import Engine

TTL = 16.0


def ttl_engine(clock: Clock) -> Engine:
    cfg = EngineConfig(block_size=BS, num_blocks=32, max_num_batched_tokens=64, cache_ttl_s=TTL)
    return Engine(cfg, ScriptedRunner(32), {999}, clock=clock)


def cached_tokens(engine: Engine, tokens: list[int]) -> int:
    return len(engine.mempool.match(tokens, take_ref=False)) * BS


def test_a_conversation_expires_ttl_after_its_last_use():
    clock = Clock()
    engine = ttl_engine(clock)
    mirror = PromptTreeMirror(0, BS)
    tokens = prompt(1, 3)
    add(engine, "a", tokens)
    run_to_end(engine)
    mirror.apply(KVEvents(0, engine.drain_kv_events()))
    assert cached_tokens(engine, tokens) == 12 and mirror.cached_tokens(tokens) == 12
    clock.now = TTL - 1
    assert engine.sweep_expired() == 0  # not yet
    add(engine, "b", tokens + [1, 2, 3, 4])  # used again at TTL - 1: the clock restarts
    run_to_end(engine)
    clock.now = 2 * TTL - 2
    assert engine.sweep_expired() == 0
    clock.now = 2 * TTL + 1
    dropped = engine.sweep_expired()
    assert dropped == 4 and cached_tokens(engine, tokens) == 0  # its 3 blocks and the next turn's one
    events = engine.drain_kv_events()
    assert [e.type for e in events][-1] == REMOVED
    mirror.apply(KVEvents(0, events))
    assert mirror.cached_tokens(tokens) == 0 and len(mirror.index) == 0  # the gateway knows
    s = engine.mempool.stats()["device"]
    assert s["free"] == s["total"]


def test_a_request_can_keep_its_conversation_longer():
    clock = Clock()
    engine = ttl_engine(clock)
    short, kept = prompt(2, 2), prompt(3, 2)
    add(engine, "short", short)
    params = SamplingParams(max_tokens=3, temperature=0.0, cache_ttl_s=10 * TTL)
    assert engine.add_request(AddRequest("kept", kept, params)) is None
    run_to_end(engine)
    clock.now = TTL + 1
    engine.sweep_expired()
    assert cached_tokens(engine, short) == 0 and cached_tokens(engine, kept) == 8
    clock.now = 10 * TTL + 1
    engine.sweep_expired()
    assert cached_tokens(engine, kept) == 0


def test_blocks_in_use_never_expire():
    clock = Clock()
    engine = ttl_engine(clock)
    tokens = prompt(4, 3)
    add(engine, "long", tokens, max_tokens=50)
    engine.step()
    clock.now = 3 * TTL
    assert engine.sweep_expired() == 0  # the running request holds them
    run_to_end(engine)
    assert cached_tokens(engine, tokens) == 12
    clock.now = 5 * TTL
    assert engine.sweep_expired() > 0 and cached_tokens(engine, tokens) == 0


def test_expired_blocks_leave_the_host_and_the_disk_with_their_files(tmp_path):
    clock = Clock()
    pool, memory = tiered_pool(tmp_path, device=4, host=4, disk_blocks=8)
    pool.index._clock = clock
    retention = Retention(pool, TTL, clock)
    old, new = prompt(5, 4), prompt(6, 4)
    cache_filled(pool, memory, old, seed=5)
    settle(pool)  # the watermark pushes it all the way to disk
    clock.now = TTL / 2
    cache_filled(pool, memory, new, seed=6)
    settle(pool)
    assert set(tiers_of(pool, old)) == {Tier.DISK}
    assert len(list(pool.disk.dir.glob("*.kv"))) == 8
    clock.now = TTL + 1
    assert retention.sweep() == 4
    assert tiers_of(pool, old) == [] and len(tiers_of(pool, new)) == 4
    assert len(list(pool.disk.dir.glob("*.kv"))) == 4  # the expired blocks' files are gone
    clock.now = TTL * 2
    assert retention.sweep() == 4 and len(pool.index) == 0
    assert list(pool.disk.dir.glob("*.kv")) == []
    pool.close()


def test_sweeps_run_every_sixteenth_of_the_ttl():
    clock = Clock()
    engine = ttl_engine(clock)
    add(engine, "a", prompt(7, 2))
    run_to_end(engine)
    clock.now = TTL - 0.5
    assert engine.sweep_expired() == 0  # due: nothing expired yet
    clock.now = TTL + 0.1
    assert engine.sweep_expired() == 0  # expired now, but the next sweep is due at TTL - 0.5 + TTL / 16
    clock.now = TTL - 0.5 + TTL / 16
    assert engine.sweep_expired() == 2


@pytest.mark.parametrize("value", [-1, "1h", 1e12])
def test_the_gateway_rejects_a_bad_cache_ttl(value):
    with pytest.raises(APIError) as err:
        parse_chat_request({"messages": [{"role": "user", "content": "hi"}], "cache_ttl_s": value})
    assert err.value.status == 400 and "cache_ttl_s" in str(err.value)


def test_the_gateway_passes_cache_ttl_to_the_worker():
    req = parse_chat_request({"messages": [{"role": "user", "content": "hi"}], "cache_ttl_s": 3600})
    assert req.sampling_params(8, []).cache_ttl_s == 3600
    plain = parse_chat_request({"messages": [{"role": "user", "content": "hi"}]})
    assert plain.sampling_params(8, []).cache_ttl_s is None
