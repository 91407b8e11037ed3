"""``--load-format dummy`` (vLLM's): a model built from config.json alone, every weight
small and random on the device, serves steps: what the GPU benchmarks time a large
model's shape with, without its files."""

from __future__ import annotations

import pytest
import torch
from helpers.engine_generate import generate

from memserve.config import EngineConfig
from memserve.testing.random_models import save_tiny_model
from memserve.workers.model.loader import load_model
from memserve.workers.real_engine import build_engine


@pytest.fixture
def config_only(tmp_path):
    save_tiny_model(tmp_path, "qwen2")
    for weights in tmp_path.glob("*.safetensors"):
        weights.unlink()
    return tmp_path


def test_weights_are_small_random_values_from_the_config_alone(config_only):
    model = load_model(config_only, torch.float32, "cpu", cpu_gemm="torch", load_format="dummy")
    weights = [p for p in model.parameters()]
    assert weights and all(p.abs().max() <= 1e-3 and p.abs().max() > 0 for p in weights)
    with pytest.raises(FileNotFoundError):
        load_model(config_only, torch.float32, "cpu", cpu_gemm="torch")  # auto reads the weights: there are none


def test_an_engine_serves_steps_on_dummy_weights(config_only):
    engine = build_engine(EngineConfig(model=str(config_only), dtype="float32", num_blocks=16, load_format="dummy"),
                          config_only)
    out = generate(engine, [[1, 2, 3, 4, 5], list(range(20))], 4)
    assert [len(tokens) for tokens, _ in out] == [4, 4]
    again = generate(build_engine(EngineConfig(model=str(config_only), dtype="float32", num_blocks=16,
                                               load_format="dummy"), config_only), [[1, 2, 3, 4, 5]], 4)
    assert again[0][0] == out[0][0]  # the same seeded weights
