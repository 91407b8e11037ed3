"""Follow a running memserve's KV events with vLLM's own decoder and print what it read.

memserve's workers publish vLLM's KV event format (docs/observability.md). This reads a
worker's stream with ``vllm.distributed.kv_events.KVEventBatch`` itself, so a batch it
cannot decode is one that a router built on vLLM's classes would reject. It needs an
interpreter with vLLM installed (``benchmarks/peers/vs_vllm.sh --install-only`` builds
one), next to a memserve started with ``--kv-events-config``:

    memserve up --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
        "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5600", "topic": "kv-events"}'
    $VLLM_VENV/bin/python benchmarks/peers/kv_events_vllm_decode.py \\
        --endpoint tcp://127.0.0.1:5557 --replay-endpoint tcp://127.0.0.1:5600 --topic kv-events

With a replay endpoint it first replays what the worker still buffers (from its
``AllBlocksCleared`` on, if the buffer reaches back that far), then follows the live
stream, replaying any gap. It prints the batches, the events per type and medium, and
the blocks it holds per medium; it exits 1 when a payload did not decode or none came.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from typing import Any

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _vllm_classes() -> tuple[Any, Any, Any, Any]:
    try:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
    except ImportError as exc:
        sys.exit(f"vllm is not importable here ({exc}): run this with an interpreter that has vLLM, "
                 "e.g. the venv that benchmarks/peers/vs_vllm.sh --install-only builds")
    return KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared


class Follower:
    """Decodes each batch with vLLM's decoder, in sequence order, and keeps the counts."""

    def __init__(self, ctx: Any, args: argparse.Namespace) -> None:
        import msgspec  # a dependency of vLLM
        import zmq

        self.batch_cls, self.stored_cls, self.removed_cls, _ = _vllm_classes()
        self.decoder = msgspec.msgpack.Decoder(type=self.batch_cls)
        self.ctx, self.zmq, self.args = ctx, zmq, args
        self.topic = args.topic.encode()
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self.sub.connect(args.endpoint)
        self.next_seq: int | None = None
        self.batches = 0
        self.replayed = 0
        self.errors = 0
        self.kinds: Counter[tuple[str, str | None]] = Counter()
        self.ranks: Counter[int | None] = Counter()
        self.blocks: dict[str | None, set[Any]] = {}

    def apply(self, seq: int, payload: bytes) -> None:
        if self.next_seq is not None and seq < self.next_seq:
            return  # live and replay overlap
        self.next_seq = seq + 1
        try:
            batch = self.decoder.decode(payload)
        except Exception as exc:  # noqa: BLE001 - every decode failure is what this counts
            self.errors += 1
            print(f"seq {seq}: vLLM's decoder rejected the batch: {exc}", file=sys.stderr)
            return
        self.batches += 1
        self.ranks[batch.data_parallel_rank] += 1
        for ev in batch.events:
            medium = getattr(ev, "medium", None)
            self.kinds[(type(ev).__name__, medium)] += 1
            if isinstance(ev, self.stored_cls):
                self.blocks.setdefault(medium, set()).update(ev.block_hashes)
            elif isinstance(ev, self.removed_cls):
                self.blocks.setdefault(medium, set()).difference_update(ev.block_hashes)
            else:
                self.blocks.clear()

    def replay(self, start: int) -> None:
        """vLLM's replay request; the answers are ``[b"", topic, seq, payload]``, then the end marker."""
        dealer = self.ctx.socket(self.zmq.DEALER)
        dealer.connect(self.args.replay_endpoint)
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while dealer.poll(5000):
                _, _, seq_bytes, payload = dealer.recv_multipart()
                if seq_bytes == END_SEQ:
                    return
                self.replayed += 1
                self.apply(int.from_bytes(seq_bytes, "big"), payload)
            print("replay: no end marker within 5 s", file=sys.stderr)
        finally:
            dealer.close(0)

    def follow(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if not self.sub.poll(int(left * 1000) + 1):
                continue
            _, seq_bytes, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if self.args.replay_endpoint and self.next_seq is not None and seq > self.next_seq:
                self.replay(self.next_seq)
            self.apply(seq, payload)

    def report(self) -> None:
        print(f"batches decoded: {self.batches} ({self.replayed} replayed), rejected: {self.errors}")
        print("data_parallel_rank:", dict(self.ranks))
        for (kind, medium), n in sorted(self.kinds.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
            print(f"  {kind:<17} {str(medium):<8} {n}")
        print("blocks held per medium:", {m: len(s) for m, s in self.blocks.items()})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--endpoint", default="tcp://127.0.0.1:5557", help="the worker's PUB socket")
    ap.add_argument("--replay-endpoint", default=None, help="the worker's ROUTER replay socket")
    ap.add_argument("--topic", default="", help="the configured topic")
    ap.add_argument("--seconds", type=float, default=30.0, help="how long to follow the live stream")
    args = ap.parse_args()
    _vllm_classes()  # before any socket: a clear exit where vLLM is missing
    import zmq

    ctx = zmq.Context()
    try:
        follower = Follower(ctx, args)
        time.sleep(0.3)  # the subscription reaches the publisher before the replay ends
        if args.replay_endpoint:
            follower.replay(0)
        follower.follow(args.seconds)
        follower.report()
        return 0 if follower.batches and not follower.errors else 1
    finally:
        ctx.destroy(linger=0)


if __name__ == "__main__":
    sys.exit(main())
