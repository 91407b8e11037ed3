"""Router decision latency: microseconds per ``Router.route`` with N instances whose
mirrored prompt trees hold B cached blocks in all, for each policy. The mirrors are
filled through KV events as the gateway fills them (documents of D tokens, most of them
sharing one of a few system prompts); requests are a document plus a question, half of
them about a cached document; every instance has R requests in flight in the ledger.

    python benchmarks/micro/router_latency.py --instances 8 --blocks 100000
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from memserve.costmodel.store import load_cost_model
from memserve.gateway.routing.route_types import RouteRequest, WorkerView
from memserve.gateway.routing.router import ROUTING_POLICIES, Router
from memserve.kvcache.events import STORED, KVEvent
from memserve.kvcache.hashing import block_hashes
from memserve.kvcache.mirror import PromptTreeMirror


def cache(mirror: PromptTreeMirror, tokens: list[int], next_addr: list[int]) -> None:
    """Apply the STORED event the worker would send after caching ``tokens``."""
    hashes = block_hashes(tokens, mirror.block_size)
    known = mirror.index.known_prefix(hashes)
    if known < len(hashes):
        addrs = list(range(next_addr[0], next_addr[0] + len(hashes) - known))
        next_addr[0] += len(addrs)
        mirror.apply_event(KVEvent(STORED, hashes[known:], hashes[known - 1] if known else None, addrs))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--instances", type=int, default=8)
    p.add_argument("--blocks", type=int, default=100_000, help="cached blocks in all mirrors together")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--doc-len", type=int, default=2048)
    p.add_argument("--in-flight", type=int, default=16, help="requests in flight per instance")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--cost-model", default="llama2-13b-h800")
    p.add_argument("--step-tokens", type=int, default=2048, help="the workers' max_num_batched_tokens")
    args = p.parse_args()
    rng = random.Random(0)
    bs = args.block_size
    systems = [[rng.randrange(1, 50_000) for _ in range(256)] for _ in range(4)]
    mirrors = [PromptTreeMirror(i, bs) for i in range(args.instances)]
    docs: list[list[int]] = []
    next_addr = [0]
    while sum(len(m.index) for m in mirrors) < args.blocks:
        doc = rng.choice(systems) + [rng.randrange(1, 50_000) for _ in range(args.doc_len - 256)]
        docs.append(doc)
        cache(mirrors[len(docs) % args.instances], doc, next_addr)
    total = sum(len(m.index) for m in mirrors)
    requests = []
    for r in range(args.requests):
        base = rng.choice(docs) if r % 2 else rng.choice(systems) + [rng.randrange(1, 50_000) for _ in range(1792)]
        requests.append(base + [rng.randrange(1, 50_000) for _ in range(64)])
    cost = load_cost_model(args.cost_model)
    print(f"{args.instances} instances, {total} cached blocks in the mirrors ({len(docs)} documents of "
          f"{args.doc_len} tokens), prompts of {len(requests[0])} tokens, {args.in_flight} requests in flight each")
    for name in ROUTING_POLICIES:
        router = Router.named(name, cost, step_tokens=args.step_tokens)
        views = [WorkerView(i, "ok", args.in_flight, {}, m) for i, m in enumerate(mirrors)]
        for i in range(args.instances):
            for k in range(args.in_flight):
                router.ledger.admit(f"bg-{i}-{k}", i, 2048, 1024, 128)
                if k % 2:
                    router.ledger.observe(f"bg-{i}-{k}", 1)
        times = []
        for r, prompt in enumerate(requests):
            request = RouteRequest(f"r{r}", prompt, f"s{r % 100}", max_tokens=128)
            start = time.perf_counter()
            router.route(request, views)
            times.append(time.perf_counter() - start)
            router.release(request.request_id)
        times.sort()
        print(f"{name:12s} mean {statistics.fmean(times) * 1e6:7.1f} us  p50 {times[len(times) // 2] * 1e6:7.1f} us  "
              f"p99 {times[int(len(times) * 0.99)] * 1e6:7.1f} us  decisions {dict(router.decisions)}")


if __name__ == "__main__":
    main()
