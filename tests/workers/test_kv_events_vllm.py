"""KV events in vLLM's published format (``--kv-events-config``).

The payloads are decoded with msgspec structs that mirror vLLM 0.33's own
(``vllm/distributed/kv_events.py``: field names, order, defaults and struct options), not
with memserve code, and each payload must equal, byte for byte, what vLLM's encoder
writes for the decoded batch. A subscriber built on them follows a real ``memserve up``'s
worker: it rebuilds the worker's block set per medium and finds the counts the worker
itself reports per tier (/health ``cached_blocks``). It then drops off, misses a run of
batches, and recovers them from the replay socket: sequence numbers stay contiguous and
the state again equals the worker's. The unit tests pin the translation of memserve's
events (stored, moved, removed), the media of the host and disk tiers, and the endpoint
rule for several workers.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
import time
import urllib.request
from array import array
from typing import Any

import msgpack
import msgspec
import pytest
import xxhash
import zmq
from helpers.paths import REPO

from memserve.bench.server_process import start_server, stop_server
from memserve.kvcache.address import Tier, make_addrs
from memserve.kvcache.events import MOVED, REMOVED, STORED, KVEvent
from memserve.kvcache.hashing import adapter_salt
from memserve.kvcache.mempool import MemPool
from memserve.workers.kv_event_publisher import (
    ALL_BLOCKS_CLEARED,
    END_SEQ,
    KVEventPublisher,
    KVEventsConfig,
    VllmEventTranslator,
    instance_endpoint,
)

BLOCK_SIZE = 16
ROOT_SEED = 0x6D656D7365727665  # documented in docs/observability.md
MEDIA = ("GPU", "CPU", "STORAGE")  # vLLM's MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE
TIER_OF_MEDIUM = {"GPU": "device", "CPU": "host", "STORAGE": "disk"}


# ------------------------------------------------- vLLM 0.33's event classes, as declared


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(KVEventBatch)
ENCODER = msgspec.msgpack.Encoder()


def _value(payload: bytes) -> Any:
    """A msgpack value with its maps as ordered pairs (the header widths, which msgspec
    picks from a struct's field count, are no part of it)."""
    return msgpack.unpackb(payload, object_pairs_hook=list)


def decode(payload: bytes, rank: int = 0) -> KVEventBatch:
    """A published payload as vLLM's classes read it; it must also be the msgpack value that
    vLLM's encoder writes for what was read (no field added, left out or reordered)."""
    batch = DECODER.decode(payload)
    assert _value(payload) == _value(ENCODER.encode(batch))
    assert batch.data_parallel_rank == rank
    return batch


def stored(hashes: list[int], parent: int | None, tokens: list[int], medium: str) -> BlockStored:
    return BlockStored(hashes, parent, tokens, BLOCK_SIZE, None, medium, None)


def translated(events: list[dict]) -> list[KVCacheEvent]:
    """The translator's output as vLLM's classes read it, once published."""
    return decode(msgpack.packb([0.0, events, 0])).events


# ------------------------------------------------------------ a subscriber on vLLM's classes


def block_names(tokens: list[int], parent: int | None) -> list[int]:
    """memserve's block names as an outside router computes them (unsalted prompts)."""
    h = ROOT_SEED if parent is None else parent
    out = []
    for i in range(0, len(tokens), BLOCK_SIZE):
        h = xxhash.xxh3_64_intdigest(array("I", tokens[i:i + BLOCK_SIZE]).tobytes(), h)
        out.append(h)
    return out


class Subscriber:
    def __init__(self, ctx: zmq.Context, endpoint: str, replay_endpoint: str, topic: bytes, next_seq: int = 0,
                 state: dict[str, set[int]] | None = None) -> None:
        self.ctx, self.replay_endpoint, self.topic = ctx, replay_endpoint, topic
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.next_seq = next_seq
        self.blocks = state if state is not None else {m: set() for m in MEDIA}
        self.seen: list[int] = []
        self.replayed = 0
        self.kinds: dict[tuple[str, str | None], int] = {}
        self.hashes_checked = 0

    def close(self) -> None:
        self.sub.close(0)

    def apply(self, seq: int, payload: bytes) -> None:
        if seq < self.next_seq:
            return  # already applied (live and replay overlap)
        assert seq == self.next_seq, f"gap: {self.next_seq} .. {seq}"
        for ev in decode(payload).events:
            tag = type(ev).__name__
            if isinstance(ev, BlockStored):
                assert ev.block_size == BLOCK_SIZE and ev.lora_id is None and ev.lora_name is None
                assert ev.medium in MEDIA
                for h in ev.block_hashes:
                    assert not any(h in s for s in self.blocks.values()), "stored twice"
                    self.blocks[ev.medium].add(h)
                if ev.token_ids:
                    assert len(ev.token_ids) == len(ev.block_hashes) * BLOCK_SIZE
                    assert block_names(ev.token_ids, ev.parent_block_hash) == ev.block_hashes
                    self.hashes_checked += len(ev.block_hashes)
                self.kinds[(tag, ev.medium)] = self.kinds.get((tag, ev.medium), 0) + 1
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    assert h in self.blocks[ev.medium], f"removed from {ev.medium} but not there"
                    self.blocks[ev.medium].discard(h)
                self.kinds[(tag, ev.medium)] = self.kinds.get((tag, ev.medium), 0) + 1
            else:
                for s in self.blocks.values():
                    s.clear()
        self.seen.append(seq)
        self.next_seq = seq + 1

    def replay(self, start: int) -> None:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                assert dealer.poll(5000), "replay did not answer"
                empty, topic, seq_bytes, payload = dealer.recv_multipart()
                assert empty == b""
                if seq_bytes == END_SEQ:
                    assert topic == b"" and payload == b""
                    return
                assert topic == self.topic
                self.replayed += 1
                self.apply(int.from_bytes(seq_bytes, "big"), payload)
        finally:
            dealer.close(0)

    def pump(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if not self.sub.poll(int(left * 1000) + 1):
                continue
            topic, seq_bytes, payload = self.sub.recv_multipart()
            assert topic == self.topic
            seq = int.from_bytes(seq_bytes, "big")
            if seq > self.next_seq:
                self.replay(self.next_seq)  # fills the gap, and usually this one
            self.apply(seq, payload)

    def counts(self) -> dict[str, int]:
        return {TIER_OF_MEDIUM[m]: len(s) for m, s in self.blocks.items() if s or m != "STORAGE"}


# ------------------------------------------------------------------------ the live test


def _health(base_url: str) -> dict:
    with urllib.request.urlopen(base_url + "/health", timeout=10) as r:
        return json.loads(r.read())


def _complete(base_url: str, prompt: str) -> None:
    body = json.dumps({"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 2,
                       "temperature": 0}).encode()
    req = urllib.request.Request(base_url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200


def _prompts(rng: random.Random, n: int) -> list[str]:
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "maple", "orbit", "violet", "copper", "lantern", "harbor", "meadow"]
    return [" ".join(rng.choice(words) for _ in range(90)) for _ in range(n)]


def _agree(sub: Subscriber, base_url: str, timeout_s: float = 20.0) -> dict:
    """Pump events until the subscriber's counts per medium equal the worker's per tier."""
    deadline = time.monotonic() + timeout_s
    worker: dict = {}
    while time.monotonic() < deadline:
        sub.pump(0.3)
        worker = _health(base_url)["workers"][0]
        want = {t: n for t, n in worker["cached_blocks"].items()}
        have = {t: len(sub.blocks[m]) for m, t in TIER_OF_MEDIUM.items() if t in want}
        if have == want and sum(have.values()) == worker["mirror_blocks"]:
            return want
    raise AssertionError(f"subscriber {sub.counts()} != worker {worker.get('cached_blocks')} "
                         f"(mirror {worker.get('mirror_blocks')})")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    sock_dir = tempfile.mkdtemp(prefix="kvev")  # short: ipc paths are limited to ~100 bytes
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{sock_dir}/pub-{{instance}}",
              "replay_endpoint": f"ipc://{sock_dir}/replay-{{instance}}", "buffer_steps": 10000,
              "topic": "kv-events"}
    handle = start_server(["--cpu-workers", "1", "--num-blocks", "24", "--num-host-blocks", "16",
                           "--block-size", str(BLOCK_SIZE), "--max-num-seqs", "4",
                           "--kv-events-config", json.dumps(config)],
                          tmp_path_factory.mktemp("kv-events") / "memserve.log", cwd=REPO)
    yield handle, f"ipc://{sock_dir}/pub-0", f"ipc://{sock_dir}/replay-0"
    stop_server(handle)
    shutil.rmtree(sock_dir, ignore_errors=True)


def test_subscriber_follows_the_worker_and_replays_the_gap(server):
    handle, endpoint, replay_endpoint = server
    ctx = zmq.Context()
    rng = random.Random(7)
    try:
        sub = Subscriber(ctx, endpoint, replay_endpoint, b"kv-events")
        time.sleep(0.3)  # the SUB's subscription reaches the PUB
        sub.replay(0)  # what was published before we connected, from AllBlocksCleared on
        assert sub.seen and sub.seen[0] == 0
        for prompt in _prompts(rng, 6):
            _complete(handle.base_url, prompt)
            sub.pump(0.05)
        counts = _agree(sub, handle.base_url)
        assert counts["host"] > 0, counts
        # Tiers moved: blocks entered the GPU medium, were demoted to the CPU one (removed
        # from GPU, stored in CPU), and the full host tier dropped some.
        for kind in (("BlockStored", "GPU"), ("BlockRemoved", "GPU"), ("BlockStored", "CPU"),
                     ("BlockRemoved", "CPU")):
            assert sub.kinds.get(kind), (kind, sub.kinds)
        assert sub.hashes_checked > 0  # names recomputed from token_ids
        last = sub.next_seq - 1
        state = sub.blocks
        sub.close()

        for prompt in _prompts(rng, 4):  # nobody listens
            _complete(handle.base_url, prompt)
        time.sleep(1.0)
        back = Subscriber(ctx, endpoint, replay_endpoint, b"kv-events", next_seq=last + 1, state=state)
        time.sleep(0.3)
        back.replay(last + 1)
        assert back.replayed > 0 and back.seen[0] == last + 1
        assert back.seen == list(range(last + 1, last + 1 + len(back.seen)))  # contiguous
        _agree(back, handle.base_url)
        back.close()
    finally:
        ctx.destroy(linger=0)


# --------------------------------------------------------------------------- unit tests


def _addrs(tier: Tier, blocks: list[int]) -> list[int]:
    return make_addrs(0, tier, blocks)


def test_an_adapters_blocks_carry_its_lora_name():
    """A prompt run through a LoRA adapter: its blocks are stored under the adapter's name
    (vLLM's ``lora_name``), also those indexed later below them; the base model's carry none."""
    pool = MemPool(0, {Tier.DEVICE: 16}, BLOCK_SIZE)
    t = VllmEventTranslator(BLOCK_SIZE)
    pool.event_tokens, pool.event_adapters = t.event_tokens, t.event_adapters
    tokens = list(range(3 * BLOCK_SIZE))
    salt = adapter_salt(None, "support", "0123")
    addrs = pool.alloc_mem(3)
    pool.insert(tokens[:2 * BLOCK_SIZE], addrs[:2], salt=salt)
    pool.insert(tokens, addrs, salt=salt)  # one more block below the first two
    base = pool.alloc_mem(1)
    pool.insert(tokens[:BLOCK_SIZE], base)
    events = [e for e in translated(t.translate(pool.drain_events())) if isinstance(e, BlockStored)]
    assert [(len(e.block_hashes), e.lora_name) for e in events] == [(2, "support"), (1, "support"), (1, None)]


def test_translation_of_store_move_remove():
    tokens = list(range(3 * BLOCK_SIZE))
    hashes = block_names(tokens, None)
    event_tokens = {h: tokens[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE] for i, h in enumerate(hashes)}
    t = VllmEventTranslator(BLOCK_SIZE, event_tokens)
    out = t.translate([KVEvent(STORED, hashes, None, _addrs(Tier.DEVICE, [0, 1, 2]))])
    assert translated(out) == [stored(hashes, None, tokens, "GPU")]
    assert not event_tokens  # taken
    # the two deepest blocks are demoted to the host tier
    out = t.translate([KVEvent(MOVED, hashes[1:], None, _addrs(Tier.HOST, [5, 6]))])
    assert translated(out) == [BlockRemoved(hashes[1:], "GPU"),
                               stored(hashes[1:], hashes[0], tokens[BLOCK_SIZE:], "CPU")]
    out = t.translate([KVEvent(REMOVED, hashes[::-1])])
    assert translated(out) == [BlockRemoved(hashes[:0:-1], "CPU"), BlockRemoved([hashes[0]], "GPU")]
    assert not t.blocks
    # blocks adopted from disk come without tokens
    out = t.translate([KVEvent(STORED, [11, 12], None, _addrs(Tier.DISK, [0, 1]))])
    assert translated(out) == [stored([11, 12], None, [], "STORAGE")]


def test_instance_endpoints():
    assert instance_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert instance_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert instance_endpoint("ipc:///run/kv-{instance}", 3) == "ipc:///run/kv-3"
    assert instance_endpoint("ipc:///run/kv", 0) == "ipc:///run/kv"
    with pytest.raises(ValueError):
        instance_endpoint("ipc:///run/kv", 1)
    with pytest.raises(ValueError):
        KVEventsConfig.from_dict({"enable_kv_cache_events": True, "endpont": "tcp://*:1"})


def test_publisher_replays_from_a_sequence_number():
    sock_dir = tempfile.mkdtemp(prefix="kvpub")
    cfg = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"ipc://{sock_dir}/p",
                         replay_endpoint=f"ipc://{sock_dir}/r", buffer_steps=3, topic="t")
    pub = KVEventPublisher(cfg, BLOCK_SIZE)  # seq 0: AllBlocksCleared
    ctx = zmq.Context()
    try:
        for i in range(4):  # seqs 1..4; the buffer keeps 2..4
            pub.publish([KVEvent(STORED, [100 + i], None, _addrs(Tier.DEVICE, [i]))])
        sub = Subscriber(ctx, cfg.endpoint, cfg.replay_endpoint, b"t", next_seq=2)
        sub.replay(0)
        assert sub.seen == [2, 3, 4]
        assert sub.blocks["GPU"] == {101, 102, 103}
        sub.close()
    finally:
        pub.close()
        ctx.destroy(linger=0)
        shutil.rmtree(sock_dir, ignore_errors=True)


