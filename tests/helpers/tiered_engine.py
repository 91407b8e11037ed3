"""A real engine with a tiny device pool, a small host tier and a disk tier, and short ShareGPT conversations for it."""

from __future__ import annotations

import json
from pathlib import Path

from memserve.config import EngineConfig
from memserve.text.tokenizer import Tokenizer

DEVICE_BLOCKS = 16  # 256 tokens: one conversation at a time, barely
HOST_BLOCKS = 8
DISK_GB = 0.12  # about 170 blocks of SmolLM2-135M in float32 (720 KiB each)
MAX_MODEL_LEN = DEVICE_BLOCKS * 16
TURNS = 3


def tiered_config(disk_dir: Path) -> EngineConfig:
    return EngineConfig(dtype="float32", num_blocks=DEVICE_BLOCKS, num_host_blocks=HOST_BLOCKS,
                        disk_cache_dir=str(disk_dir), disk_cache_gb=DISK_GB, max_num_batched_tokens=512,
                        max_model_len=MAX_MODEL_LEN)


def short_conversations(tokenizer: Tokenizer, n: int) -> list[list[dict]]:
    """The first ``n`` ShareGPT conversations whose third turn fits the context."""
    from helpers.paths import SHARED_DATA

    out = []
    for line in (SHARED_DATA / "sharegpt-sample.jsonl").read_text().splitlines():
        conv = json.loads(line)["messages"]
        if len(conv) < 2 * TURNS:
            continue
        history = []
        for turn in range(TURNS):
            history += [{"role": "user", "content": conv[2 * turn]["content"]}, {"role": "assistant", "content": "x " * 16}]
        if len(tokenizer.encode_chat(history[:-1])) < MAX_MODEL_LEN - 40:
            out.append(conv)
        if len(out) == n:
            return out
    raise AssertionError("not enough short conversations")


def tokens_of(results) -> list[dict[int, list[int]]]:
    return [{s: tokens for s, (tokens, _) in turn.items()} for turn in results]
