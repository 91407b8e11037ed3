"""What the gateway does with a chat conversation that outgrows the context window
(``--truncation``, AttentionStore §3.4).

``error`` refuses it (400 ``context_length_exceeded``, as OpenAI). ``recompute`` and
``kv-shift`` drop the fewest WHOLE KV blocks right after the blocks of the system prompt,
so the oldest turns go; the system prompt and the last message (the question being asked)
stay whole, and a conversation that cannot fit so is refused as with ``error``. Whole blocks, because the turns kept
then fill whole blocks exactly as they did before, only ``dropped`` positions earlier:
with ``kv-shift`` the worker reuses their cached KV, its keys rotated back by that many
positions (``workers/engine/truncated_prefix.py``), instead of recomputing it as ``recompute``
does. The worker is told what was dropped (where, and the tokens) so it can find that KV
under the untruncated conversation's block names.

The system prompt's end is where a conversation of only the system messages and an empty
user turn stops agreeing with the real one: that also covers a template's default system
prompt (SmolLM2 adds one when the conversation has none). The last message's start is
where the system messages and the last message alone agree with the real one from the
end. Both are short to render, whatever the conversation's length. Pure Python."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

TRUNCATION_MODES = ("kv-shift", "recompute", "error")
# Its perplexity matches recompute's (docs/benchmarks.md, "KV-shift truncation quality").
DEFAULT_TRUNCATION = "kv-shift"
# A request without max_tokens keeps this share of the window for its answer once it
# had to be truncated (without truncation it gets the rest of the window, as before).
ANSWER_SHARE = 0.25


@dataclass(frozen=True)
class Truncation:
    prompt_ids: list[int]  # what the model sees
    dropped_at: int = 0  # token offset of the dropped range (a multiple of the block size)
    dropped_ids: list[int] = field(default_factory=list)  # the tokens removed there


class CannotTruncate(ValueError):
    """Dropping everything after the system prompt still does not leave room."""


def head_messages(messages: Sequence[dict]) -> list[dict]:
    """The conversation's leading system messages and an empty user turn: rendered, they
    agree with the whole conversation exactly up to the system prompt's end."""
    leading = 0
    while leading < len(messages) and messages[leading].get("role") in ("system", "developer"):
        leading += 1
    return [*messages[:leading], {"role": "user", "content": ""}]


def tail_messages(messages: Sequence[dict]) -> list[dict]:
    """The leading system messages and the last message: rendered, they agree with the
    whole conversation from its end back to the last message's start."""
    head = head_messages(messages)[:-1]
    return [*head, messages[-1]] if len(messages) > len(head) else head


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def common_suffix(a: Sequence[int], b: Sequence[int]) -> int:
    return common_prefix(a[::-1], b[::-1])


def overflows(prompt_len: int, max_model_len: int, max_tokens: int | None) -> bool:
    """Whether the prompt and its answer budget do not fit (``resolve_max_tokens`` would refuse)."""
    return prompt_len >= max_model_len if max_tokens is None else prompt_len + max_tokens > max_model_len


def prompt_limit(max_model_len: int, max_tokens: int | None) -> int:
    """The most prompt tokens that leave the request its answer budget."""
    if max_tokens is None:
        return max_model_len - max(1, int(max_model_len * ANSWER_SHARE))
    return max_model_len - max_tokens


def truncate(prompt_ids: list[int], head_len: int, tail_len: int, limit: int, block_size: int) -> Truncation:
    """``prompt_ids`` with the fewest whole blocks after the first ``head_len`` tokens'
    blocks removed so that at most ``limit`` remain (unchanged when it fits already),
    none of the last ``tail_len`` tokens among them."""
    if len(prompt_ids) <= limit:
        return Truncation(prompt_ids)
    keep = -(-head_len // block_size) * block_size
    drop = -(-(len(prompt_ids) - limit) // block_size) * block_size
    if keep + drop > len(prompt_ids) - tail_len:
        raise CannotTruncate(f"the system prompt ({head_len} tokens, {keep} with its last block) and the last message "
                             f"({tail_len} tokens) cannot fit in {limit} tokens, however many earlier turns are dropped")
    return Truncation(prompt_ids[:keep] + prompt_ids[keep + drop:], keep, prompt_ids[keep : keep + drop])
