"""The gateway's output-length predictor: prompt views, features, Hoeffding padding,
arrival rate, online learning, the bootstrap table, and AddRequest through the engine
client."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from memserve.gateway.engine_client import ZmqEngineClient
from memserve.ipc.messages import AddRequest, RequestOutput, SamplingParams
from memserve.predictor.arrival_rate import ArrivalRate
from memserve.predictor.dataset import DEFAULT_TABLE, load_table, tokenizer_fingerprint
from memserve.predictor.features import FeatureExtractor, FeatureSet
from memserve.predictor.length_model import LengthModel, bucket_of
from memserve.predictor.online import OnlineLearner
from memserve.predictor.padding import (
    PaddingConfig,
    hoeffding_padding,
    padded_length,
    rate_confidence,
)
from memserve.predictor.predictor import Predictor, PredictorConfig
from memserve.predictor.prompt_view import (
    HEAD_TOKENS,
    TAIL_TOKENS,
    PromptView,
    PromptViewer,
)
from memserve.text.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[2]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# ---------------------------------------------------------------- prompt views and features
def test_view_finds_the_last_user_turn(tokenizer: Tokenizer) -> None:
    viewer = PromptViewer.for_tokenizer(tokenizer)
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Hello there"},
                                    {"role": "assistant", "content": "Hi!"},
                                    {"role": "user", "content": "Write a poem about the sea"}])
    view = viewer.view(prompt)
    assert view.prompt_tokens == len(prompt)
    assert view.turn_markers == 5  # system, user, assistant, user, generation prompt
    assert "Write a poem about the sea" in tokenizer.decode(list(view.excerpt))
    assert "Hello" not in tokenizer.decode(list(view.excerpt))
    assert view.last_turn_tokens == len(view.excerpt)


def test_view_excerpts_a_long_turn_head_and_tail(tokenizer: Tokenizer) -> None:
    viewer = PromptViewer.for_tokenizer(tokenizer)
    words = " ".join(f"w{i}" for i in range(400))
    view = viewer.view(tokenizer.encode_chat([{"role": "user", "content": f"START {words} FINISH"}]))
    assert len(view.excerpt) == HEAD_TOKENS + TAIL_TOKENS < view.last_turn_tokens
    text = tokenizer.decode(list(view.excerpt))
    assert "START" in text and "FINISH" in text and "w200" not in text


def test_view_of_plain_text_is_the_whole_prompt(tokenizer: Tokenizer) -> None:
    viewer = PromptViewer.for_tokenizer(tokenizer)
    ids = tokenizer.encode("Once upon a time", add_special_tokens=False)
    assert viewer.view(ids) == PromptView(len(ids), 0, len(ids), tuple(ids))


_FEATURES_SCRIPT = """
import json, sys
from memserve.predictor.features import FeatureExtractor, FeatureSet
from memserve.predictor.prompt_view import PromptView
view = PromptView(300, 5, 40, tuple(range(100, 140)))
print(json.dumps(FeatureExtractor(FeatureSet(False, 256), None).vector(view).tolist()))
"""


def test_features_are_deterministic_across_processes() -> None:
    """No salted ``hash()``: the bootstrap table's features equal the gateway's."""
    runs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO)}
        out = subprocess.run([sys.executable, "-c", _FEATURES_SCRIPT], env=env, check=True, capture_output=True,
                             text=True)
        runs.append(json.loads(out.stdout))
    assert runs[0] == runs[1]
    here = FeatureExtractor(FeatureSet(False, 256), None).vector(PromptView(300, 5, 40, tuple(range(100, 140))))
    assert np.allclose(here, runs[0])
    ngrams = here[4:]
    assert math.isclose(float(np.linalg.norm(ngrams)), 1.0, rel_tol=1e-6) and np.count_nonzero(ngrams) > 40


def test_embedding_feature_is_the_mean_of_the_models_rows(model_dir: Path) -> None:
    from safetensors.numpy import load_file

    from memserve.predictor.embeddings import TokenEmbeddings

    embeddings = TokenEmbeddings.from_model_dir(model_dir)
    table = load_file(str(model_dir / "model.safetensors"))["model.embed_tokens.weight"]
    ids = np.array([5, 17, 17, 2000])
    assert np.allclose(embeddings.mean(ids), table[ids].mean(axis=0))
    assert np.array_equal(embeddings.mean(np.array([], dtype=np.int64)), np.zeros(embeddings.dim, np.float32))


# ---------------------------------------------------------------- padding and arrival rate
def test_hoeffding_padding_hand_computed() -> None:
    # t = sqrt(-(b-a)^2/2 * ln(1-c)): 64 * sqrt(ln(10)/2) = 68.671; 50 * sqrt(ln(2)/2) = 29.435
    assert hoeffding_padding(64, 0.9) == pytest.approx(68.671, abs=1e-3)
    assert hoeffding_padding(50, 0.5) == pytest.approx(29.435, abs=1e-3)
    assert hoeffding_padding(64, 0.0) == 0.0
    with pytest.raises(ValueError):
        hoeffding_padding(64, 1.0)


def test_confidence_falls_with_the_arrival_rate() -> None:
    cfg = PaddingConfig()  # CacheOpt §5: confidence 90%, alpha 8, beta 100
    assert rate_confidence(0.0, cfg) == 0.9  # 8 / 1 capped at 0.9
    assert rate_confidence(0.1, cfg) == pytest.approx(8 / 11)
    assert rate_confidence(1.0, cfg) == pytest.approx(8 / 101)
    # At 1 req/s: 64 * sqrt(-ln(1 - 8/101) / 2) = 13.000 tokens.
    assert hoeffding_padding(64, rate_confidence(1.0, cfg)) == pytest.approx(13.000, abs=1e-3)


def test_padding_follows_the_deviation_direction() -> None:
    cfg = PaddingConfig()
    assert padded_length(100, 64, True, 0.0, cfg) == pytest.approx(168.671, abs=1e-3)
    assert padded_length(100, 64, False, 0.0, cfg) == pytest.approx(31.329, abs=1e-3)
    assert padded_length(10, 64, False, 0.0, cfg) == 1.0


def test_arrival_rate_sliding_window() -> None:
    clock = FakeClock()
    rate = ArrivalRate(clock, window_s=10.0, max_events=100)
    for t in range(5):
        clock.now = float(t)
        rate.arrive()
    assert rate.rate() == pytest.approx(0.5)
    clock.now = 12.5  # arrivals at 0, 1, 2 left the window
    assert rate.rate() == pytest.approx(0.2)


def test_arrival_rate_memory_is_bounded() -> None:
    clock = FakeClock()
    rate = ArrivalRate(clock, window_s=10.0, max_events=3)
    for t in (0.0, 0.1, 0.2, 0.3):
        clock.now = t
        rate.arrive()
    assert len(rate._times) == 3
    assert rate.rate() == pytest.approx(3 / 0.2)  # the kept span, not the 10 s window


# ---------------------------------------------------------------- learning
def _synthetic_predictor(refit_every: int = 16) -> tuple[Predictor, FakeClock]:
    clock = FakeClock()
    cfg = PredictorConfig(feature_set=FeatureSet(False, 64), refit_every=refit_every, capacity=256)
    return Predictor(PromptViewer(None), FeatureExtractor(cfg.feature_set, None), cfg, 512, clock), clock


def _serve(predictor: Predictor, prompt: list[int], length: int, count: int, start: int) -> None:
    """``count`` requests of ``prompt`` that each produce ``length`` tokens; refits inline."""
    for i in range(start, start + count):
        predictor.predict(f"r{i}", prompt, 512)
        if predictor.observe(f"r{i}", length, "stop"):
            predictor.refit()
        predictor.forget(f"r{i}")


def test_online_updates_move_predictions() -> None:
    predictor, _ = _synthetic_predictor()
    short_q, long_q = [7, 8, 9], list(range(1000, 1300))
    assert predictor.predict("first", short_q, 512) is None  # nothing learned yet: abstain
    predictor.forget("first")
    _serve(predictor, short_q, 20, 24, 0)
    _serve(predictor, long_q, 40, 24, 100)
    model = predictor.online.model
    x = predictor.extractor.vector(predictor.viewer.view(long_q))[None, :]
    before = float(model.predict(x)[0][0])
    assert before < 64
    _serve(predictor, long_q, 400, 64, 200)  # the traffic changes: long prompts now get long answers
    after = float(predictor.online.model.predict(x)[0][0])
    assert after > 200 > before
    assert predictor.online.num_refits >= 4 and predictor.stats()["observed"] == 112


def test_prediction_is_capped_by_max_tokens_and_padded() -> None:
    predictor, clock = _synthetic_predictor()
    _serve(predictor, [1, 2, 3], 300, 32, 0)
    clock.now = 1000.0  # the arrivals above left the 10 s window: this request alone, 0.1 req/s
    unpadded = float(predictor.online.model.predict(
        predictor.extractor.vector(predictor.viewer.view([1, 2, 3]))[None, :])[0][0])
    got = predictor.predict("x", [1, 2, 3], 512)
    assert abs(got - unpadded) == pytest.approx(hoeffding_padding(64, 8 / 11), abs=1.0)  # c = 8 / (1 + 100 * 0.1)
    assert predictor.predict("y", [1, 2, 3], 16) == 16


def test_cut_or_aborted_requests_are_not_labels() -> None:
    predictor, _ = _synthetic_predictor()
    predictor.predict("cut", [1, 2], 16)
    predictor.predict("abort", [1, 2], 512)
    predictor.predict("long", [1, 2], 1024)
    assert not predictor.observe("cut", 16, "length")  # the answer may have gone on
    assert not predictor.observe("abort", 3, "abort")
    predictor.observe("long", 700, "length")  # past the learned range: a label at max_length
    assert predictor.online.size == 1 and predictor.online._y[0] == 512
    assert not predictor.observe("unknown", 5, "stop")


def test_ring_buffer_keeps_memory_bounded() -> None:
    predictor, _ = _synthetic_predictor(refit_every=10_000)
    _serve(predictor, [4, 5, 6], 10, 300, 0)
    assert predictor.online.size == 256 and predictor.online._X.shape[0] == 256
    assert not predictor._pending  # forgotten once finished


def test_length_model_direction_and_buckets() -> None:
    rng = np.random.default_rng(0)
    X = rng.normal(size=(200, 3)).astype(np.float32)
    lengths = np.clip(250 + 80 * X[:, 0] + rng.normal(0, 10, 200), 1, 512)
    model = LengthModel("ridge", 64, 512).fit(X, lengths)
    pred, under = model.predict(X)
    assert np.all((pred >= 1) & (pred <= 512)) and under.dtype == bool
    assert np.mean(bucket_of(pred.round().astype(int), 64, 512) == bucket_of(lengths.astype(int), 64, 512)) > 0.8
    assert list(bucket_of(np.array([0, 63, 64, 511, 512]), 64, 512)) == [0, 0, 1, 7, 7]
    for i in range(10):  # the gateway's dot-product path equals sklearn's
        length, flag = model.predict_one(X[i])
        assert length == pytest.approx(pred[i], rel=1e-4) and flag == under[i]


def test_bucket_classifier_answers_the_bucket_median() -> None:
    X = np.array([[0.0], [0.1], [0.2], [5.0], [5.1], [5.2]] * 4)
    lengths = np.array([20, 30, 40, 512, 512, 512] * 4, dtype=float)
    pred, _ = LengthModel("bucket", 64, 512).fit(X, lengths).predict(np.array([[0.05], [5.05]]))
    assert list(pred) == [30.0, 512.0]


# ---------------------------------------------------------------- the bootstrap table
def test_table_loads_and_fits_the_default_model(model_dir: Path) -> None:
    table = load_table(DEFAULT_TABLE)
    assert table.header["tokenizer"] == tokenizer_fingerprint(model_dir)
    assert len(table.examples) >= 100
    assert all(1 <= e.output_tokens <= table.max_tokens for e in table.examples)
    assert {e.finish_reason for e in table.examples} <= {"stop", "length"}
    assert DEFAULT_TABLE.stat().st_size < 500_000


def test_bootstrapped_predictor_predicts_for_chat_prompts(model_dir: Path, tokenizer: Tokenizer) -> None:
    predictor = Predictor.for_model(model_dir, tokenizer)
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Write a long essay about the history of Rome."}])
    got = predictor.predict("a", prompt, 4096)
    assert got is not None and 1 <= got <= predictor.max_length + hoeffding_padding(64, 0.9)
    assert predictor.predict("b", prompt, 5) <= 5


def test_table_of_another_tokenizer_is_not_used(tmp_path: Path, model_dir: Path, tokenizer: Tokenizer) -> None:
    lines = DEFAULT_TABLE.read_text().splitlines()
    header = json.loads(lines[0]) | {"tokenizer": "0" * 16}
    other = tmp_path / "table.jsonl"
    other.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    predictor = Predictor.for_model(model_dir, tokenizer, table_path=other)
    assert predictor.online.model is None
    assert predictor.predict("a", tokenizer.encode_chat([{"role": "user", "content": "Hi"}]), 100) is None


# ---------------------------------------------------------------- through the engine client
class _ScriptedChannel:
    """Answers every AddRequest with ``length`` tokens in two deltas, and records it."""

    def __init__(self, client_ref: list, length: int) -> None:
        self.client_ref = client_ref
        self.length = length
        self.sent: list[AddRequest] = []

    async def send(self, worker: int, msg) -> None:
        if isinstance(msg, AddRequest):
            self.sent.append(msg)
            queue = self.client_ref[0].streams[msg.request_id].queue
            half = self.length // 2
            queue.put_nowait(RequestOutput(msg.request_id, [5] * half))
            queue.put_nowait(RequestOutput(msg.request_id, [5] * (self.length - half), True, "stop"))


def test_engine_client_sends_a_capped_prediction_and_learns() -> None:
    predictor, _ = _synthetic_predictor()
    _serve(predictor, [9, 9, 9], 100, 32, 0)
    ref: list = []
    channel = _ScriptedChannel(ref, length=30)
    cluster = SimpleNamespace(workers={0: SimpleNamespace(config=SimpleNamespace(role="colocated"))})
    client = ZmqEngineClient(channel, cluster, 16)
    client.predictor = predictor
    ref.append(client)

    async def run(rid: str, max_tokens: int) -> int:
        n = 0
        async for out in client.generate(rid, [9, 9, 9], SamplingParams(max_tokens=max_tokens), instance=0):
            n += len(out.new_token_ids)
        return n

    observed = predictor.num_observed
    assert asyncio.run(run("wide", 512)) == 30
    assert asyncio.run(run("narrow", 8)) == 30
    wide, narrow = channel.sent
    assert wide.predicted_output_tokens is not None and 1 <= wide.predicted_output_tokens <= 512
    assert narrow.predicted_output_tokens == 8  # capped by max_tokens
    assert predictor.num_observed == observed + 2 and not predictor._pending


def test_bootstrap_labels_do_not_make_the_first_served_label_refit() -> None:
    """The bootstrap's rows are in the bootstrap fit: the next refit waits for
    ``refit_every`` served labels (it came with the first one, and cost a serving run 3 s)."""
    learner = OnlineLearner(2, lambda: LengthModel("bucket", 64, 512), capacity=256, refit_every=16)
    rng = np.random.default_rng(0)
    for _ in range(100):  # as Predictor.bootstrap does
        learner.add(rng.normal(size=2).astype(np.float32), float(rng.integers(1, 500)))
    learner.refit()
    due = [learner.add(rng.normal(size=2).astype(np.float32), 50.0) for _ in range(16)]
    assert due == [False] * 15 + [True]


def test_background_refit_swaps_the_model_in() -> None:
    learner = OnlineLearner(2, lambda: LengthModel("bucket", 64, 512), capacity=256, refit_every=16)
    rng = np.random.default_rng(1)
    for _ in range(40):
        learner.add(rng.normal(size=2).astype(np.float32), float(rng.integers(1, 500)))
    assert learner.model is None
    learner.refit_in_background().join(timeout=60)
    assert learner.model is not None and learner.num_refits == 1
