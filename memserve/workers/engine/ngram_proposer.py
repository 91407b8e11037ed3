"""Draft tokens by prompt lookup (n-gram speculative decoding, vLLM's ``method: ngram``).

Chat answers and edits quote their context: when the last n tokens of a sequence occurred
earlier in it, the tokens that followed them then are a cheap guess of what follows now.
The scheduler appends such a guess (the draft) to a decoding request's next token; the
runner computes all of them in one forward pass and keeps the drafts the model agrees
with (its greedy choice, or for a request sampled by temperature, the token it samples
at that position, which makes this exact speculative sampling: ``sampler.py``), plus the
model's next token after them. A decode step on a CPU or GPU reads every weight whatever
the number of tokens, so each accepted draft is a token for nearly nothing; a rejected
one costs a few rows of compute.

The lookup is incremental: each sequence keeps a dictionary from every n-gram
(``min_n <= n <= max_n``) to the position after its latest occurrence, updated with the
tokens added since the last proposal, so a proposal costs a few dictionary lookups
however long the context is. The longest n-gram that matches wins, as in vLLM.

Drafts are not free once a step computes more rows than the hardware reads weights for
anyway (on a 2-core CPU, 16 decodes with 4 drafts each took 2.8x the step of 16 plain
decodes), and a request that is not quoting gets most of its drafts rejected. So each
request drafts only as deep as it is likely to be right: it keeps a decayed count of its
drafts kept and tried, and drafts the j-th token only while its estimated acceptance
rate a satisfies a**j >= ``MIN_DRAFT_ODDS``. A request whose drafts keep failing stops
drafting; its counts decay back toward the prior and it tries one draft again later.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memserve.ipc.messages import SamplingParams
from memserve.workers.engine.step_plan import ScheduledChunk, StepResult


@dataclass(frozen=True)
class NgramConfig:
    """vLLM's ``--speculative-config`` for ``method: ngram``: up to ``num_speculative_tokens``
    drafts, found after the longest earlier match of the last ``prompt_lookup_max`` down to
    ``prompt_lookup_min`` tokens. ``per_batch_size`` (vLLM's
    ``num_speculative_tokens_per_batch_size``): inclusive ranges of running requests
    ``(first, last, k)`` with at most k drafts each, sorted, the first starting at 1; a batch
    size past a range takes the k of the range before it."""

    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    per_batch_size: tuple[tuple[int, int, int], ...] = ()

    @classmethod
    def from_dict(cls, d: dict) -> NgramConfig:
        """vLLM's JSON; anything but ``method: ngram`` and these keys is refused by name."""
        d = dict(d)
        method = d.pop("method", None)
        if method != "ngram":
            raise ValueError(f"speculative method {method!r} is not supported; memserve drafts by 'ngram'")
        known = {"num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                 "num_speculative_tokens_per_batch_size"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown speculative-config keys {unknown}; expected some of {sorted(known)}")
        if "num_speculative_tokens" not in d:
            raise ValueError("speculative-config needs num_speculative_tokens")
        bad_ranges = ValueError("num_speculative_tokens_per_batch_size needs non-overlapping [first, last, k] "
                                "ranges of batch sizes, the first starting at 1, with k >= 0")
        ranges: list[tuple[int, int, int]] = []
        for entry in d.pop("num_speculative_tokens_per_batch_size", None) or []:
            if not isinstance(entry, (list, tuple)) or len(entry) != 3:
                raise bad_ranges
            first, last, k = (int(x) for x in entry)
            ranges.append((first, last, k))
        ranges.sort()
        if ranges and (ranges[0][0] != 1 or any(r[0] > r[1] or r[2] < 0 for r in ranges)
                       or any(a[1] >= b[0] for a, b in zip(ranges, ranges[1:]))):
            raise bad_ranges
        cfg = cls(**{k: int(v) for k, v in d.items()}, per_batch_size=tuple(ranges))
        if cfg.num_speculative_tokens < 1 or not 1 <= cfg.prompt_lookup_min <= cfg.prompt_lookup_max:
            raise ValueError("speculative-config needs num_speculative_tokens >= 1 and "
                             "1 <= prompt_lookup_min <= prompt_lookup_max")
        return cfg

    def max_drafts(self, batch_size: int) -> int:
        """The most drafts a request takes in a step of ``batch_size`` running requests."""
        k = self.num_speculative_tokens
        for first, _, range_k in self.per_batch_size:
            if first > batch_size:
                break
            k = min(self.num_speculative_tokens, range_k)
        return k


def can_draft(params: SamplingParams) -> bool:
    """Whether drafts for a request with ``params`` can be verified exactly from its rows'
    logits alone: greedy (the argmax), or sampled by temperature alone (a draft is kept
    when it equals its row's draw, ``sampler.py``); one choice, and nothing that looks at
    or reshapes the logits (top-k or top-p filters, log-probabilities, penalties, biases,
    a minimum length, a grammar)."""
    return ((params.greedy or (params.top_k == 0 and params.top_p >= 1.0)) and params.n == 1
            and params.logprobs is None and params.grammar is None and not params.logit_bias
            and params.min_tokens == 0 and params.presence_penalty == 0.0 and params.frequency_penalty == 0.0
            and params.repetition_penalty == 1.0)


