"""Output-length predictor accuracy on a held-out split, reported like CacheOpt/S3, and
its cost per request in the gateway.

The bootstrap table (``scripts/predictor_dataset``) is split by conversation (both rows of
a ShareGPT conversation fall on the same side), a quarter held out and never used for
training or selection. Every feature set × learner is scored by 5-fold cross-validation
on the training split (the selection criterion), then fitted on all of it and scored on
the held-out split, next to constant baselines (the training median and mean):

- within-bucket accuracy: predicted and actual length in the same ``--bucket``-token bucket;
- over/under: predicted bucket above/below the actual one;
- MAD: mean absolute deviation in tokens;
- direction: accuracy of the deviation-direction classifier;
- cover: share of requests whose actual length fits the padded allocation (prediction ±
  the Hoeffding padding at the configured confidence, λ → 0), and the mean tokens
  allocated beyond the actual length (waste).

The cost is ``Predictor.predict`` (prompt view, features, model, padding) per held-out
prompt, next to the gateway's own tokenization of the same conversation, in one run.

    python benchmarks/simulated/predictor_accuracy.py [--table memserve/predictor/data/...jsonl]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from memserve.model_files.gguf_convert import ensure_model_dir
from memserve.predictor.dataset import (
    DEFAULT_TABLE,
    Example,
    load_table,
    sharegpt_conversations,
)
from memserve.predictor.embeddings import TokenEmbeddings
from memserve.predictor.features import FeatureExtractor, FeatureSet
from memserve.predictor.length_model import LEARNERS, LengthModel, bucket_of
from memserve.predictor.padding import PaddingConfig, hoeffding_padding
from memserve.predictor.predictor import Predictor, PredictorConfig
from memserve.text.tokenizer import Tokenizer
from memserve.workload.dataset import default_sharegpt_path

FEATURE_SETS = (FeatureSet(False, 0), FeatureSet(True, 0), FeatureSet(False, 512), FeatureSet(True, 512))


def held_out(line: int, share: float) -> bool:
    """Deterministic per-conversation split (Knuth's multiplicative hash of the line)."""
    return (line * 2654435761 % 2**32) / 2**32 < share


def scores(pred: np.ndarray, actual: np.ndarray, width: int, max_length: int) -> dict:
    pb, ab = bucket_of(pred.round().astype(np.int64), width, max_length), bucket_of(actual, width, max_length)
    return {"acc": float(np.mean(pb == ab)), "over": float(np.mean(pb > ab)), "under": float(np.mean(pb < ab)),
            "mad": float(np.mean(np.abs(pred - actual)))}


def allocation(pred: np.ndarray, under: np.ndarray, actual: np.ndarray, pad: float, max_length: int) -> dict:
    alloc = np.clip(np.where(under, pred + pad, pred - pad), 1, max_length)
    fits = actual <= alloc
    return {"dir": float(np.mean(under == (actual >= pred))), "cover": float(np.mean(fits)),
            "waste": float(np.mean(np.where(fits, alloc - actual, 0)))}


def cv_accuracy(X: np.ndarray | None, y: np.ndarray, learner: str | None, width: int, max_length: int) -> float:
    """5-fold within-bucket accuracy on the training split; ``learner`` None: the median."""
    rng = np.random.default_rng(0)
    fold = rng.integers(0, 5, len(y))
    hits = []
    for k in range(5):
        if learner is None:
            pred = np.full(np.sum(fold == k), float(np.median(y[fold != k])))
        else:
            pred, _ = LengthModel(learner, width, max_length).fit(X[fold != k], y[fold != k]).predict(X[fold == k])
        hits.append(scores(pred, y[fold == k], width, max_length)["acc"] * np.sum(fold == k))
    return float(np.sum(hits) / len(y))


def row(name: str, cv: float | None, s: dict, a: dict | None) -> str:
    cv_text = f"{cv:6.1%}" if cv is not None else "     -"
    a_text = f"{a['dir']:6.1%} {a['cover']:6.1%} {a['waste']:6.0f}" if a else f"{'-':>6} {'-':>6} {'-':>6}"
    return (f"{name:<28} {cv_text} {s['acc']:6.1%} {s['over']:6.1%} {s['under']:6.1%} {s['mad']:6.0f} {a_text}")


def cost(examples: list[Example], model_dir: Path, tokenizer: Tokenizer, cfg: PredictorConfig, table_path: Path,
         dataset: Path) -> tuple[float, float, int]:
    """(µs per ``Predictor.predict``, µs per tokenization, prompts) over the held-out prompts."""
    conversations = sharegpt_conversations(dataset)
    prompts = [tokenizer.encode_chat(conversations[e.line][:2 * e.turn - 1]) for e in examples]
    started = time.perf_counter()
    for e in examples:
        tokenizer.encode_chat(conversations[e.line][:2 * e.turn - 1])
    tokenize_us = (time.perf_counter() - started) / len(examples) * 1e6
    predictor = Predictor.for_model(model_dir, tokenizer, cfg, table_path)
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for i, ids in enumerate(prompts):
            predictor.predict(f"r{i}", ids, 512)
            predictor.forget(f"r{i}")
        best = min(best, (time.perf_counter() - started) / len(prompts) * 1e6)
    return best, tokenize_us, len(prompts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--table", type=Path, default=DEFAULT_TABLE)
    p.add_argument("--dataset", type=Path, default=default_sharegpt_path(), help="for the cost (prompts re-rendered)")
    p.add_argument("--model", default=None)
    p.add_argument("--bucket", type=int, default=64)
    p.add_argument("--held-out", type=float, default=0.25)
    args = p.parse_args(argv)

    table = load_table(args.table)
    max_length = table.max_tokens
    model_dir = ensure_model_dir(args.model)
    tokenizer = Tokenizer.from_folder(model_dir)
    embeddings = TokenEmbeddings.from_model_dir(model_dir)
    train = [e for e in table.examples if not held_out(e.line, args.held_out)]
    test = [e for e in table.examples if held_out(e.line, args.held_out)]
    y_train = np.array([e.output_tokens for e in train])
    y_test = np.array([e.output_tokens for e in test])
    pad = hoeffding_padding(args.bucket, PaddingConfig().confidence)
    print(f"table: {len(table.examples)} prompts ({args.table.name}), train {len(train)}, held out {len(test)}; "
          f"buckets of {args.bucket} tokens up to {max_length}; padding ±{pad:.1f} tokens at c = "
          f"{PaddingConfig().confidence}")
    print(f"held-out lengths: median {np.median(y_test):.0f}, mean {np.mean(y_test):.0f}, "
          f"cut at max_tokens {np.mean(y_test >= max_length):.0%}")
    print(f"{'predictor':<28} {'cv acc':>6} {'acc':>6} {'over':>6} {'under':>6} {'MAD':>6} {'dir':>6} "
          f"{'cover':>6} {'waste':>6}")
    for name, value in (("baseline: train median", np.median(y_train)), ("baseline: train mean", np.mean(y_train))):
        pred = np.full(len(y_test), float(value))
        cv = cv_accuracy(None, y_train, None, args.bucket, max_length) if "median" in name else None
        print(row(name, cv, scores(pred, y_test, args.bucket, max_length),
                  allocation(pred, np.ones(len(pred), bool), y_test, pad, max_length)))
    results = []
    for fs in FEATURE_SETS:
        extractor = FeatureExtractor(fs, embeddings if fs.embedding else None)
        X_train = extractor.matrix([e.view for e in train])
        X_test = extractor.matrix([e.view for e in test])
        for learner in LEARNERS:
            cv = cv_accuracy(X_train, y_train, learner, args.bucket, max_length)
            model = LengthModel(learner, args.bucket, max_length).fit(X_train, y_train)
            pred, under = model.predict(X_test)
            s = scores(pred, y_test, args.bucket, max_length)
            print(row(f"{learner} / {fs.name}", cv, s, allocation(pred, under, y_test, pad, max_length)), flush=True)
            results.append((cv, -s["mad"], fs, learner))
    cv, _, fs, learner = max(results, key=lambda r: (r[0], r[1]))
    baseline_cv = cv_accuracy(None, y_train, None, args.bucket, max_length)
    print(f"chosen by cross-validated accuracy on the training split: {learner} / {fs.name} (cv {cv:.1%}; "
          f"the median baseline: {baseline_cv:.1%})")
    cfg = PredictorConfig(feature_set=fs, learner=learner, bucket_width=args.bucket)
    predict_us, tokenize_us, n = cost(test, model_dir, tokenizer, cfg, args.table, args.dataset)
    print(f"cost in the gateway: {predict_us:.0f} µs per request (Predictor.predict, {n} held-out prompts); "
          f"the gateway's tokenization of the same prompts: {tokenize_us:.0f} µs ({predict_us / tokenize_us:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
