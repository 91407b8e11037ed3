"""Benchmark workloads: seeded lists of sessions, each a list of turns.

Every workload is a list of :class:`Session`. Single-turn workloads (``shared-prefix``,
``random``) are sessions of one turn, so one replay loop serves all of them. A session
holds only what the *user* says and what the recorded answer was; the history sent with
turn k+1 is built at run time from the answer turn k actually got (see ``runner``).

- ``sharegpt``: real multi-turn conversations, sampled without replacement.
- ``shared-prefix``: N requests sharing one (or a few) system prompts of a given length.
- ``long-doc-qa``: LooGLE-like sessions, a document of D tokens followed by Q questions
  about it, synthesised from the ShareGPT text.
- ``random``: prompts and target output lengths drawn from length distributions.

Lengths are in tokens as measured by a :class:`~memserve.workload.tokens.TokenCounter`.
The same seed gives the same sessions, in the same order, on every machine.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from memserve.workload.dataset import Conversation, TextCorpus

WORKLOADS = ("sharegpt", "shared-prefix", "long-doc-qa", "random")
MULTI_TURN_WORKLOADS = ("sharegpt", "long-doc-qa")


@dataclass(frozen=True)
class Turn:
    user: str
    recorded_answer: str | None = None  # replayed as history with --fixed-output-len
    output_len: int | None = None  # target output tokens for --fixed-output-len


@dataclass(frozen=True)
class Session:
    session_id: str
    turns: tuple[Turn, ...]
    system: str | None = None


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution written as ``N`` (fixed), ``uniform:LO:HI``,
    ``normal:MEAN:STD`` or ``exp:MEAN``; samples are integers >= 1."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> "LengthDist":
        parts = str(spec).split(":")
        try:
            if len(parts) == 1:
                return cls("fixed", float(parts[0]))
            name, args = parts[0], [float(x) for x in parts[1:]]
        except ValueError:
            raise ValueError(f"bad length distribution {spec!r}") from None
        if name == "uniform" and len(args) == 2 and args[0] <= args[1]:
            return cls("uniform", args[0], args[1])
        if name == "normal" and len(args) == 2:
            return cls("normal", args[0], args[1])
        if name == "exp" and len(args) == 1:
            return cls("exp", args[0])
        raise ValueError(
            f"bad length distribution {spec!r}: use N, uniform:LO:HI, normal:MEAN:STD or exp:MEAN"
        )

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            value = self.a
        elif self.kind == "uniform":
            value = rng.uniform(self.a, self.b)
        elif self.kind == "normal":
            value = rng.gauss(self.a, self.b)
        else:
            value = rng.expovariate(1.0 / self.a)
        return max(1, round(value))


@dataclass
class WorkloadSpec:
    """Everything that shapes a workload; the CLI fills it from its options."""

    name: str
    num_sessions: int
    seed: int = 0
    max_turns: int | None = None
    max_session_tokens: int | None = None  # sharegpt: skip conversations longer than this
    prefix_len: int = 1024  # shared-prefix
    num_prefixes: int = 1  # shared-prefix
    doc_len: int = 2048  # long-doc-qa
    questions_per_doc: int = 4  # long-doc-qa
    input_len: LengthDist = field(default_factory=lambda: LengthDist("fixed", 128))
    output_len: LengthDist = field(default_factory=lambda: LengthDist("fixed", 128))
    parts: int = 1  # disjoint copies sharing no text (one per sweep point, so caches stay cold)
    share_ratio: int = 1  # every session replayed this many times, as distinct sessions (MemServe Fig. 15)

    @property
    def total_sessions(self) -> int:
        return self.num_sessions * self.parts


def build_workload(
    spec: WorkloadSpec, conversations: list[Conversation], corpus: TextCorpus
) -> list[list[Session]]:
    """``spec.parts`` lists of ``spec.num_sessions`` sessions each; part 0 is the same
    for any number of parts, so a sweep's first point equals a single run."""
    if spec.name not in WORKLOADS:
        raise ValueError(f"unknown workload {spec.name!r}; choose from {', '.join(WORKLOADS)}")
    if spec.num_sessions < 1 or spec.parts < 1:
        raise ValueError("the workload needs at least one session/request")
    rng = random.Random(f"{spec.name}:{spec.seed}")
    if spec.name == "sharegpt":
        sessions = sharegpt_sessions(spec, conversations, corpus, rng)
    elif spec.name == "shared-prefix":
        sessions = shared_prefix_sessions(spec, corpus, rng)
    elif spec.name == "long-doc-qa":
        sessions = long_doc_qa_sessions(spec, corpus, rng)
    else:
        sessions = random_sessions(spec, corpus, rng)
    n = spec.num_sessions
    return [shared(sessions[p * n : (p + 1) * n], spec.share_ratio, spec.seed) for p in range(spec.parts)]


