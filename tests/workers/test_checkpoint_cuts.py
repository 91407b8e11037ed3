"""A rank reads only its part of each split layer's checkpoint tensors
(``checkpoint_cuts.py``), and what it reads is exactly what cutting the whole tensors
gives: every family's tiny model, every rank of two and three (KV heads replicated or
split, biases on q/k/v), compared with the whole checkpoint read, fused and cut by the
layers."""

from __future__ import annotations

import pytest
import torch

from memserve.testing.random_models import TINY_ARCHITECTURES, save_tiny_model
from memserve.workers.model.checkpoint_cuts import checkpoint_cuts
from memserve.workers.model.llama import LlamaForCausalLM
from memserve.workers.model.loader import fuse_hf_weights, read_safetensors, shard_weights, stack_expert_weights
from memserve.workers.model.model_config import ModelConfig
from memserve.workers.model.tensor_parallel import TensorParallel

FAMILIES = [f for f in sorted(TINY_ARCHITECTURES) if f in ("llama", "qwen2", "qwen3", "phi3", "gemma2", "qwen3_moe")]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("ranks", [2, 4])
def test_a_ranks_cut_reads_equal_the_whole_tensors_cut(family, ranks, tmp_path):
    save_tiny_model(tmp_path, family)
    config = ModelConfig.from_folder(tmp_path)
    for rank in range(ranks):
        with torch.device("meta"):
            model = LlamaForCausalLM(config, TensorParallel(rank, ranks))
        whole = fuse_hf_weights(stack_expert_weights(read_safetensors(tmp_path, torch.float32, "cpu")))
        shard_weights(model, whole)
        cuts, read_cut = checkpoint_cuts(model)
        assert cuts and read_cut
        parts = fuse_hf_weights(stack_expert_weights(read_safetensors(tmp_path, torch.float32, "cpu", cuts=cuts)))
        shard_weights(model, parts, read_cut)
        assert parts.keys() == whole.keys()
        for name, tensor in whole.items():
            assert torch.equal(parts[name], tensor), (family, rank, name)
        read = read_safetensors(tmp_path, torch.float32, "cpu", cuts=cuts)
        everything = read_safetensors(tmp_path, torch.float32, "cpu")
        share = 1.0 if family == "qwen3_moe" else 0.75  # the experts are read whole, then cut
        assert sum(t.numel() for t in read.values()) < share * sum(t.numel() for t in everything.values())
    assert not checkpoint_cuts(LlamaForCausalLM(config))[0]  # one rank reads every tensor whole
