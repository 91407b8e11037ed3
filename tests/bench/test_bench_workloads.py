"""Workload generation (seeded, shaped as asked) and the replay loop's ordering rules."""

from __future__ import annotations

import asyncio
import json
import random
import statistics

import pytest

from memserve.bench.client import RequestSpec
from memserve.bench.runner import Replayer
from memserve.workload.dataset import (
    DEFAULT_SHAREGPT,
    TextCorpus,
    default_sharegpt_path,
    load_conversations,
)
from memserve.workload.records import RequestRecord
from memserve.workload.replay import ReplayOptions, arrival_offsets
from memserve.workload.tokens import HeuristicTokenCounter, TokenizerTokenCounter
from memserve.workload.workloads import (
    LengthDist,
    Session,
    Turn,
    WorkloadSpec,
    build_workload,
)

COUNTER = HeuristicTokenCounter()


@pytest.fixture(scope="module")
def conversations():
    return load_conversations(DEFAULT_SHAREGPT)


@pytest.fixture(scope="module")
def corpus(conversations):
    return TextCorpus(conversations, COUNTER)


def build(conversations, corpus, **kw) -> list[list[Session]]:
    return build_workload(WorkloadSpec(**kw), conversations, corpus)


@pytest.mark.parametrize("name", ["sharegpt", "shared-prefix", "long-doc-qa", "random"])
def test_same_seed_same_sessions_other_seed_other_sessions(conversations, corpus, name):
    kw = dict(name=name, num_sessions=5, prefix_len=64, doc_len=128, input_len=LengthDist.parse("uniform:10:50"))
    first, again = build(conversations, corpus, seed=3, **kw), build(conversations, corpus, seed=3, **kw)
    assert first == again
    assert build(conversations, corpus, seed=4, **kw) != first
    # a sweep's first part is the single run; its parts share no text
    parts = build(conversations, corpus, seed=3, parts=3, **kw)
    assert parts[0] == first[0] and [len(p) for p in parts] == [5, 5, 5]
    texts = [{(s.system, t.user) for s in part for t in s.turns} for part in parts]
    assert not (texts[0] & texts[1]) and not (texts[1] & texts[2])
    assert len({s.session_id for part in parts for s in part}) == 15


def test_sharegpt_sessions_follow_the_recorded_conversations(conversations, corpus):
    (sessions,) = build(conversations, corpus, name="sharegpt", num_sessions=20, max_turns=3,
                        max_session_tokens=3000)
    by_id = {f"sharegpt-{c.id}": c for c in conversations}
    for s in sessions:
        conv = by_id[s.session_id]
        assert 1 <= len(s.turns) <= 3
        for turn, (user, answer) in zip(s.turns, conv.exchanges):
            assert turn.user == user and turn.recorded_answer == answer
            assert turn.output_len == COUNTER.count(answer)
        assert sum(COUNTER.count(t.user) + COUNTER.count(t.recorded_answer or "") for t in s.turns) <= 3000
    with pytest.raises(ValueError, match="usable conversations"):
        build(conversations, corpus, name="sharegpt", num_sessions=len(conversations) + 1)


def test_shared_prefix_shape(conversations, corpus):
    (sessions,) = build(conversations, corpus, name="shared-prefix", num_sessions=9, num_prefixes=3,
                        prefix_len=200, input_len=LengthDist.parse("40"), output_len=LengthDist.parse("17"))
    prefixes = [s.system for s in sessions]
    assert len(set(prefixes)) == 3 and prefixes[:3] == prefixes[3:6] == prefixes[6:]
    header = len("You are a helpful assistant. Reference material #0:\n")
    assert all(len(p) == header + 200 * 4 for p in prefixes)  # heuristic: 4 chars per token
    assert all(len(s.turns) == 1 and COUNTER.count(s.turns[0].user) == 40 for s in sessions)
    assert all(s.turns[0].output_len == 17 for s in sessions)
    assert len({s.turns[0].user for s in sessions}) == 9