def shared(sessions: list[Session], share_ratio: int, seed: int) -> list[Session]:
    """Each session ``share_ratio`` times (copy j > 0 named ``<id>~j``, so session-ID
    routing sees different sessions with identical prompts), in a seeded shuffled order."""
    if share_ratio < 1:
        raise ValueError("the share ratio must be >= 1")
    if share_ratio == 1:
        return sessions
    copies = [s if j == 0 else Session(f"{s.session_id}~{j}", s.turns, s.system)
              for s in sessions for j in range(share_ratio)]
    random.Random(f"share:{seed}:{share_ratio}").shuffle(copies)
    return copies


def sharegpt_sessions(
    spec: WorkloadSpec, conversations: list[Conversation], corpus: TextCorpus, rng: random.Random
) -> list[Session]:
    """Sample conversations without replacement (a shuffled order, so a larger sample
    extends a smaller one with the same seed)."""
    count = corpus.counter.count
    order = list(range(len(conversations)))
    rng.shuffle(order)
    sessions: list[Session] = []
    for idx in order:
        conv = conversations[idx]
        exchanges = conv.exchanges[: spec.max_turns] if spec.max_turns else conv.exchanges
        if spec.max_session_tokens is not None:
            total = sum(count(u) + count(a or "") for u, a in exchanges)
            if total > spec.max_session_tokens:
                continue
        turns = tuple(
            Turn(user=u, recorded_answer=a, output_len=max(1, count(a)) if a else None) for u, a in exchanges
        )
        sessions.append(Session(session_id=f"sharegpt-{conv.id}", turns=turns))
        if len(sessions) == spec.total_sessions:
            return sessions
    raise ValueError(
        f"the dataset has only {len(sessions)} usable conversations for {spec.total_sessions} sessions"
        + (f" under --max-session-tokens {spec.max_session_tokens}" if spec.max_session_tokens else "")
    )


def shared_prefix_sessions(spec: WorkloadSpec, corpus: TextCorpus, rng: random.Random) -> list[Session]:
    """Request i of a part uses prefix ``i % num_prefixes`` of that part's own prefixes."""
    sessions = []
    for part in range(spec.parts):
        prefixes = [
            f"You are a helpful assistant. Reference material #{g}:\n" + corpus.passage(rng, spec.prefix_len)
            for g in range(spec.num_prefixes)
        ]
        for i in range(spec.num_sessions):
            turn = _synthetic_turn(spec, corpus, rng)
            sid = f"shared-prefix-{part * spec.num_sessions + i}"
            sessions.append(Session(session_id=sid, system=prefixes[i % spec.num_prefixes], turns=(turn,)))
    return sessions


def random_sessions(spec: WorkloadSpec, corpus: TextCorpus, rng: random.Random) -> list[Session]:
    return [
        Session(session_id=f"random-{i}", turns=(_synthetic_turn(spec, corpus, rng),))
        for i in range(spec.total_sessions)
    ]


def long_doc_qa_sessions(spec: WorkloadSpec, corpus: TextCorpus, rng: random.Random) -> list[Session]:
    """Turn 1 carries the document and the first question; later turns ask about
    phrases quoted from the same document, so every turn re-reads it from history."""
    sessions = []
    num_questions = min(spec.questions_per_doc, spec.max_turns or spec.questions_per_doc)
    for i in range(spec.total_sessions):
        doc = corpus.passage(rng, spec.doc_len)
        words = doc.split() or ["document"]
        turns = []
        for q in range(num_questions):
            start = rng.randrange(len(words))
            phrase = " ".join(words[start : start + 6])
            question = f'Question {q + 1}: what does the document say about "{phrase}"? Answer briefly.'
            user = f"Read the following document.\n\n{doc}\n\n{question}" if q == 0 else question
            turns.append(Turn(user=user, output_len=spec.output_len.sample(rng)))
        sessions.append(Session(session_id=f"long-doc-qa-{i}", turns=tuple(turns)))
    return sessions


def _synthetic_turn(spec: WorkloadSpec, corpus: TextCorpus, rng: random.Random) -> Turn:
    input_len = spec.input_len.sample(rng)
    return Turn(user=corpus.passage(rng, input_len), output_len=spec.output_len.sample(rng))
