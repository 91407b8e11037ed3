"""Multi-turn TTFT with the tiered KV store against recomputation (AttentionStore
Fig. 14 shape), on the real engine and model (SmolLM2-135M), engine-level, one run.

Several ShareGPT conversations take turns one request at a time (turn 1 of every
session, then turn 2 of every session, ...), so between two turns of a session the
others pass through a device pool far smaller than their combined histories: each
history comes back from the host or disk tier, or is recomputed. The conversations are
the ShareGPT ones that open with a long message (a pasted document or code, 600-1,600
tokens) followed by short questions, so histories are long and each new turn is short,
as in the paper's workload; the history of turn k holds the answers the engine gave
(greedy, so both modes see the same prompts). TTFT is the wall time from queueing a turn
to its first token; recomputation is the same engine with ``enable_prefix_caching`` off
(``--no-prefix-cache``). Both engines live in this process and alternate request by
request, so a change of load on a shared machine hits both alike. Reports mean TTFT by
turn and the ratio for turns >= 3 (turn 1, computed by both, is the control: about 1x).

    python benchmarks/real/tier_ttft_vs_recompute.py [--sessions 6] [--turns 4] [--plot ttft.png]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

from memserve.config import EngineConfig
from memserve.ipc.messages import AddRequest, SamplingParams
from memserve.kvcache.disk_store import HEADER_NBYTES
from memserve.model_files.gguf_convert import ensure_model_dir
from memserve.text.tokenizer import Tokenizer
from memserve.workers.engine.engine import Engine
from memserve.workers.real_engine import build_engine
from memserve.workload.dataset import default_sharegpt_path, open_text

BLOCK_NBYTES = 2 * 30 * 16 * 3 * 64 * 4  # SmolLM2-135M in float32: 30 layers, 3 KV heads of 64, 16 tokens


def conversations(tokenizer: Tokenizer, n: int, turns: int, first_len: tuple[int, int],
                  max_question: int) -> list[list[str]]:
    """User messages of ShareGPT conversations that open with ``first_len`` tokens and
    go on with ``turns - 1`` questions of at most ``max_question`` tokens."""
    out = []
    for line in open_text(default_sharegpt_path()).read().splitlines():
        users = [m["content"] for m in json.loads(line)["messages"] if m["role"] == "user"][:turns]
        if len(users) < turns or not first_len[0] <= len(tokenizer.encode(users[0])) <= first_len[1]:
            continue
        if all(len(tokenizer.encode(u)) <= max_question for u in users[1:]):
            out.append(users)
        if len(out) == n:
            return out
    raise SystemExit(f"only {len(out)} conversations fit; relax the lengths or ask for fewer")


def run(engines: dict[str, Engine], tokenizer: Tokenizer, convs: list[list[str]], turns: int, max_tokens: int,
        tag: str) -> dict[str, list[list[tuple[float, int, int]]]]:
    """Per mode, per turn, per session: (TTFT s, prompt tokens, cached tokens). The modes
    take turns request by request, so a change in the machine's load hits them alike."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    history = {mode: [[] for _ in convs] for mode in engines}
    out: dict[str, list[list[tuple[float, int, int]]]] = {mode: [] for mode in engines}
    for k in range(turns):
        for rows in out.values():
            rows.append([])
        for s, users in enumerate(convs):
            for mode, engine in engines.items():
                chat = history[mode][s]
                chat.append({"role": "user", "content": users[k]})
                prompt = tokenizer.encode_chat(chat)
                started = time.perf_counter()
                assert engine.add_request(AddRequest(f"{tag}-{mode}-{s}-{k}", prompt, params)) is None
                ttft, cached, answer = None, 0, []
                while engine.has_work:
                    for o in engine.step():
                        if ttft is None and o.new_token_ids:
                            ttft = time.perf_counter() - started
                        cached = o.num_cached_tokens
                        answer += o.new_token_ids
                chat.append({"role": "assistant", "content": tokenizer.decode(answer)})
                out[mode][k].append((ttft, len(prompt), cached))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per turn")
    p.add_argument("--device-blocks", type=int, default=128, help="device KV blocks (16 tokens each)")
    p.add_argument("--host-blocks", type=int, default=128)
    p.add_argument("--disk-blocks", type=int, default=1024)
    p.add_argument("--first-len", default="600:1600", help="tokens of the opening message, LO:HI")
    p.add_argument("--max-question", type=int, default=150, help="tokens of each later user message, at most")
    p.add_argument("--eviction-policy", default="scheduler-aware")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="the step's token budget (chunked prefill); it also sets how much of each tier the "
                        "saver keeps free (2048: every idle block goes down to disk)")
    p.add_argument("--plot", help="write the figure here (PNG)")
    args = p.parse_args()
    model_dir = ensure_model_dir(None)
    tokenizer = Tokenizer.from_folder(model_dir)
    max_len = args.device_blocks * 16
    lo, hi = (int(x) for x in args.first_len.split(":"))
    convs = conversations(tokenizer, args.sessions, args.turns, (lo, hi), args.max_question)
    openings = sum(len(tokenizer.encode(c[0])) for c in convs)
    print(f"{len(convs)} sessions x {args.turns} turns; openings {openings} tokens together, device pool "
          f"{max_len} tokens", flush=True)
    with tempfile.TemporaryDirectory() as disk_dir:
        base = {"dtype": "float32", "num_blocks": args.device_blocks, "max_num_seqs": 1,
                "max_num_batched_tokens": args.max_num_batched_tokens, "max_model_len": max_len}
        modes = {
            "tiered": EngineConfig(**base, num_host_blocks=args.host_blocks, disk_cache_dir=disk_dir,
                                   disk_cache_gb=args.disk_blocks * (BLOCK_NBYTES + HEADER_NBYTES) / 2**30,
                                   eviction_policy=args.eviction_policy),
            "recompute": EngineConfig(**base, enable_prefix_caching=False),
        }
        engines = {mode: build_engine(cfg, model_dir) for mode, cfg in modes.items()}
        run(engines, tokenizer, [["Hello!"]], 1, args.max_tokens, "warm")  # first-call overheads
        results = run(engines, tokenizer, convs, args.turns, args.max_tokens, "run")
        io = engines["tiered"].mempool.stats()["tier_io"]
        print("tier hits (blocks):", {t: v["hits"] for t, v in io.items()})
        for engine in engines.values():
            engine.close()
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'tiered ms':>10} {'recompute ms':>13} {'speedup':>8}")
    late = {"tiered": [], "recompute": []}
    for k in range(args.turns):
        tiered, recompute = results["tiered"][k], results["recompute"][k]
        t_ms = 1000 * sum(r[0] for r in tiered) / len(tiered)
        r_ms = 1000 * sum(r[0] for r in recompute) / len(recompute)
        prompt = sum(r[1] for r in tiered) / len(tiered)
        cached = sum(r[2] for r in tiered) / len(tiered)
        print(f"{k + 1:>4} {prompt:7.0f} {cached:7.0f} {t_ms:10.1f} {r_ms:13.1f} {r_ms / t_ms:7.2f}x")
        if k >= 2:
            late["tiered"] += [r[0] for r in tiered]
            late["recompute"] += [r[0] for r in recompute]
    t_late = sum(late["tiered"]) / len(late["tiered"])
    r_late = sum(late["recompute"]) / len(late["recompute"])
    print(f"turns >= 3: tiered {1000 * t_late:.1f} ms, recompute {1000 * r_late:.1f} ms: {r_late / t_late:.2f}x")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        xs = range(1, args.turns + 1)
        for mode, offset in (("recompute", -0.2), ("tiered", 0.2)):
            ax.bar([x + offset for x in xs], [1000 * sum(r[0] for r in results[mode][k]) / len(convs)
                                              for k in range(args.turns)], width=0.4, label=mode)
        ax.set_xlabel("turn")
        ax.set_ylabel("mean TTFT (ms)")
        ax.set_title(f"SmolLM2-135M, CPU: TTFT by turn ({r_late / t_late:.1f}x at turns >= 3)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
