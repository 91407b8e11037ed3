"""Feature vectors of a ``PromptView``, cheap enough for the gateway's event loop.

Three groups, chosen per predictor (``FeatureSet``) by measured accuracy
(``benchmarks/simulated/predictor_accuracy.py``):

- shape: log prompt length, log length of the last user turn, log number of turn
  markers and the share of the prompt that the last turn is: long conversations and long
  pasted texts get different answer lengths than short questions;
- embedding: the mean of the served model's own input embeddings over the excerpt, a
  cheap summary of what is asked (code, essay, yes/no question ...);
- n-grams: unigram and bigram counts of the excerpt's token ids hashed into a fixed
  number of buckets, L2-normalised (instruction words like "list", "explain", "in one
  sentence").

Everything is deterministic (no Python ``hash``, which is salted per process)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from memserve.predictor.embeddings import TokenEmbeddings
from memserve.predictor.prompt_view import PromptView

SHAPE_DIM = 4
_MULT = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing constant (2**64 / golden ratio)
_BIGRAM_SALT = np.uint64(0x632BE59BD9B4E019)


@dataclass(frozen=True)
class FeatureSet:
    embedding: bool = True
    ngram_buckets: int = 0  # 0: no n-gram features

    @property
    def name(self) -> str:
        parts = ["shape"] + (["emb"] if self.embedding else []) + \
            ([f"ngram{self.ngram_buckets}"] if self.ngram_buckets else [])
        return "+".join(parts)


def _hash_buckets(keys: np.ndarray, buckets: int) -> np.ndarray:
    with np.errstate(over="ignore"):  # wrap-around multiplication is the hash
        return ((keys * _MULT) >> np.uint64(40)) % np.uint64(buckets)


class FeatureExtractor:
    def __init__(self, feature_set: FeatureSet, embeddings: TokenEmbeddings | None) -> None:
        if feature_set.embedding and embeddings is None:
            raise ValueError("the feature set needs the model's token embeddings")
        self.feature_set = feature_set
        self.embeddings = embeddings
        self.dim = SHAPE_DIM + (embeddings.dim if embeddings is not None and feature_set.embedding else 0) + \
            feature_set.ngram_buckets

    def vector(self, view: PromptView) -> np.ndarray:
        parts = [np.array([math.log1p(view.prompt_tokens), math.log1p(view.last_turn_tokens),
                           math.log1p(view.turn_markers), view.last_turn_tokens / max(1, view.prompt_tokens)], dtype=np.float32)]
        ids = np.asarray(view.excerpt, dtype=np.int64)
        if self.feature_set.embedding:
            assert self.embeddings is not None  # __init__ checked
            parts.append(self.embeddings.mean(ids))
        if self.feature_set.ngram_buckets:
            parts.append(self._ngrams(ids))
        return np.concatenate(parts)

    def matrix(self, views: list[PromptView]) -> np.ndarray:
        return np.stack([self.vector(v) for v in views]) if views else np.zeros((0, self.dim), np.float32)

    def _ngrams(self, ids: np.ndarray) -> np.ndarray:
        buckets = self.feature_set.ngram_buckets
        keys = ids.astype(np.uint64)
        with np.errstate(over="ignore"):
            bigrams = keys[:-1] * _BIGRAM_SALT + keys[1:]
        counts = np.bincount(_hash_buckets(np.concatenate([keys + np.uint64(1), bigrams]), buckets).astype(np.int64),
                             minlength=buckets).astype(np.float32)
        norm = float(np.linalg.norm(counts))
        return counts / norm if norm else counts
