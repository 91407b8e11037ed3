"""``--share-ratio k`` (MemServe Fig. 15): every session of the workload is replayed k
times as distinct sessions with identical turns, in a seeded, shuffled order."""

from __future__ import annotations

from memserve.workload.dataset import (
    TextCorpus,
    default_sharegpt_path,
    load_conversations,
)
from memserve.workload.tokens import HeuristicTokenCounter
from memserve.workload.workloads import Session, WorkloadSpec, build_workload


def sessions(share_ratio: int) -> list[Session]:
    conversations = load_conversations(default_sharegpt_path())
    spec = WorkloadSpec("long-doc-qa", 5, seed=1, doc_len=64, share_ratio=share_ratio)
    return build_workload(spec, conversations, TextCorpus(conversations, HeuristicTokenCounter()))[0]


def test_a_share_ratio_replays_every_session_as_distinct_sessions():
    once, thrice = sessions(1), sessions(3)
    assert len(thrice) == 15 and len({s.session_id for s in thrice}) == 15
    grouped = []
    for s in once:
        copies = [c for c in thrice if c.session_id.split("~")[0] == s.session_id]
        assert len(copies) == 3 and all(c.turns == s.turns and c.system == s.system for c in copies)
        grouped += copies
    assert thrice != grouped  # copies are interleaved, not replayed back to back
    assert sessions(3) == thrice
