"""The bootstrap table: output lengths the served model produced for ShareGPT prompts
(written once by ``scripts/predictor_dataset``).

Line 1 is a header naming the model, the fingerprint of its tokenizer and how the
lengths were generated; every other line is one prompt's ``PromptView`` and its output
length. Views hold token ids, so the table only fits a model with the same tokenizer:
the gateway checks the fingerprint before training on it."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from memserve.predictor.prompt_view import PromptView

DEFAULT_TABLE = Path(__file__).resolve().parent / "data" / "smollm2-135m-sharegpt.jsonl"


def tokenizer_fingerprint(model_dir: Path) -> str:
    """Digest of ``tokenizer.json``: equal fingerprints give equal token ids."""
    return hashlib.sha256((Path(model_dir) / "tokenizer.json").read_bytes()).hexdigest()[:16]


@dataclass(frozen=True)
class Example:
    line: int  # of the ShareGPT file
    turn: int  # the prompt ends with this user turn (1 = first turn)
    view: PromptView
    output_tokens: int
    finish_reason: str  # "stop" or "length" (cut at the table's max_tokens)


@dataclass(frozen=True)
class Table:
    header: dict
    examples: list[Example]

    @property
    def max_tokens(self) -> int:
        return int(self.header["max_tokens"])


def sharegpt_conversations(path: Path) -> dict[int, list[dict]]:
    """Messages of each conversation by 1-based line of the ShareGPT file, cut before the
    first empty or out-of-order message (as ``memserve.workload.dataset`` does). The prompt
    of a table row is ``messages[:2 * turn - 1]``."""
    out = {}
    for line_no, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        messages = []
        for i, m in enumerate(json.loads(line)["messages"]):
            role = "user" if i % 2 == 0 else "assistant"
            if m.get("role") != role or not str(m.get("content", "")).strip():
                break
            messages.append({"role": role, "content": m["content"]})
        if messages:
            out[line_no] = messages
    return out


def load_table(path: Path = DEFAULT_TABLE) -> Table:
    with Path(path).open(encoding="utf-8") as f:
        header = json.loads(f.readline())
        examples = []
        for line in f:
            row = json.loads(line)
            examples.append(Example(row["line"], row["turn"], PromptView.from_dict(row), row["output_tokens"],
                                    row["finish_reason"]))
    return Table(header, examples)
