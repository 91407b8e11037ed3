"""The gateway's output-length predictor: one object per gateway, built at start.

``predict`` turns a prompt into ``AddRequest.predicted_output_tokens``: the learned length
moved by the Hoeffding padding in the predicted deviation direction, at the confidence
the current arrival rate allows, capped by the request's ``max_tokens``. ``observe`` feeds
the finished request's length back (online learning). It starts from the bootstrap table
when that table was made with this model's tokenizer; otherwise it abstains (returns
None) until enough requests have finished to fit a first model."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from memserve.predictor.arrival_rate import ArrivalRate
from memserve.predictor.dataset import (
    DEFAULT_TABLE,
    Table,
    load_table,
    tokenizer_fingerprint,
)
from memserve.predictor.embeddings import TokenEmbeddings
from memserve.predictor.features import FeatureExtractor, FeatureSet
from memserve.predictor.length_model import LengthModel
from memserve.predictor.online import OnlineLearner
from memserve.predictor.padding import PaddingConfig, padded_length, rate_confidence
from memserve.predictor.prompt_view import PromptViewer
from memserve.text.tokenizer import Tokenizer

log = logging.getLogger("memserve.gateway")

# Lengths are learned up to this many tokens when no bootstrap table sets it.
DEFAULT_MAX_LENGTH = 512


@dataclass(frozen=True)
class PredictorConfig:
    # Chosen by benchmarks/simulated/predictor_accuracy.py (docs/benchmarks.md).
    feature_set: FeatureSet = field(default_factory=lambda: FeatureSet(embedding=True, ngram_buckets=0))
    learner: str = "bucket"
    bucket_width: int = 64  # tokens; also the (b - a) of the Hoeffding padding
    padding: PaddingConfig = field(default_factory=PaddingConfig)
    capacity: int = 2048  # labelled examples kept for refits
    refit_every: int = 64  # finished requests between refits


class Predictor:
    def __init__(self, viewer: PromptViewer, extractor: FeatureExtractor, cfg: PredictorConfig = PredictorConfig(),
                 max_length: int = DEFAULT_MAX_LENGTH, clock: Callable[[], float] = time.monotonic) -> None:
        self.viewer = viewer
        self.extractor = extractor
        self.cfg = cfg
        self.max_length = max_length
        self.arrivals = ArrivalRate(clock)
        self.online = OnlineLearner(extractor.dim, lambda: LengthModel(cfg.learner, cfg.bucket_width, max_length),
                                    cfg.capacity, cfg.refit_every)
        # Features and unpadded prediction of the requests in flight, until they finish.
        self._pending: dict[str, tuple[np.ndarray, float | None]] = {}
        self.num_predictions = 0
        self.num_observed = 0
        self.abs_error_sum = 0.0  # |unpadded prediction - actual| over observed predicted requests
        self.num_scored = 0

    @classmethod
    def for_model(cls, model_dir: str | Path, tokenizer: Tokenizer, cfg: PredictorConfig = PredictorConfig(),
                  table_path: Path | None = DEFAULT_TABLE, clock: Callable[[], float] = time.monotonic) -> Predictor:
        """Build and bootstrap (fits a model: call it off the event loop)."""
        embeddings = TokenEmbeddings.from_model_dir(model_dir) if cfg.feature_set.embedding else None
        extractor = FeatureExtractor(cfg.feature_set, embeddings)
        table = load_table(table_path) if table_path is not None and Path(table_path).is_file() else None
        if table is not None and table.header.get("tokenizer") != tokenizer_fingerprint(Path(model_dir)):
            log.info("predictor: %s was made with another tokenizer; learning from served requests only", table_path)
            table = None
        predictor = cls(PromptViewer.for_tokenizer(tokenizer), extractor, cfg,
                        table.max_tokens if table is not None else DEFAULT_MAX_LENGTH, clock)
        if table is not None:
            predictor.bootstrap(table)
        return predictor

    def bootstrap(self, table: Table) -> None:
        for example in table.examples:
            self.online.add(self.extractor.vector(example.view), example.output_tokens)
        self.online.refit()

    def predict(self, request_id: str, prompt_token_ids: list[int], max_tokens: int) -> int | None:
        """Padded predicted output length, at most ``max_tokens``; None before a model exists."""
        self.arrivals.arrive()
        x = self.extractor.vector(self.viewer.view(prompt_token_ids))
        model = self.online.model
        if model is None:
            self._pending[request_id] = (x, None)
            return None
        length, under = model.predict_one(x)
        self._pending[request_id] = (x, length)
        self.num_predictions += 1
        padded = padded_length(length, self.cfg.bucket_width, under, self.arrivals.rate(), self.cfg.padding)
        return min(max_tokens, max(1, round(padded)))

    def observe(self, request_id: str, output_tokens: int, finish_reason: str | None) -> bool:
        """Learn from a finished request (or choice). Answers cut by the request's own
        ``max_tokens`` below ``max_length`` only bound the length from below, and aborted
        ones say nothing: neither is a label. True when a refit is due (run ``refit`` or
        ``refit_in_background``)."""
        entry = self._pending.get(request_id)
        if entry is None or not (finish_reason == "stop" or output_tokens >= self.max_length):
            return False
        x, predicted = entry
        length = min(output_tokens, self.max_length)
        self.num_observed += 1
        if predicted is not None:
            self.abs_error_sum += abs(predicted - length)
            self.num_scored += 1
        return self.online.add(x, length)

    def forget(self, request_id: str) -> None:
        """The request is over: drop what was kept for ``observe``."""
        self._pending.pop(request_id, None)

    def refit(self) -> None:
        self.online.refit()

    def refit_in_background(self) -> None:
        self.online.refit_in_background()

    def stats(self) -> dict:
        rate = self.arrivals.rate()
        return {"predictions": self.num_predictions, "observed": self.num_observed, "refits": self.online.num_refits,
                "mean_abs_error": self.abs_error_sum / self.num_scored if self.num_scored else None,
                "arrival_rate": rate, "confidence": rate_confidence(rate, self.cfg.padding)}
