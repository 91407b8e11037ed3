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
    """A Hugging Face ``tokenizer.json`` (a file or a model folder holding one). A model
    folder with a chat template renders text conversations exactly as the gateway does
    (its default system prompt included), so simulated prompts equal served ones."""

    def __init__(self, path: str) -> None:
        from pathlib import Path

        from tokenizers import Tokenizer

        from memserve.text.tokenizer import Tokenizer as ChatTokenizer

        p = Path(path)
        self._tok = Tokenizer.from_file(str(p / "tokenizer.json" if p.is_dir() else p))
        self._chat = ChatTokenizer.from_folder(p) if p.is_dir() else None
        if self._chat is not None and self._chat.chat_template is None:
            self._chat = None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_chat(self, messages: list[tuple[str, str]]) -> list[int] | None:
        """The served prompt of a text conversation; None without a chat template."""
        if self._chat is None:
            return None
        return self._chat.encode_chat([{"role": role, "content": text} for role, text in messages])


def chat_tokens(tokenizer: TextTokenizer, messages: list[tuple[str, list[int] | str]]) -> list[int]:
    """Prompt ids of (role, text or ids) messages, ending with the assistant's opening:
    the model's own chat template when the tokenizer has one and every message is text."""
    encode_chat = getattr(tokenizer, "encode_chat", None)
    if encode_chat is not None and all(isinstance(content, str) for _, content in messages):
        served = encode_chat(messages)
        if served is not None:
            return served
    ids: list[int] = []
    for role, content in messages:
        ids += MESSAGE_MARKERS[role] + (tokenizer.encode(content) if isinstance(content, str) else content)
        ids += END_OF_MESSAGE
    return ids + MESSAGE_MARKERS["assistant"]