def test_long_doc_qa_shape(conversations, corpus):
    (sessions,) = build(conversations, corpus, name="long-doc-qa", num_sessions=3, doc_len=300,
                        questions_per_doc=4, output_len=LengthDist.parse("16"))
    for s in sessions:
        assert len(s.turns) == 4
        first = s.turns[0].user
        doc = first.split("\n\n", 1)[1].rsplit("\n\nQuestion 1:", 1)[0]
        assert len(doc) == 300 * 4
        for k, t in enumerate(s.turns, 1):
            assert f"Question {k}:" in t.user and t.output_len == 16
            phrase = t.user.split('"')[1]
            assert phrase and phrase in " ".join(doc.split())
        assert all(doc not in t.user for t in s.turns[1:])  # later turns rely on the history
    assert len({s.turns[0].user for s in sessions}) == 3
    (capped,) = build(conversations, corpus, name="long-doc-qa", num_sessions=1, doc_len=50, max_turns=2)
    assert len(capped[0].turns) == 2


def test_random_lengths_follow_the_distributions(conversations, corpus):
    (sessions,) = build(conversations, corpus, name="random", num_sessions=200, seed=1,
                        input_len=LengthDist.parse("uniform:20:60"), output_len=LengthDist.parse("exp:50"))
    inputs = [COUNTER.count(s.turns[0].user) for s in sessions]
    outputs = [s.turns[0].output_len for s in sessions]
    assert min(inputs) >= 20 and max(inputs) <= 60 and len(set(inputs)) > 20
    assert 40 < statistics.mean(outputs) < 60 and min(outputs) >= 1


def test_length_dist_parsing():
    rng = random.Random(0)
    assert LengthDist.parse("12").sample(rng) == 12
    assert 1 <= LengthDist.parse("normal:3:100").sample(rng)
    for bad in ("x", "uniform:5:1", "normal:1", "gamma:1:2"):
        with pytest.raises(ValueError):
            LengthDist.parse(bad)


