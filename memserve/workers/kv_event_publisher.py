"""KV cache events in vLLM's published format, for routers and indexers outside memserve.

memserve's own KV events (``kvcache/events.py``) go to the gateway's mirrors over the
internal channel. With ``--kv-events-config`` each worker also publishes every tier change
of its MemPool the way vLLM 0.32 and 0.33 do (``vllm/distributed/kv_events.py``), so that
a subscriber built on vLLM's classes decodes it unchanged:

- a PUB socket sends one multipart message per batch:
  ``[topic, seq (8-byte big-endian), payload]``; ``payload`` is the msgpack value
  msgspec writes for vLLM's ``KVEventBatch``: the array ``[ts (float), events,
  data_parallel_rank]`` (the rank is the worker's instance id), each event a map tagged by
  ``"type"``:
  ``{"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids",
  "block_size", "lora_id", "medium", "lora_name"}``, ``{"type": "BlockRemoved",
  "block_hashes", "medium"}`` or ``{"type": "AllBlocksCleared"}``. vLLM's fields that have
  a default (``extra_keys``, ``group_idx``, ``locality``, ...) are left out, as vLLM's
  encoder (``omit_defaults``) leaves them out when unset; ``lora_name`` is the LoRA
  adapter the blocks were computed through (null: the base model), ``lora_id`` null;
- a ROUTER replay socket answers ``[..., b"", start_seq (8-byte big-endian)]`` with one
  ``[..., b"", topic, seq, payload]`` message per buffered batch from ``start_seq`` on,
  then ``[..., b"", b"", -1 (8 bytes, signed), b""]``.

``medium`` is the tier, spelled as vLLM's ``MEDIUM_*`` constants: ``GPU`` for the device
tier (the fastest one, on a CPU worker too), ``CPU`` for host DRAM, ``STORAGE`` for the
disk tier. A block that moves between tiers is removed from one medium and stored in the
other. A new worker process (start or restart) begins with ``AllBlocksCleared`` at
sequence 0.

memserve's events name a moved block's new address only and carry no tokens, so the
publisher keeps, per indexed block, its tier, its parent and its tokens (which the
MemPool hands over at ``insert``: ``MemPool.event_tokens``). Blocks adopted from the disk
tier at start-up have no tokens in memory: their ``token_ids`` are ``[]``.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

from memserve.kvcache.address import Tier, addr_tier
from memserve.kvcache.events import MOVED, REMOVED, STORED, KVEvent

log = logging.getLogger("memserve.kv_events")

MEDIUM = {Tier.DEVICE: "GPU", Tier.HOST: "CPU", Tier.DISK: "STORAGE"}  # vLLM's MEDIUM_GPU, _CPU, _STORAGE
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's end marker
_KNOWN_KEYS = {"enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint", "buffer_steps", "hwm",
               "max_queue_size", "topic"}
_REPLAY_POLL_MS = 100


@dataclass
class KVEventsConfig:
    """vLLM's ``KVEventsConfig`` fields (``max_queue_size`` is accepted and unused: memserve
    publishes from the worker's loop, without a queue)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"  # zmq | null
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's send high-water mark
    max_queue_size: int = 100_000
    topic: str = ""

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVEventsConfig:
        unknown = set(d) - _KNOWN_KEYS
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)} (known: {sorted(_KNOWN_KEYS)})")
        cfg = cls(**d)
        if cfg.publisher not in ("zmq", "null"):
            raise ValueError(f"publisher must be 'zmq' or 'null', got {cfg.publisher!r}")
        if cfg.buffer_steps < 1:
            raise ValueError("buffer_steps must be >= 1")
        return cfg

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def for_instance(self, instance_id: int) -> KVEventsConfig:
        """This worker's endpoints: ``{instance}`` replaced by its instance id, else a TCP
        port moved up by the instance id (worker i binds port + i)."""
        return KVEventsConfig(**{**self.__dict__, "endpoint": instance_endpoint(self.endpoint, instance_id),
                                 "replay_endpoint": instance_endpoint(self.replay_endpoint, instance_id)
                                 if self.replay_endpoint else None})


