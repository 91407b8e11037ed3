"""Output length and deviation direction from feature vectors (CacheOpt §3.2, Fig. 10,
with a small learner over the served model's embeddings instead of a fine-tuned LLM).

Two stages, as in the paper: a regressor predicts the length; then a binary classifier,
trained on the regressor's out-of-fold predictions (what it will see on new prompts, not
its fit on its own training rows), predicts whether the actual length will reach the
prediction (pad up) or fall below it (over-prediction: pad down). Lengths are learned in
tokens, not in log space: a small model's greedy answers are bimodal (a short answer, or
a loop that runs to max_tokens), and a log-space fit lands between the two modes.
Predictions are clipped to [1, max_length]: the table's lengths stop at the
``max_tokens`` they were generated with."""

from __future__ import annotations

import numpy as np
from sklearn.base import BaseEstimator, RegressorMixin, clone
from sklearn.ensemble import HistGradientBoostingRegressor
from sklearn.linear_model import LogisticRegression, RidgeCV
from sklearn.model_selection import KFold, cross_val_predict
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

MIN_EXAMPLES = 16  # fewer labels than this: no model (the predictor abstains)
_FOLDS = 5


def bucket_of(lengths: np.ndarray, width: int, max_length: int) -> np.ndarray:
    """Length bucket ``[k·width, (k+1)·width)``; the last bucket also holds ``max_length``."""
    return np.minimum(np.asarray(lengths) // width, (max_length - 1) // width)


class BucketClassifier(RegressorMixin, BaseEstimator):
    """S3's predictor: a classifier over length buckets, answering the median training
    length of the most likely bucket (the middle of a bucket it never saw)."""

    def __init__(self, width: int = 64, max_length: int = 512, C: float = 0.1) -> None:
        self.width = width
        self.max_length = max_length
        self.C = C

    def fit(self, X: np.ndarray, lengths: np.ndarray) -> BucketClassifier:
        buckets = bucket_of(lengths.round().astype(np.int64), self.width, self.max_length)
        self.values_ = np.minimum(np.arange((self.max_length - 1) // self.width + 1) * self.width + self.width / 2,
                                  self.max_length)
        for b in np.unique(buckets):
            self.values_[b] = np.median(lengths[buckets == b])
        if len(np.unique(buckets)) == 1:
            self.model_ = None
            self.only_ = int(buckets[0])
            return self
        self.model_ = make_pipeline(StandardScaler(), LogisticRegression(C=self.C, max_iter=500)).fit(X, buckets)
        return self

    def predict(self, X: np.ndarray) -> np.ndarray:
        buckets = self.model_.predict(X) if self.model_ is not None else np.full(len(X), self.only_)
        return self.values_[buckets]


def _affine(model: BaseEstimator) -> tuple[np.ndarray, float] | None:
    """(w, b) with ``model``'s output (regression value or decision function) = x·w + b,
    when it is a standard scaler followed by a linear model; None otherwise. The gateway
    then predicts with one dot product instead of sklearn's per-call validation."""
    steps = getattr(model, "steps", None)
    if steps is None or len(steps) != 2 or not isinstance(steps[0][1], StandardScaler):
        return None
    scaler, linear = steps[0][1], steps[1][1]
    if not hasattr(linear, "coef_"):
        return None
    coef = np.ravel(linear.coef_) / scaler.scale_
    return coef, float(np.ravel(linear.intercept_)[0] - coef @ scaler.mean_)


def make_regressor(learner: str, width: int, max_length: int) -> BaseEstimator:
    if learner == "ridge":
        return make_pipeline(StandardScaler(), RidgeCV(alphas=np.logspace(-1, 5, 13)))
    if learner == "gbt":  # absolute error: the conditional median, robust to the answers cut at max_length
        return HistGradientBoostingRegressor(loss="absolute_error", max_iter=200, learning_rate=0.05,
                                             max_leaf_nodes=15, min_samples_leaf=10, random_state=0)
    if learner == "bucket":
        return BucketClassifier(width, max_length)
    raise ValueError(f"unknown learner {learner!r}; expected ridge, gbt or bucket")


LEARNERS = ("ridge", "gbt", "bucket")


class LengthModel:
    def __init__(self, learner: str = "ridge", bucket_width: int = 64, max_length: int = 512) -> None:
        self.learner = learner
        self.bucket_width = bucket_width
        self.max_length = max_length
        self._regressor: BaseEstimator | None = None
        self._direction: LogisticRegression | None = None
        self._always_under = False  # the direction when the training rows show only one
        self._fast_regressor: tuple[np.ndarray, float] | None = None
        self._fast_direction: tuple[np.ndarray, float] | None = None

    def fit(self, X: np.ndarray, lengths: np.ndarray) -> LengthModel:
        if len(lengths) < MIN_EXAMPLES:
            raise ValueError(f"need at least {MIN_EXAMPLES} examples, got {len(lengths)}")
        z = np.clip(lengths, 1, self.max_length).astype(np.float64)
        template = make_regressor(self.learner, self.bucket_width, self.max_length)
        folds = KFold(_FOLDS, shuffle=True, random_state=0)
        oof = cross_val_predict(clone(template), X, z, cv=folds)
        self._regressor = clone(template).fit(X, z)
        self._fast_regressor = _affine(self._regressor)
        under = z >= oof  # a length equal to the prediction (often max_length itself) pads up, never short
        if under.all() or not under.any():
            self._direction, self._always_under = None, bool(under.all())
        else:
            self._direction = make_pipeline(StandardScaler(), LogisticRegression(C=0.1, max_iter=500)).fit(
                np.column_stack([X, oof]), under)
            self._fast_direction = _affine(self._direction)
        return self

    def predict(self, X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(predicted lengths in [1, max_length], predicted under-prediction flags)."""
        assert self._regressor is not None, "predict before fit"
        z = self._regressor.predict(X)
        if self._direction is None:
            under = np.full(len(z), self._always_under)
        else:
            under = self._direction.predict(np.column_stack([X, z])).astype(bool)
        return np.clip(z, 1, self.max_length), under

    def predict_one(self, x: np.ndarray) -> tuple[float, bool]:
        """``predict`` for one feature vector, with dot products where the models are linear."""
        if self._fast_regressor is None:
            assert self._regressor is not None, "predict before fit"
            z = float(self._regressor.predict(x[None, :])[0])
        else:
            w, b = self._fast_regressor
            z = float(x @ w) + b
        if self._direction is None:
            under = self._always_under
        elif self._fast_direction is None:
            under = bool(self._direction.predict(np.append(x, z)[None, :])[0])
        else:
            w, b = self._fast_direction
            under = float(x @ w[:-1]) + z * float(w[-1]) + b > 0.0
        return min(max(z, 1.0), float(self.max_length)), under
