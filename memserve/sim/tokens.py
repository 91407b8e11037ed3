"""Token ids for simulated requests, without a model's tokenizer unless one is given.

What matters to the cache is that equal text prefixes give equal token prefixes and that
lengths are realistic: the synthetic tokenizer cuts text into words and words into
pieces of about four characters (the bench's heuristic), and names each piece by a
stable hash. Chat prompts are the messages' tokens with a few marker tokens per message,
as a chat template adds them. With ``--tokenizer`` the real tokenizer's ids are used."""

from __future__ import annotations

import re
import zlib
from typing import Protocol

from memserve.sim.runner import SIM_VOCAB

CHARS_PER_TOKEN = 4
_WORDS = re.compile(r"\s*\S+")
MESSAGE_MARKERS = {"system": [11, 12], "user": [11, 13], "assistant": [11, 14]}  # role opening tokens
END_OF_MESSAGE = [15, 16]


class TextTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


class SyntheticTokenizer:
    def __init__(self) -> None:
        self._words: dict[str, list[int]] = {}  # a conversation repeats its words turn after turn

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for word in _WORDS.findall(text):
            pieces = self._words.get(word)
            if pieces is None:
                pieces = self._words[word] = [100 + zlib.crc32(word[i : i + CHARS_PER_TOKEN].encode()) % (SIM_VOCAB - 200)
                                              for i in range(0, len(word), CHARS_PER_TOKEN)]
            ids += pieces
        return ids


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (a file or a model folder holding one)."""

    def __init__(self, path: str) -> None:
        from pathlib import Path

        from tokenizers import Tokenizer

        p = Path(path)
        self._tok = Tokenizer.from_file(str(p / "tokenizer.json" if p.is_dir() else p))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids


def chat_tokens(tokenizer: TextTokenizer, messages: list[tuple[str, list[int] | str]]) -> list[int]:
    """Prompt ids of (role, text or ids) messages, ending with the assistant's opening."""
    ids: list[int] = []
    for role, content in messages:
        ids += MESSAGE_MARKERS[role] + (tokenizer.encode(content) if isinstance(content, str) else content)
        ids += END_OF_MESSAGE
    return ids + MESSAGE_MARKERS["assistant"]
