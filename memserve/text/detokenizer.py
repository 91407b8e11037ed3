"""Incremental detokenisation with stop strings.

Decoding one token at a time breaks multi-byte characters (a byte-level BPE token may
hold half an emoji) and loses the leading space that SentencePiece decoders strip at the
start of a sequence. Like vLLM, each new token is decoded together with a few previous
tokens (``prefix_offset``..``read_offset`` is the already-emitted context window) and
only the text beyond the context is new; text ending in U+FFFD is an incomplete
character and waits for the next token.

Stop strings follow OpenAI semantics: the output ends just before the first stop string
and the request finishes with reason "stop". While streaming, a tail that could still
grow into a stop string is held back so that no part of a stop string is ever sent."""

from __future__ import annotations

from typing import Protocol

# How many prompt tokens give the first output token its decoding context (as vLLM).
_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns one request's output token ids into text deltas that are safe to send."""

    def __init__(self, decoder: Decoder, prompt_token_ids: list[int], stop: list[str] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self._decoder = decoder
        self._skip_special = skip_special_tokens
        context = prompt_token_ids[-_CONTEXT_TOKENS:]
        self._ids: list[int] = list(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = self._decode(self._ids)
        self._stop = [s for s in (stop or []) if s]
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self._emitted = 0  # characters of ``text`` already returned to the caller
        self.text = ""  # output text so far, cut before a stop string once one is hit
        self.num_tokens = 0  # output tokens consumed (tokens after a stop hit are not)
        self.stop_string: str | None = None  # the stop string hit (the earliest in the text)

    @property
    def stopped(self) -> bool:
        """A stop string was hit."""
        return self.stop_string is not None

    def _decode(self, ids: list[int]) -> str:
        return self._decoder.decode(ids, skip_special_tokens=self._skip_special)

    def add_tokens(self, token_ids: list[int]) -> str:
        """Consume new output tokens; return the text that may be sent now. After a stop
        string is hit, ``stopped`` is set and further tokens are ignored."""
        for token_id in token_ids:
            if self.stopped:
                break
            self.num_tokens += 1
            self._ids.append(token_id)
            new_text = self._decode(self._ids[self._prefix_offset:])
            if len(new_text) > len(self._prefix_text) and not new_text.endswith(_REPLACEMENT_CHAR):
                self._append(new_text[len(self._prefix_text):])
                self._prefix_offset = self._read_offset
                self._read_offset = len(self._ids)
                self._prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        return self._take(final=self.stopped)

    def flush(self) -> str:
        """At the end of the request: the remaining text, including an incomplete
        character (as U+FFFD) and a held-back tail that never became a stop string."""
        if not self.stopped and len(self._ids) > self._read_offset:
            new_text = self._decode(self._ids[self._prefix_offset:])
            self._append(new_text[len(self._prefix_text):])
            self._read_offset = len(self._ids)
        return self._take(final=True)

    def _append(self, delta: str) -> None:
        self.text += delta
        if not self._stop:
            return
        # A stop string ending inside the new text may start up to max_stop_len - 1 earlier.
        search_from = max(0, len(self.text) - len(delta) - self._max_stop_len + 1)
        hits = [(i, s) for s in self._stop if (i := self.text.find(s, search_from)) != -1]
        if hits:
            at, self.stop_string = min(hits)
            self.text = self.text[:at]

    def _held_back(self) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        for length in range(min(self._max_stop_len - 1, len(self.text) - self._emitted), 0, -1):
            tail = self.text[-length:]
            if any(s.startswith(tail) for s in self._stop):
                return length
        return 0

    def _take(self, final: bool) -> str:
        end = len(self.text) if final else len(self.text) - self._held_back()
        delta = self.text[self._emitted:end]
        self._emitted = end
        return delta