def test_dataset_loading_cuts_at_bad_messages_and_env_override(tmp_path, monkeypatch):
    path = tmp_path / "d.jsonl"
    rows = [
        {"id": "ok", "messages": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
                                  {"role": "user", "content": "  "}, {"role": "assistant", "content": "a2"}]},
        {"id": "empty", "messages": [{"role": "assistant", "content": "a"}]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (conv,) = load_conversations(path)
    assert conv.id == "ok" and conv.exchanges == [("q1", "a1")]
    monkeypatch.setenv("MEMSERVE_DATA", str(tmp_path))
    assert default_sharegpt_path() == tmp_path / "sharegpt-sample.jsonl"
    monkeypatch.delenv("MEMSERVE_DATA")
    assert default_sharegpt_path() == DEFAULT_SHAREGPT and DEFAULT_SHAREGPT.is_file()


def test_tokenizer_counter_counts_and_cuts_in_real_tokens(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "again": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    counter = TokenizerTokenCounter(str(tmp_path))
    assert counter.count("hello world again hello") == 4
    assert counter.truncate("hello world again hello", 2) == "hello world"


class FakeClient:
    """Stands in for the HTTP client: answers each request after ``latency`` seconds with
    an answer naming its session and turn, and logs the order of events."""

    def __init__(self, latency: float = 0.01, fail_status: str | None = None):
        self.latency, self.fail_status = latency, fail_status
        self.specs: list[RequestSpec] = []
        self.events: list[tuple[str, str, int]] = []
        self.in_flight = self.max_in_flight = 0

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    async def send(self, spec: RequestSpec) -> RequestRecord:
        self.specs.append(spec)
        self.events.append(("start", spec.session_id, spec.turn))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        start = self.now()
        try:
            await asyncio.sleep(self.latency)
        finally:
            self.in_flight -= 1
        self.events.append(("end", spec.session_id, spec.turn))
        if self.fail_status:
            return RequestRecord(spec.session_id, spec.turn, start, end=self.now(), status=self.fail_status)
        r = RequestRecord(spec.session_id, spec.turn, start, end=self.now(), chunk_times=[self.now()],
                          chunk_tokens=[1], completion_tokens=1)
        r.output_text = f"actual answer {spec.session_id}/{spec.turn}"
        return r


def sessions_of(n: int, turns: int) -> list[Session]:
    return [
        Session(f"s{i}", tuple(Turn(f"question {i}/{k}", recorded_answer=f"recorded {i}/{k}", output_len=5)
                               for k in range(1, turns + 1)), system="sys")
        for i in range(n)
    ]


def test_turns_wait_for_the_previous_answer_and_carry_it():
    client = FakeClient()
    result = asyncio.run(Replayer(client, ReplayOptions(max_tokens=9)).run(sessions_of(3, 3)))
    assert len(result.records) == 9 and all(r.ok for r in result.records)
    for spec in client.specs:
        assert spec.messages[0] == {"role": "system", "content": "sys"} and spec.max_tokens == 9
        assert spec.messages[-1]["content"] == f"question {spec.session_id[1:]}/{spec.turn}"
        if spec.turn > 1:
            assert spec.messages[-2] == {"role": "assistant",
                                         "content": f"actual answer {spec.session_id}/{spec.turn - 1}"}
            assert len(spec.messages) == 2 * spec.turn
            # sent only after the previous turn's answer arrived
            start = client.events.index(("start", spec.session_id, spec.turn))
            assert client.events.index(("end", spec.session_id, spec.turn - 1)) < start


def test_fixed_output_len_replays_recorded_answers():
    client = FakeClient()
    asyncio.run(Replayer(client, ReplayOptions(fixed_output_len=True)).run(sessions_of(1, 2)))
    last = client.specs[-1]
    assert last.fixed_output_len and last.max_tokens == 5
    assert last.messages[-2]["content"] == "recorded 0/1"


def test_concurrency_cap_and_duration():
    client = FakeClient(latency=0.02)
    asyncio.run(Replayer(client, ReplayOptions(concurrency=2)).run(sessions_of(6, 1)))
    assert client.max_in_flight == 2 and len(client.specs) == 6
    client = FakeClient(latency=0.1)
    result = asyncio.run(Replayer(client, ReplayOptions(duration_s=0.25)).run(sessions_of(2, 10)))
    # every turn takes 100 ms: turns starting at 0, 100 and 200 ms go, the one at 300 ms does not
    assert len(result.records) == 6 and not result.interrupted


def test_first_error_aborts_but_overload_statuses_do_not():
    result = asyncio.run(Replayer(FakeClient(fail_status="404"), ReplayOptions()).run(sessions_of(5, 3)))
    assert result.aborted and "404" in result.aborted and not result.interrupted
    result = asyncio.run(Replayer(FakeClient(fail_status="429"), ReplayOptions()).run(sessions_of(5, 3)))
    assert result.aborted is None and len(result.records) == 5  # each session ends at its failed turn


def test_halt_cancels_in_flight_and_keeps_finished():
    async def scenario():
        client = FakeClient(latency=0.1)
        replayer = Replayer(client, ReplayOptions(concurrency=1))
        task = asyncio.create_task(replayer.run(sessions_of(10, 1)))
        await asyncio.sleep(0.25)
        replayer.halt()
        return await task

    result = asyncio.run(scenario())
    assert result.interrupted and result.cancelled == 1 and len(result.records) == 2


def test_poisson_arrivals():
    times = arrival_offsets(2001, 4.0, random.Random(0))
    assert times[0] == 0.0 and times == sorted(times)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.1)
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.15)  # exponential: stdev = mean
    assert arrival_offsets(3, float("inf"), random.Random(0)) == [0.0, 0.0, 0.0]
    assert arrival_offsets(5, 2.0, random.Random(1)) == arrival_offsets(5, 2.0, random.Random(1))
