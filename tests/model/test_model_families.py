"""The model families beyond Llama/Qwen (mixture of experts: Qwen3-MoE, Mixtral; Phi-3/4
with partial rotary; Mistral with a sliding window) through the real engine on the CPU:
tiny random models saved by transformers must decode greedily exactly like transformers,
on a cold cache, on a prefix hit (the same prompts again, their blocks found cached) and
with prompts prefilled in chunks of 16 tokens that share their steps with other
requests' decodes. The sliding window is also checked logit for logit through each
attention path. The settings the decoder does not implement (other rotary scalings,
Qwen's sliding windows) are refused by name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from helpers.engine_generate import generate
from helpers.tiny_models import TINY_SIZES, save_tiny_model

from memserve.config import EngineConfig
from memserve.workers.engine.engine import Engine
from memserve.workers.model.attention import AttentionMetadata, allocate_kv_cache
from memserve.workers.model.loader import load_model, stack_expert_weights
from memserve.workers.model.model_config import ModelConfig
from memserve.workers.model.moe import SparseMoE
from memserve.workers.real_engine import build_engine

FAMILIES = ["qwen3_moe", "mixtral", "phi3", "mistral"]
NEW_TOKENS = 10
PROMPT_LENGTHS = (5, 40, 17, 70)
CHUNK = 16
BLOCK_SIZE = 16  # EngineConfig's default


@pytest.fixture(scope="module", autouse=True)
def one_intra_op_thread():
    """Tiny models: a second OpenMP thread on a shared 2-core machine only slows them down."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory) -> tuple[Path, list[list[int]], list[list[int]]]:
    """(folder, prompts, transformers' greedy tokens for them) of a tiny random model."""
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_model(folder, request.param)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, TINY_SIZES["vocab_size"], (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    reference = []
    with torch.no_grad():
        for ids in prompts:
            input_ids = torch.tensor([ids])
            out = hf.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=NEW_TOKENS,
                              min_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
            reference.append(out[0, len(ids):].tolist())
    return folder, prompts, reference


def engine_for(folder: Path, **options) -> Engine:
    cfg = EngineConfig(model=str(folder), dtype="float32", num_blocks=64, max_num_seqs=8, **options)
    return build_engine(cfg, folder)


def test_cold_then_prefix_hit_match_transformers(family):
    folder, prompts, reference = family
    engine = engine_for(folder)
    cold = generate(engine, prompts, NEW_TOKENS)
    assert [tokens for tokens, _ in cold] == reference
    assert all(cached == 0 for _, cached in cold)
    again = generate(engine, prompts, NEW_TOKENS, tag="again")
    assert [tokens for tokens, _ in again] == reference
    # Every full block before the last prompt token was found cached.
    assert [cached for _, cached in again] == [(n - 1) // BLOCK_SIZE * BLOCK_SIZE for n in PROMPT_LENGTHS]


def test_chunked_prefill_matches_transformers(family):
    folder, prompts, reference = family
    got = generate(engine_for(folder, long_prefill_token_threshold=CHUNK), prompts, NEW_TOKENS)
    assert [tokens for tokens, _ in got] == reference


CONFIG = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 6,
          "num_attention_heads": 4, "max_position_embeddings": 32768}


def test_config_reads_moe_layouts_and_partial_rotary():
    qwen = ModelConfig.from_dict({**CONFIG, "model_type": "qwen3_moe", "num_experts": 16, "num_experts_per_tok": 4,
                                  "moe_intermediate_size": 32, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert (qwen.sparse_layers, qwen.num_experts, qwen.num_experts_per_tok, qwen.norm_topk_prob) == ((1, 5), 16, 4, False)
    assert qwen.qk_norm and qwen.moe_intermediate_size == 32
    mixtral = ModelConfig.from_dict({**CONFIG, "model_type": "mixtral", "num_local_experts": 8})
    assert mixtral.sparse_layers == tuple(range(6)) and mixtral.norm_topk_prob and mixtral.moe_intermediate_size == 96
    phi4_mini = ModelConfig.from_dict({**CONFIG, "model_type": "phi3", "head_dim": 128, "partial_rotary_factor": 0.75,
                                       "sliding_window": 262144})
    assert phi4_mini.rotary_dim == 96 and not phi4_mini.sparse_layers and phi4_mini.sliding_window is None
    mistral = ModelConfig.from_dict({**CONFIG, "model_type": "mistral", "sliding_window": 4096})
    assert mistral.sliding_window == 4096
    qwen2 = ModelConfig.from_dict({**CONFIG, "model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False})
    assert qwen2.sliding_window is None


@pytest.mark.parametrize(("options", "named"), [
    ({"model_type": "phi3", "rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}},
     "rope_scaling type 'longrope'"),
    ({"model_type": "phi3", "rope_scaling": {"type": "su", "short_factor": [1.0], "long_factor": [2.0]}},
     "rope_scaling type 'su'"),
    ({"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling type 'yarn'"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4096}, "use_sliding_window"),
    ({"model_type": "qwen2_moe"}, "model_type 'qwen2_moe'"),
])
def test_config_refuses_settings_the_decoder_does_not_implement(options, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        ModelConfig.from_dict({**CONFIG, **options})


def test_loader_stacks_mixtral_experts_and_refuses_a_missing_one():
    def mixtral_experts() -> dict[str, torch.Tensor]:
        """Expert i: gate (w1) all i, up (w3) all 10 + i, down (w2) all i."""
        prefix = "model.layers.0.block_sparse_moe.experts"
        return {name: tensor for i in range(3) for name, tensor in [
            (f"{prefix}.{i}.w1.weight", torch.full((6, 4), float(i))),
            (f"{prefix}.{i}.w3.weight", torch.full((6, 4), 10.0 + i)),
            (f"{prefix}.{i}.w2.weight", torch.full((4, 6), float(i)))]}

    stacked = stack_expert_weights({**mixtral_experts(), "model.layers.0.block_sparse_moe.gate.weight": torch.ones(3, 4)})
    gate_up, down = stacked["model.layers.0.mlp.experts.gate_up_proj"], stacked["model.layers.0.mlp.experts.down_proj"]
    assert gate_up.shape == (3, 12, 4) and down.shape == (3, 4, 6) and "model.layers.0.mlp.gate.weight" in stacked
    assert gate_up[:, :, 0].tolist() == [[i] * 6 + [10 + i] * 6 for i in range(3)] and down[2].eq(2).all()
    broken = mixtral_experts()
    del broken["model.layers.0.block_sparse_moe.experts.1.w3.weight"]
    with pytest.raises(ValueError, match="model.layers.0.mlp.experts"):
        stack_expert_weights(broken)


@pytest.mark.parametrize("blocked_prefill", [True, False], ids=["blocked-prefill", "sdpa-prefill"])
@pytest.mark.parametrize("cpu_attention", ["kernel", "torch"])
def test_sliding_window_matches_transformers_logits_on_every_attention_path(tmp_path, monkeypatch, blocked_prefill,
                                                                              cpu_attention):
    """A 70-token sequence (window 24) prefilled in chunks of 30 and 25 tokens, then decoded
    one token a step: every logit equals transformers' on the whole sequence at once."""
    hf = save_tiny_model(tmp_path, "mistral")
    if not blocked_prefill:
        monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    ids = torch.randint(0, TINY_SIZES["vocab_size"], (70,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    model = load_model(tmp_path, torch.float32, "cpu")
    cfg = model.config
    cache = allocate_kv_cache(8, cfg.num_layers, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    table = torch.tensor([[3, 1, 5, 0, 2]])  # scattered blocks
    logits = []
    for first, end in [(0, 30), (30, 55)] + [(p, p + 1) for p in range(55, 70)]:
        slots = torch.tensor([table[0, p // BLOCK_SIZE].item() * BLOCK_SIZE + p % BLOCK_SIZE for p in range(first, end)])
        meta = AttentionMetadata(slots, [0, end - first], [end], table, BLOCK_SIZE, cpu_attention=cpu_attention)
        logits.append(model.compute_logits(model(ids[first:end], torch.arange(first, end), cache, meta)))
    torch.testing.assert_close(torch.cat(logits), expected, atol=1e-4, rtol=1e-4)


def test_sparse_moe_computes_only_the_chosen_experts():
    """Experts no token chose hold NaN weights: a dense computation (every expert on every
    token, weighted by 0) would spread them; the grouped one never reads them. Each token
    equals its chosen experts' outputs summed by hand."""
    config = ModelConfig.from_dict({**CONFIG, "model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2,
                                    "moe_intermediate_size": 32, "norm_topk_prob": True})
    gen = torch.Generator().manual_seed(4)
    moe = SparseMoE(config)
    for param in moe.parameters():
        param.data = torch.randn(param.shape, generator=gen)
    x = torch.randn(5, config.hidden_size, generator=gen)
    weights, experts = moe.route(x)
    unused = sorted(set(range(8)) - set(experts.flatten().tolist()))
    assert unused
    moe.experts.gate_up_proj.data[unused] = float("nan")
    moe.experts.down_proj.data[unused] = float("nan")
    with torch.no_grad():
        got = moe(x)
        expected = torch.stack([sum(w * _expert(moe, int(e), x[t]) for w, e in zip(weights[t], experts[t]))
                                for t in range(5)])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def _expert(moe: SparseMoE, e: int, x: torch.Tensor) -> torch.Tensor:
    gate, up = (moe.experts.gate_up_proj[e] @ x).chunk(2)
    return moe.experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up)