def instance_endpoint(endpoint: str, instance_id: int) -> str:
    if "{instance}" in endpoint:
        return endpoint.replace("{instance}", str(instance_id))
    m = re.fullmatch(r"(tcp://.*):(\d+)", endpoint)
    if m:
        return f"{m.group(1)}:{int(m.group(2)) + instance_id}"
    if instance_id == 0:
        return endpoint
    raise ValueError(f"endpoint {endpoint!r}: several workers need a TCP port or an {{instance}} placeholder")


def _should_bind(endpoint: str) -> bool:
    """vLLM's rule: a wildcard address or an ipc/inproc path binds; an address connects
    (to a collector's XSUB, say)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def block_stored(hashes: list[int], parent: int | None, tokens: list[int], block_size: int,
                 medium: str, lora_name: str | None = None) -> dict[str, Any]:
    """vLLM's ``BlockStored`` map: the tag, then its fields without a default, in vLLM's order.
    Its fields with a default are left out, as vLLM's encoder leaves them when unset, so a
    batch is the msgpack value vLLM would send."""
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": block_size, "lora_id": None, "medium": medium, "lora_name": lora_name}


def block_removed(hashes: list[int], medium: str) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


ALL_BLOCKS_CLEARED: dict[str, Any] = {"type": "AllBlocksCleared"}


class _Block:
    __slots__ = ("lora_name", "parent", "tier", "tokens")

    def __init__(self, tier: Tier, parent: int | None, tokens: Sequence[int] | None, lora_name: str | None) -> None:
        self.tier = tier
        self.parent = parent
        self.tokens = tokens
        self.lora_name = lora_name


class VllmEventTranslator:
    """memserve KV events -> vLLM events (plain maps, ready for msgpack), keeping the
    per-block state that the translation needs (tier, parent, tokens)."""

    def __init__(self, block_size: int, event_tokens: dict[int, Sequence[int]] | None = None,
                 event_adapters: dict[int, str] | None = None) -> None:
        self.block_size = block_size
        # Filled by the MemPool at insert (hash -> the block's tokens; a prompt's first
        # block -> its LoRA adapter); taken from here.
        self.event_tokens = event_tokens if event_tokens is not None else {}
        self.event_adapters = event_adapters if event_adapters is not None else {}
        self.blocks: dict[int, _Block] = {}

    def translate(self, events: Iterable[KVEvent]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for ev in events:
            if ev.type == STORED:
                self._stored(ev, out)
            elif ev.type == REMOVED:
                self._removed(ev.hashes, out)
            elif ev.type == MOVED:
                self._moved(ev, out)
        return out

    def _stored(self, ev: KVEvent, out: list[dict[str, Any]]) -> None:
        parent = ev.parent
        run: list[int] = []
        for h, addr in zip(ev.hashes, ev.addrs):
            tier = addr_tier(addr)
            above = self.blocks.get(parent) if parent is not None else None
            adapter = above.lora_name if above is not None else self.event_adapters.pop(h, None)
            self.blocks[h] = _Block(tier, parent, self.event_tokens.pop(h, None), adapter)
            parent = h
            if run and self.blocks[run[0]].tier != tier:
                out.append(self._block_stored(run))
                run = []
            run.append(h)
        if run:
            out.append(self._block_stored(run))

    def _block_stored(self, chain: list[int]) -> dict[str, Any]:
        """One ``BlockStored`` for a chain of blocks in one tier (each the parent of the next)."""
        blocks = [self.blocks[h] for h in chain]
        tokens: list[int] = []
        for b in blocks:
            if b.tokens is None:  # one block's tokens are unknown: send none (see the module docstring)
                tokens = []
                break
            tokens.extend(b.tokens)
        return block_stored(list(chain), blocks[0].parent, tokens, self.block_size, MEDIUM[blocks[0].tier],
                            blocks[0].lora_name)

    def _removed(self, hashes: list[int], out: list[dict[str, Any]]) -> None:
        run: list[int] = []
        medium = ""
        for h in hashes:
            block = self.blocks.pop(h, None)
            if block is None:
                continue
            m = MEDIUM[block.tier]
            if run and m != medium:
                out.append(block_removed(run, medium))
                run = []
            run.append(h)
            medium = m
        if run:
            out.append(block_removed(run, medium))

    def _moved(self, ev: KVEvent, out: list[dict[str, Any]]) -> None:
        # Removed from the old media (in order), then stored in the new one, chain by chain.
        moved = [(h, addr_tier(a)) for h, a in zip(ev.hashes, ev.addrs) if h in self.blocks]
        self._removed_keep([h for h, _ in moved], out)
        run: list[int] = []
        for h, tier in moved:
            block = self.blocks[h]
            block.tier = tier
            if run and (block.parent != run[-1] or self.blocks[run[0]].tier != tier):
                out.append(self._block_stored(run))
                run = []
            run.append(h)
        if run:
            out.append(self._block_stored(run))

    def _removed_keep(self, hashes: list[int], out: list[dict[str, Any]]) -> None:
        """``BlockRemoved`` for blocks leaving their medium, keeping their state."""
        saved = {h: self.blocks[h] for h in hashes}
        self._removed(hashes, out)
        self.blocks.update(saved)


class KVEventPublisher:
    """A worker's vLLM-format publisher: PUB socket, bounded replay buffer, and a ROUTER
    replay socket served by a small thread. ``publish`` is called from the worker's loop.
    ``data_parallel_rank`` tells one worker's batches from another's, as vLLM's DP ranks do."""

    def __init__(self, cfg: KVEventsConfig, block_size: int, event_tokens: dict[int, Sequence[int]] | None = None,
                 clock: Callable[[], float] = time.time, data_parallel_rank: int = 0) -> None:
        self.cfg = cfg
        self.clock = clock
        self.data_parallel_rank = data_parallel_rank
        self.translator = VllmEventTranslator(block_size, event_tokens)
        self.topic = cfg.topic.encode()
        self._ctx: zmq.Context = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, cfg.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        if _should_bind(cfg.endpoint):
            self._pub.bind(cfg.endpoint)
        else:
            self._pub.connect(cfg.endpoint)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._lock = threading.Lock()
        self._seq = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if cfg.replay_endpoint:
            replay = self._ctx.socket(zmq.ROUTER)
            replay.setsockopt(zmq.LINGER, 0)
            # vLLM's bound: ZeroMQ sees reads only every HWM/2 messages, so twice a full
            # replay plus its end marker always fits (a ROUTER drops what does not).
            replay.setsockopt(zmq.SNDHWM, 2 * (cfg.buffer_steps + 1))
            try:
                replay.bind(cfg.replay_endpoint)
            except zmq.ZMQError:
                replay.close(0)
                self._pub.close(0)
                raise
            self._thread = threading.Thread(target=self._serve_replay, args=(replay,), name="kv-events-replay",
                                            daemon=True)
            self._thread.start()
        log.info("publishing KV events on %s (replay: %s)", cfg.endpoint, cfg.replay_endpoint or "off")
        self._send([ALL_BLOCKS_CLEARED])  # a new process: whatever a subscriber held is gone

    @property
    def next_seq(self) -> int:
        return self._seq

    def publish(self, events: Iterable[KVEvent]) -> int:
        """Translate and send one batch; returns how many vLLM events it held."""
        out = self.translator.translate(events)
        if out:
            self._send(out)
        return len(out)

    def _send(self, events: list[dict[str, Any]]) -> None:
        payload = msgpack.packb([self.clock(), events, self.data_parallel_rank], use_bin_type=True)
        with self._lock:
            seq = self._seq
            self._seq += 1
            self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.Again:  # over the high-water mark: subscribers recover it by replay
            pass

    def _serve_replay(self, sock: zmq.Socket) -> None:
        try:
            while not self._stop.is_set():
                if not sock.poll(_REPLAY_POLL_MS):
                    continue
                frames = sock.recv_multipart()
                if len(frames) < 3 or frames[-2] != b"" or len(frames[-1]) != 8:
                    log.warning("bad KV event replay request: %d frames", len(frames))
                    continue
                envelope = frames[:-1]  # identity ..., b""
                start = int.from_bytes(frames[-1], "big")
                with self._lock:
                    batches = [(s, p) for s, p in self._buffer if s >= start]
                for seq, payload in batches:
                    sock.send_multipart([*envelope, self.topic, seq.to_bytes(8, "big"), payload])
                sock.send_multipart([*envelope, b"", END_SEQ, b""])
        except zmq.ContextTerminated:
            pass
        finally:
            sock.close(0)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self._pub.close(0)
