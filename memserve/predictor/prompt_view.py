"""What the predictor keeps of a prompt: its length, its number of chat turns and a
bounded excerpt of the last user turn.

The gateway only sees token ids (the chat template is already applied), so the turns are
found by the template's user header in ids (``<|im_start|>user`` for ChatML,
``<|start_header_id|>user`` for Llama 3, ...). The excerpt is the head and the tail of
the last user turn: the instruction that decides how long the answer is tends to sit at
either end ("Summarise the text below: ..." / "... Explain this in 500 words"), and a
fixed size bounds both the feature cost per request and the size of the bootstrap table,
which stores views rather than prompts."""

from __future__ import annotations

from dataclasses import dataclass

from memserve.text.tokenizer import Tokenizer

# Turn-start marker + role name of the chat formats we know; the first one whose marker
# is a single token of the tokenizer is used.
_USER_HEADERS = ("<|im_start|>user", "<|start_header_id|>user", "<start_of_turn>user", "<|user|>", "[INST]")
HEAD_TOKENS = 64
TAIL_TOKENS = 64


@dataclass(frozen=True)
class PromptView:
    prompt_tokens: int
    turn_markers: int  # occurrences of the turn-start token: system + user + assistant turns (+ generation prompt)
    last_turn_tokens: int  # length of the last user turn before excerpting
    excerpt: tuple[int, ...]  # head + tail of the last user turn (all of it when short)

    def to_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "turn_markers": self.turn_markers,
                "last_turn_tokens": self.last_turn_tokens, "excerpt": list(self.excerpt)}

    @classmethod
    def from_dict(cls, d: dict) -> PromptView:
        return cls(int(d["prompt_tokens"]), int(d["turn_markers"]), int(d["last_turn_tokens"]),
                   tuple(int(t) for t in d["excerpt"]))


def _excerpt(ids: list[int]) -> tuple[int, ...]:
    if len(ids) <= HEAD_TOKENS + TAIL_TOKENS:
        return tuple(ids)
    return tuple(ids[:HEAD_TOKENS]) + tuple(ids[-TAIL_TOKENS:])


class PromptViewer:
    """Cuts prompts of one tokenizer's chat format into ``PromptView``s."""

    def __init__(self, user_header: tuple[int, ...] | None) -> None:
        self.user_header = user_header  # marker id, then the role's ids; None: no chat format known

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer) -> PromptViewer:
        for header in _USER_HEADERS:
            ids = tokenizer.encode(header, add_special_tokens=False)
            # The marker must be one special token (decoding skips it), not plain text.
            if len(ids) > 1 and tokenizer.decode(ids[:1], skip_special_tokens=True) == "":
                return cls(tuple(ids))
        return cls(None)

    def view(self, prompt: list[int]) -> PromptView:
        """C-speed scans (``list.index`` on the reversed ids, ``list.count``): no Python
        loop over the tokens."""
        if self.user_header is None:
            return PromptView(len(prompt), 0, len(prompt), _excerpt(prompt))
        marker, rest = self.user_header[0], list(self.user_header[1:])
        reverse = prompt[::-1]
        start, end, j = 0, len(prompt), 0
        while True:
            try:
                j = reverse.index(marker, j)
            except ValueError:  # no user turn: the whole prompt up to the first later turn
                break
            i = len(prompt) - 1 - j
            if prompt[i + 1:i + 1 + len(rest)] == rest:
                start = i + len(self.user_header)
                break
            end = i  # a later turn (the generation prompt, an assistant answer) ends the user turn
            j += 1
        turn = prompt[start:end]
        return PromptView(len(prompt), prompt.count(marker), len(turn), _excerpt(turn))