def test_published_batches_decode_with_vllms_classes_per_tier():
    """The PUB socket's real bytes, read by vLLM's classes: a chain enters the device tier,
    is demoted to host, then to disk, and leaves; each tier's events carry its medium."""
    sock_dir = tempfile.mkdtemp(prefix="kvpub")
    cfg = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"ipc://{sock_dir}/p", topic="t")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"t")
    sub.connect(cfg.endpoint)
    tokens = list(range(2 * BLOCK_SIZE))
    hashes = block_names(tokens, None)
    pub = KVEventPublisher(cfg, BLOCK_SIZE, {h: tokens[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]
                                            for i, h in enumerate(hashes)}, data_parallel_rank=3)
    try:
        time.sleep(0.3)  # the subscription reaches the PUB
        for ev in (KVEvent(STORED, hashes, None, _addrs(Tier.DEVICE, [0, 1])),
                   KVEvent(MOVED, hashes, None, _addrs(Tier.HOST, [4, 5])),
                   KVEvent(MOVED, hashes, None, _addrs(Tier.DISK, [7, 8])),
                   KVEvent(REMOVED, hashes)):
            assert pub.publish([ev])
        got = []
        seq = 1
        while seq < 5:
            assert sub.poll(5000), "nothing published"
            topic, seq_bytes, payload = sub.recv_multipart()
            if int.from_bytes(seq_bytes, "big") == 0:  # the start's AllBlocksCleared, when the subscription was in time
                continue
            assert (topic, int.from_bytes(seq_bytes, "big")) == (b"t", seq)
            seq += 1
            batch = decode(payload, rank=3)
            assert batch.ts > 0
            got.append(batch.events)
        assert got == [[stored(hashes, None, tokens, "GPU")],
                       [BlockRemoved(hashes, "GPU"), stored(hashes, None, tokens, "CPU")],
                       [BlockRemoved(hashes, "CPU"), stored(hashes, None, tokens, "STORAGE")],
                       [BlockRemoved(hashes, "STORAGE")]]
        assert decode(msgpack.packb([1.0, [ALL_BLOCKS_CLEARED], 0])).events == [AllBlocksCleared()]
    finally:
        pub.close()
        sub.close(0)
        ctx.destroy(linger=0)
        shutil.rmtree(sock_dir, ignore_errors=True)
