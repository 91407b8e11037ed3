"""The skewed load for the global-scheduler benchmarks (the cost policy should
reach a P99 TTFT at most prompt-tree's, and lower under skewed load): single-turn requests that all share one of
a few long system prompts, fewer prompts than instances. Prompt-tree follows the cache
onto the instances holding them until its load-imbalance guard fires; the cost policy
weighs each holder's queue against pulling the prompt (eq. 2) or recomputing it on an
idle instance (eq. 1)."""

from __future__ import annotations

import argparse


def add_hot_prefix_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hot-prefixes", type=int, default=1, help="hot-prefix: distinct shared system prompts")
    p.add_argument("--hot-prefix-len", type=int, default=1024, help="hot-prefix: tokens in each")
    p.add_argument("--hot-input-len", default="uniform:32:128", help="hot-prefix: each request's own tokens")


def hot_prefix_flags(args: argparse.Namespace) -> list[str]:
    """`memserve bench` / `memserve simulate` workload flags of the skewed load."""
    return ["--workload", "shared-prefix", "--num-prefixes", str(args.hot_prefixes),
            "--prefix-len", str(args.hot_prefix_len), "--input-len", args.hot_input_len]
