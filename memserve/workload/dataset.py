"""The ShareGPT conversation file and the text corpus derived from it.

The reference workload ships inside the package, ``data/sharegpt-sample.jsonl.xz`` (one
``{"id", "messages": [{"role", "content"}]}`` per line, xz-compressed). The synthetic
workloads also draw their text from it, so every workload is real English/code text
rather than random tokens, and is reproducible from a seed without extra files.
"""

from __future__ import annotations

import json
import lzma
import os
import random
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TextIO

from memserve.workload.tokens import TokenCounter

DATA_ENV = "MEMSERVE_DATA"
DEFAULT_SHAREGPT = Path(__file__).resolve().parent / "data" / "sharegpt-sample.jsonl.xz"


def default_sharegpt_path() -> Path:
    """``$MEMSERVE_DATA`` (a file, or a folder holding ``sharegpt-sample.jsonl``), else the
    sample inside the package."""
    env = os.environ.get(DATA_ENV)
    if not env:
        return DEFAULT_SHAREGPT
    p = Path(env)
    return p / "sharegpt-sample.jsonl" if p.is_dir() else p


@dataclass(frozen=True)
class Conversation:
    id: str
    messages: tuple[tuple[str, str], ...]  # (role, content), alternating user/assistant

    @property
    def exchanges(self) -> list[tuple[str, str | None]]:
        """(user message, recorded answer or None) pairs, in order."""
        out: list[tuple[str, str | None]] = []
        for i in range(0, len(self.messages), 2):
            answer = self.messages[i + 1][1] if i + 1 < len(self.messages) else None
            out.append((self.messages[i][1], answer))
        return out


def open_text(path: Path) -> TextIO:
    """A JSONL file for reading, plain or xz-compressed (by its ``.xz`` suffix)."""
    if path.suffix == ".xz":
        return lzma.open(path, "rt", encoding="utf-8")
    return path.open(encoding="utf-8")


def load_conversations(path: str | Path) -> list[Conversation]:
    """Read the JSONL file; each conversation is cut before its first empty or
    out-of-order message, and dropped if nothing usable is left."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"ShareGPT file not found: {path} (set --dataset or ${DATA_ENV})")
    conversations = []
    with open_text(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            kept: list[tuple[str, str]] = []
            for i, msg in enumerate(row.get("messages", [])):
                expected = "user" if i % 2 == 0 else "assistant"
                content = msg.get("content") or ""
                if msg.get("role") != expected or not content.strip():
                    break
                kept.append((expected, content))
            if kept:
                conversations.append(Conversation(str(row.get("id", line_no)), tuple(kept)))
    if not conversations:
        raise ValueError(f"no usable conversations in {path}")
    return conversations


class TextCorpus:
    """All message text of the conversations, joined, to cut deterministic passages from."""

    def __init__(self, conversations: list[Conversation], counter: TokenCounter) -> None:
        self._conversations = conversations
        self.counter = counter

    @cached_property
    def text(self) -> str:
        return "\n\n".join(c for conv in self._conversations for _, c in conv.messages)

    def passage(self, rng: random.Random, num_tokens: int) -> str:
        """About ``num_tokens`` tokens of text starting at a random offset (wrapping)."""
        text = self.text
        # Over-take characters, then cut in tokens: real tokenizers vary around 4 chars/token.
        want_chars = num_tokens * 8 + 16
        start = rng.randrange(len(text))
        chunk = text[start : start + want_chars]
        while len(chunk) < want_chars:
            chunk += "\n\n" + text[: want_chars - len(chunk)]
        return self.counter.truncate(chunk, num_tokens)
