"""Approximate token lengths of workload text.

Workloads are specified in tokens (a shared prefix of 1,024 tokens, documents of 4,096
tokens, a recorded answer's length) but the benchmark only speaks text over HTTP, so it
needs a way to measure and cut text in tokens. With ``--tokenizer PATH`` it uses the real
tokenizer (a ``tokenizer.json`` file, or a Hugging Face model folder); without one it uses
the common heuristic of about four characters per token for English text, which is
close enough to size workloads while keeping the benchmark free of model files. The
server's own ``usage`` counts are what the report uses for measured token numbers.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Protocol

CHARS_PER_TOKEN = 4


class TokenCounter(Protocol):
    def count(self, text: str) -> int: ...

    def truncate(self, text: str, num_tokens: int) -> str: ...


class HeuristicTokenCounter:
    """About four characters per token: no files needed, deterministic."""

    def __init__(self, chars_per_token: int = CHARS_PER_TOKEN) -> None:
        self.chars_per_token = chars_per_token

    def count(self, text: str) -> int:
        return math.ceil(len(text) / self.chars_per_token)

    def truncate(self, text: str, num_tokens: int) -> str:
        return text[: num_tokens * self.chars_per_token]


class TokenizerTokenCounter:
    """Counts with a real tokenizer so synthetic lengths match what the server sees."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer

        p = Path(path)
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {path}")
        self._tokenizer = Tokenizer.from_file(str(file))

    def count(self, text: str) -> int:
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def truncate(self, text: str, num_tokens: int) -> str:
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids[:num_tokens]
        return self._tokenizer.decode(ids)


def make_token_counter(tokenizer_path: str | None) -> TokenCounter:
    return TokenizerTokenCounter(tokenizer_path) if tokenizer_path else HeuristicTokenCounter()