# A draft token is proposed when the request's estimated chance of keeping it (its
# acceptance rate to the power of the draft's depth) is at least this.
MIN_DRAFT_ODDS = 0.5
# Weight of a request's earlier drafts in its acceptance rate, per step that drafts or could.
DRAFT_MEMORY = 0.8


@dataclass(slots=True)
class NgramIndex:
    """One sequence's n-grams: ``ends[gram]`` is the position just after the latest
    occurrence of ``gram`` among the first ``indexed`` tokens; and its drafts' record:
    decayed counts of drafts kept and of drafts tried (a draft after a rejected one is not
    tried)."""

    ends: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0
    kept: float = 0.0
    tried: float = 0.0

    @property
    def acceptance(self) -> float:
        """Estimated chance that a draft is kept, given those before it were: the record
        plus a prior of 2 kept out of 3 tried, above ``MIN_DRAFT_ODDS`` so that a request
        with no (or a faded) record drafts one token."""
        return (self.kept + 2.0) / (self.tried + 3.0)

    def record(self, num_drafts: int, num_kept: int) -> None:
        """A step verified ``num_drafts`` drafts and kept the first ``num_kept``."""
        self.kept = DRAFT_MEMORY * self.kept + num_kept
        self.tried = DRAFT_MEMORY * self.tried + num_kept + (num_kept < num_drafts)


class NgramProposer:
    def __init__(self, config: NgramConfig) -> None:
        self.config = config

    def propose(self, index: NgramIndex, tokens: list[int], limit: int) -> list[int]:
        """Up to ``limit`` tokens that followed the latest earlier occurrence of the
        longest matching suffix of ``tokens`` (fewer while the request's drafts are
        seldom kept), and at most ``num_speculative_tokens``; [] for none."""
        cfg = self.config
        limit = min(limit, cfg.num_speculative_tokens)
        n_tokens = len(tokens)
        if limit <= 0 or n_tokens <= cfg.prompt_lookup_min:
            return []
        self._index(index, tokens, n_tokens)  # every n-gram but the suffix itself
        ends = index.ends
        for n in range(min(cfg.prompt_lookup_max, n_tokens - 1), cfg.prompt_lookup_min - 1, -1):
            end = ends.get(tuple(tokens[n_tokens - n:]))
            if end is not None:
                depth = _depth(index.acceptance, limit)
                if depth == 0:  # a guess it would likely lose: forget a little of why
                    index.record(0, 0)
                return tokens[end:end + depth]
        return []

    def _index(self, index: NgramIndex, tokens: list[int], upto: int) -> None:
        """Record the n-grams that end just before positions [index.indexed, upto)."""
        lo, hi, ends = self.config.prompt_lookup_min, self.config.prompt_lookup_max, index.ends
        for end in range(max(index.indexed, lo), upto):
            for n in range(lo, min(hi, end) + 1):
                ends[tuple(tokens[end - n:end])] = end
        index.indexed = max(index.indexed, upto)


def _depth(acceptance: float, limit: int) -> int:
    """How many drafts have at least ``MIN_DRAFT_ODDS`` of being kept, at most ``limit``."""
    depth, odds = 0, acceptance
    while depth < limit and odds >= MIN_DRAFT_ODDS:
        depth += 1
        odds *= acceptance
    return depth


def draft_rows(chunks: list[ScheduledChunk]) -> list[tuple[int, ScheduledChunk]]:
    """(first row, chunk) of each chunk with drafts among a step's sampled rows, where each
    sampling chunk has one row per draft plus its last, in chunk order."""
    rows: list[tuple[int, ScheduledChunk]] = []
    row = 0
    for chunk in chunks:
        if chunk.sample:
            if chunk.num_drafts:
                rows.append((row, chunk))
            row += 1 + chunk.num_drafts
    return rows


def accept_drafts(chunks: list[ScheduledChunk], tokens: list[int], result: StepResult) -> None:
    """Set the next token of the chunks that carry drafts in ``result``. ``tokens`` holds
    the token the model chose after each sampled row (``draft_rows``). A chunk's drafts
    are kept up to the first that differs from the token chosen after the row before it;
    the token chosen after the last one kept is the request's next token. The choices are
    the greedy argmax, or for a sampled request the sampler's draw at each position."""
    for first, chunk in draft_rows(chunks):
        chosen = tokens[first:first + 1 + chunk.num_drafts]
        drafts = chunk.token_ids[len(chunk.token_ids) - chunk.num_drafts:]
        kept = 0
        while kept < len(drafts) and drafts[kept] == chosen[kept]:
            kept += 1
        result.sampled[chunk.request_id] = chosen[kept]
        if kept:
            result.accepted_drafts[chunk.request_id] = drafts[:kept]
