"""OpenAI's logprobs objects, from the worker's per-token ``TokenLogprobs``.

A token is shown as its own text decoded alone (what vLLM shows, so a token holding half
a UTF-8 character reads U+FFFD); chat also gives its exact ``bytes``, from which a client
can rebuild such characters. A log-probability below -9999 (a token the model rules
out) is reported as -9999.0, OpenAI's "very unlikely", which JSON can carry where -inf
cannot.

Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}], "refusal"}``
with the ``top_logprobs`` most likely tokens. Completions: parallel lists ``tokens``,
``token_logprobs``, ``top_logprobs`` (the chosen token and the ``logprobs`` most likely
ones, up to logprobs + 1 entries, as OpenAI) and ``text_offset`` (where each token's text
starts in the choice's text); an echoed prompt's first token has null logprobs."""

from __future__ import annotations

from memserve.ipc.messages import TokenLogprobs
from memserve.text.tokenizer import Tokenizer

VERY_UNLIKELY = -9999.0

# (token id, its logprobs; None for the first prompt token, which nothing predicts).
LoggedToken = tuple[int, TokenLogprobs | None]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


_BYTE_OF_CHAR = {char: byte for byte, char in _bytes_to_unicode().items()}


def _clamp(logprob: float) -> float:
    return logprob if logprob >= VERY_UNLIKELY else VERY_UNLIKELY  # also turns NaN into VERY_UNLIKELY


class TokenStrings:
    """Each token's text and bytes, computed once per id."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._text: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def text(self, token_id: int) -> str:
        text = self._text.get(token_id)
        if text is None:
            text = self._text[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def bytes(self, token_id: int) -> list[int]:
        """Byte-level BPE pieces map back to their bytes exactly; any other token (a
        special token, another tokenizer family) gives its text's UTF-8."""
        value = self._bytes.get(token_id)
        if value is None:
            piece = self._tokenizer.byte_level_piece(token_id)
            if piece is not None and all(c in _BYTE_OF_CHAR for c in piece):
                value = [_BYTE_OF_CHAR[c] for c in piece]
            else:
                value = list(self.text(token_id).encode("utf-8"))
            self._bytes[token_id] = value
        return value


class TokenLog:
    """One choice's logged tokens not sent yet."""

    def __init__(self) -> None:
        self._pending: list[LoggedToken] = []

    def add_prompt(self, prompt_ids: list[int], prompt_logprobs: list[TokenLogprobs]) -> None:
        """The prompt's tokens, the first with no logprobs (nothing predicts it)."""
        self._pending.append((prompt_ids[0], None))
        self._pending += zip(prompt_ids[1:], prompt_logprobs)

    def add(self, token_ids: list[int], logprobs: list[TokenLogprobs]) -> None:
        self._pending += zip(token_ids, logprobs)

    def take(self) -> list[LoggedToken]:
        taken, self._pending = self._pending, []
        return taken


def chat_logprobs(tokens: list[LoggedToken], strings: TokenStrings) -> dict:
    """The choice's ``logprobs`` for these generated tokens."""
    content = []
    for token_id, logprobs in tokens:
        assert logprobs is not None  # chat echoes no prompt: every token here was generated
        logprob, top_ids, top_logprobs = logprobs
        content.append({
            "token": strings.text(token_id), "logprob": _clamp(logprob), "bytes": strings.bytes(token_id),
            "top_logprobs": [{"token": strings.text(t), "logprob": _clamp(lp), "bytes": strings.bytes(t)}
                             for t, lp in zip(top_ids, top_logprobs)],
        })
    return {"content": content, "refusal": None}


class CompletionLogprobs:
    """One choice's completions ``logprobs``, piece by piece as it streams: text offsets
    continue from the previous piece."""

    def __init__(self, strings: TokenStrings) -> None:
        self._strings = strings
        self._offset = 0

    def render(self, tokens: list[LoggedToken]) -> dict:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, logprobs in tokens:
            text = self._strings.text(token_id)
            out["tokens"].append(text)
            out["text_offset"].append(self._offset)
            self._offset += len(text)
            if logprobs is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            logprob, top_ids, top_logprobs = logprobs
            out["token_logprobs"].append(_clamp(logprob))
            top = {text: _clamp(logprob)}
            for t, lp in zip(top_ids, top_logprobs):
                top.setdefault(self._strings.text(t), _clamp(lp))
            out["top_logprobs"].append(top)
        return out
