"""Grammar-constrained decoding (structured output, forced tool calls) with llguidance.

The gateway turns ``response_format`` and forced tool calls into an llguidance grammar
(``SamplingParams.grammar``, already validated there). Here each such request gets a
matcher that holds its parser state: before every sample the matchers write a bitmask
of the tokens the grammar allows next, which masks the batch's logits in one tensor op
(greedy and sampled rows alike), and every accepted token advances its matcher. Once the
grammar is complete only end-of-sequence tokens remain allowed, so the request stops
with finish_reason "stop" through the scheduler's ordinary EOS check.

The bitmask is unpacked with numpy, and the logits see a single torch op: torch spreads
full-vocabulary ops over its threads, which costs more than the op itself on a small,
busy CPU.

Building a matcher parses its grammar, so one pristine matcher per grammar text is kept
in an LRU cache and new requests get a copy of it. The tokenizer (the vocabulary as
llguidance sees it) is built on the first grammar request only: most workers never
need it."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import llguidance
import numpy as np
import torch

log = logging.getLogger("memserve.worker")

# Distinct grammars whose parsed matcher is kept (a copy starts each request).
GRAMMAR_CACHE_SIZE = 128


class GrammarMatchers:
    """The matcher of every running request that has a grammar, by request id."""

    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: Iterable[int],
                 cache_size: int = GRAMMAR_CACHE_SIZE) -> None:
        self._model_dir = model_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._cache_size = cache_size
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        self._executor: llguidance.LLExecutor | None = None

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            text = (self._model_dir / "tokenizer.json").read_text(encoding="utf-8")
            self._tokenizer = llguidance.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
        return self._tokenizer

    def compiled(self, grammar: str) -> llguidance.LLMatcher:
        """The pristine matcher of ``grammar``, parsed once while it stays in the cache."""
        matcher = self._compiled.get(grammar)
        if matcher is not None:
            self._compiled.move_to_end(grammar)
            return matcher
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar)
        if matcher.is_error():
            raise ValueError(f"invalid grammar: {matcher.get_error()}")
        self._compiled[grammar] = matcher
        if len(self._compiled) > self._cache_size:
            self._compiled.popitem(last=False)
        return matcher

    def start(self, request_id: str, grammar: str | None, output_token_ids: list[int]) -> None:
        """A request's first plan; ``output_token_ids``: what it produced elsewhere before
        it resumed here (the matcher starts past them). A preempted request keeps its
        matcher (its output tokens are recomputed, not re-sampled)."""
        if grammar is not None and request_id not in self._matchers:
            self._matchers[request_id] = self.compiled(grammar).deep_copy()
            self.accept([request_id] * len(output_token_ids), output_token_ids)

    def forget(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def rows(self, request_ids: list[str]) -> GrammarBatch | None:
        """The matchers of a batch's rows, or None when no row has one (the common case)."""
        if not self._matchers:
            return None
        rows = [self._matchers.get(r) for r in request_ids]
        return GrammarBatch(self, rows) if any(m is not None for m in rows) else None

    def accept(self, request_ids: list[str], tokens: list[int]) -> None:
        """Advance each matcher by its request's sampled token."""
        if not self._matchers:
            return
        for rid, token in zip(request_ids, tokens):
            matcher = self._matchers.get(rid)
            if matcher is not None and not matcher.consume_token(token):
                log.warning("request %s: token %d breaks its grammar: %s", rid, token, matcher.get_error())

    def allowed(self, matchers: list[llguidance.LLMatcher]) -> np.ndarray:
        """[len(matchers), V] booleans: the tokens each matcher allows next (computed in
        parallel by llguidance); a matcher in an error state allows end-of-sequence only."""
        bitmask = np.zeros((len(matchers), (self.vocab_size + 31) // 32), dtype=np.int32)
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        self._executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bitmask.ctypes.data,
                                               bitmask.shape[1] * bitmask.itemsize, len(matchers))
        allowed = allowed_tokens(bitmask, self.vocab_size)
        for i, matcher in enumerate(matchers):
            if matcher.is_error():
                allowed[i] = False
                allowed[i, self.eos_token_ids] = True
        return allowed


@dataclass
class GrammarBatch:
    """The matcher (or None) of each row of one sampling batch."""

    owner: GrammarMatchers
    matchers: list[llguidance.LLMatcher | None]


def allowed_tokens(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """A bitmask [R, ceil(V / 32)] (int32 words, token t at bit t % 32 of word t // 32)
    as booleans [R, V]."""
    words = bitmask.astype("<i4", copy=False).view(np.uint8)  # little-endian bytes: bit order = token order
    return np.unpackbits(words, axis=-1, bitorder="little")[:, :vocab_size].astype(bool)


def apply_grammar_masks(logits: torch.Tensor, batch: GrammarBatch | None) -> torch.Tensor:
    """logits [B, V] with the tokens each row's grammar forbids at -inf (a new tensor);
    rows without a matcher are unchanged. One mask op for the whole batch."""
    if batch is None:
        return logits
    rows = [i for i, m in enumerate(batch.matchers) if m is not None]
    allowed = batch.owner.allowed([m for m in batch.matchers if m is not None])
    if len(rows) < logits.shape[0]:
        full = np.ones((logits.shape[0], allowed.shape[1]), dtype=bool)
        full[rows] = allowed
        allowed = full
    forbidden = torch.from_numpy(~allowed).to(logits.device, non_blocking=True)
    return logits.masked_fill(forbidden, float("-inf"))
