"""cache_salt in block names (kvcache/hashing.py): a salted prompt shares no block name
with the same tokens unsalted or under another salt, and the MemPool, the worker's
sequences and the receiving side of a transfer all name a salted prompt's blocks alike."""

from __future__ import annotations

import dataclasses

from helpers.mempool import make_pool

from memserve.ipc.kv_transfer import insert_received
from memserve.ipc.messages import AddRequest, SamplingParams, WorkerStats, decode, encode
from memserve.kvcache.hashing import ROOT_SEED, block_hashes, salt_seed
from memserve.workers.engine.sequence import Sequence

BS = 4
TOKENS = list(range(100, 100 + 6 * BS + 2))  # six full blocks and a partial one


def test_salted_names_differ_from_unsalted_at_every_block():
    plain = block_hashes(TOKENS, BS)
    salted = block_hashes(TOKENS, BS, salt="tenant-a")
    assert len(plain) == len(salted) == 6
    assert all(p != s for p, s in zip(plain, salted))
    assert not set(plain) & set(salted)


def test_other_salt_differs_same_salt_equal():
    a = block_hashes(TOKENS, BS, salt="a")
    assert block_hashes(TOKENS, BS, salt="a") == a
    b = block_hashes(TOKENS, BS, salt="b")
    assert not set(a) & set(b)


def test_no_salt_is_the_root_seed_and_parent_wins():
    assert salt_seed(None) == salt_seed("") == ROOT_SEED
    assert block_hashes(TOKENS, BS, salt=None) == block_hashes(TOKENS, BS)
    salted = block_hashes(TOKENS, BS, salt="a")
    # Named incrementally: the parent carries the salt.
    assert block_hashes(TOKENS[2 * BS:], BS, salted[1], salt="ignored") == salted[2:]


def test_sequence_names_its_blocks_with_its_salt():
    seq = Sequence("r", TOKENS, SamplingParams(cache_salt="a"), 0.0)
    assert seq.full_block_hashes(BS, 3) == block_hashes(TOKENS, BS, salt="a")[:3]
    assert seq.full_block_hashes(BS, 6) == block_hashes(TOKENS, BS, salt="a")
    unsalted = Sequence("r", TOKENS, SamplingParams(), 0.0)
    assert unsalted.full_block_hashes(BS, 6) == block_hashes(TOKENS, BS)


def test_sampling_params_carry_the_salt_over_the_wire():
    msg = AddRequest("r", TOKENS, SamplingParams(cache_salt="s"))
    assert decode(encode(msg)).params.cache_salt == "s"
    assert decode(encode(AddRequest("r", TOKENS, SamplingParams()))).params.cache_salt is None


def test_mempool_match_and_insert_with_a_salt():
    pool = make_pool(device=32)
    tokens = TOKENS[: 6 * BS]
    addrs = pool.alloc_mem(6)
    assert pool.insert(tokens, addrs, salt="a") == 6
    pool.free_mem(addrs)
    assert pool.match(tokens, take_ref=False) == []  # unsalted: nothing shared
    assert pool.match(tokens, take_ref=False, salt="b") == []
    assert pool.match(tokens, take_ref=False, salt="a") == addrs
    hashes = block_hashes(tokens, BS, salt="a")
    assert pool.match((), take_ref=False, hashes=hashes) == addrs
    assert pool.delete(tokens) == 0  # the unsalted path names other blocks: nothing of salt a goes
    assert pool.delete(tokens, hashes) == 6


def test_received_kv_is_indexed_under_the_senders_salt():
    pool = make_pool(device=32)
    tokens = TOKENS[: 4 * BS]
    head = pool.alloc_mem(2)
    pool.insert(tokens[: 2 * BS], head, salt="a")
    pool.free_mem(head)
    rest = pool.alloc_mem(2)
    assert insert_received(pool, tokens, 2, rest, "a") == 2  # incremental: hangs below the salted head
    pool.free_mem(rest)
    assert pool.match(tokens, take_ref=False, salt="a") == head + rest
    assert pool.match(tokens, take_ref=False) == []
    other = pool.alloc_mem(2)
    assert insert_received(pool, tokens, 2, other, "b") == 0  # salt b has no head here
    pool.free_mem(other)


def _salted_view(i: int, tokens: list[int], salt: str | None):
    from helpers.routing import BS as RBS

    from memserve.gateway.routing.router import WorkerView
    from memserve.kvcache.events import STORED, KVEvent
    from memserve.kvcache.mirror import PromptTreeMirror

    m = PromptTreeMirror(i, RBS)
    hashes = block_hashes(tokens, RBS, salt=salt)
    m.apply_event(KVEvent(STORED, hashes, None, [(i << 40) + k for k in range(len(hashes))]))
    return WorkerView(i, "ok", 0, WorkerStats(), m)


def test_router_and_decode_choice_see_a_salts_blocks_only():
    from helpers.routing import PROMPT

    from memserve.gateway.routing.decode_choice import pick_decode
    from memserve.gateway.routing.route_types import RouteRequest
    from memserve.gateway.routing.router import Router

    views = [_salted_view(0, [], None), _salted_view(1, PROMPT, "a")]
    router = Router.named("prompt-tree")

    def cached(salt: str | None) -> dict[int, int]:
        request = RouteRequest("r", PROMPT, cache_salt=salt)
        return {c.instance_id: c.cached_blocks for c in router.candidates(request, views)}

    assert cached("a") == {0: 0, 1: 16}
    assert cached("b") == {0: 0, 1: 0}
    assert cached(None) == {0: 0, 1: 0}
    assert router.route(RouteRequest("r1", PROMPT, cache_salt="a"), views).instance == 1
    decode = [dataclasses.replace(v, role="decode", in_flight=v.instance_id) for v in views]  # the holder is busier
    assert pick_decode(decode, prompt=PROMPT, cache_salt="a") == 1
    assert pick_decode(decode, prompt=PROMPT, cache_salt="b") == 0  # by load: nothing cached for b
