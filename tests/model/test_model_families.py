"""The model families beyond Llama/Qwen (mixture of experts: Qwen3-MoE, Mixtral; Phi-3/4
with partial rotary; Mistral with a sliding window; Gemma 2 and 3 with sliding and global
layers, soft-caps and Gemma 3's two rotary bases) through the real engine on the CPU:
tiny random models saved by transformers must decode greedily exactly like transformers,
on a cold cache, on a prefix hit (the same prompts again, their blocks found cached),
after a round trip of their cached blocks through the host tier, after a PD handoff (the
prompts' KV computed by one engine and sent over a real KV transfer endpoint to another,
which decodes over it), and with prompts prefilled in chunks of 16 tokens that share
their steps with other requests' decodes.
Windows and soft-caps are also checked logit for logit through each attention path, an
attention soft-cap small enough to change transformers' tokens must change memserve's
alike, a multimodal Gemma 3 folder serves its text model, and Gemma 3's keys shift
exactly with each layer's own rotary. The settings the decoder does not implement
(other rotary scalings, Qwen's sliding windows, Gemma's bidirectional attention) are
refused by name."""

from __future__ import annotations

import re
import secrets
from pathlib import Path

import pytest
import torch
from helpers.engine_generate import generate
from helpers.one_thread import one_intra_op_thread  # noqa: F401 (autouse fixture)
from helpers.served_endpoint import served

from memserve.config import EngineConfig
from memserve.ipc.kv_transfer import KVTransferEndpoint
from memserve.kvcache.address import Tier, addr_tier
from memserve.kvcache.mempool import KVFlags
from memserve.testing.random_models import (
    TINY_ARCHITECTURES,
    TINY_SIZES,
    save_tiny_model,
)
from memserve.workers.engine.engine import Engine
from memserve.workers.model.attention import AttentionMetadata, allocate_kv_cache
from memserve.workers.model.kv_shift import shift_blocks
from memserve.workers.model.llama import LlamaForCausalLM
from memserve.workers.model.loader import load_model, stack_expert_weights
from memserve.workers.model.model_config import ModelConfig
from memserve.workers.model.moe import SparseMoE
from memserve.workers.real_engine import build_engine

FAMILIES = ["qwen3_moe", "mixtral", "phi3", "mistral", "gemma2", "gemma3_text"]
NEW_TOKENS = 10
PROMPT_LENGTHS = (5, 40, 17, 70)
CHUNK = 16
BLOCK_SIZE = 16  # EngineConfig's default


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory) -> tuple[Path, list[list[int]], list[list[int]]]:
    """(folder, prompts, transformers' greedy tokens for them) of a tiny random model."""
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_model(folder, request.param)
    prompts = random_prompts()
    return folder, prompts, transformers_greedy(hf, prompts)


def random_prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, TINY_SIZES["vocab_size"], (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def transformers_greedy(hf, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' NEW_TOKENS greedy tokens of each prompt, never stopping early."""
    reference = []
    with torch.no_grad():
        for ids in prompts:
            input_ids = torch.tensor([ids])
            out = hf.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=NEW_TOKENS,
                              min_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
            reference.append(out[0, len(ids):].tolist())
    return reference


def engine_for(folder: Path, instance: int = 0, **options) -> Engine:
    cfg = EngineConfig(model=str(folder), dtype="float32", num_blocks=64, max_num_seqs=8, **options)
    return build_engine(cfg, folder, instance)


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


def test_host_tier_round_trip_matches_transformers(family):
    """The prompts' cached blocks all moved to the host tier, then loaded back for the
    same prompts: transformers' tokens, the cached prefixes found whole."""
    folder, prompts, reference = family
    engine = engine_for(folder, num_host_blocks=64)
    generate(engine, prompts, NEW_TOKENS)
    mempool = engine.mempool
    mempool.flush_saves()
    mempool.swap_out(mempool.stats()["device"]["total"])
    assert {addr_tier(a) for a in mempool.match(prompts[-1], take_ref=False)} == {Tier.HOST}
    back = generate(engine, prompts, NEW_TOKENS, tag="back")
    assert [tokens for tokens, _ in back] == reference
    assert [cached for _, cached in back] == [(n - 1) // BLOCK_SIZE * BLOCK_SIZE for n in PROMPT_LENGTHS]
    assert engine.stats()["num_swapped_in"] > 0


def test_pd_handoff_matches_transformers(family):
    """A prefill engine computes the prompts and sends each one's cached blocks, with
    their tokens, over a KV transfer endpoint (frames over ZeroMQ, as between hosts) to a
    decode engine, which finds the prefixes cached and decodes transformers' tokens."""
    folder, prompts, reference = family
    prefill, decode = engine_for(folder, 0), engine_for(folder, 1)
    sender, receiver = KVTransferEndpoint(prefill.mempool), KVTransferEndpoint(decode.mempool)
    try:
        sender.connect(1, receiver.address)
        generate(prefill, prompts, 1)
        held = [prefill.kv_connector.hold_prefix(p) for p in prompts]
        tickets = [secrets.token_hex(8) for _ in prompts]
        for ticket, src in zip(tickets, held):
            receiver.expect(ticket, 0, len(src))
        with served(receiver):  # the decode worker's endpoint, from here on
            for prompt, src, ticket in zip(prompts, held, tickets):
                if src:
                    prefill.mempool.transfer_with_insert(1, prompt[:len(src) * BLOCK_SIZE], src,
                                                         flags=KVFlags.RELEASE, ticket=ticket)
                prefill.kv_connector.free(src)
    finally:
        sender.close()
        receiver.close()
    got = generate(decode, prompts, NEW_TOKENS)
    assert [tokens for tokens, _ in got] == reference
    assert [cached for _, cached in got] == [(n - 1) // BLOCK_SIZE * BLOCK_SIZE for n in PROMPT_LENGTHS]
    assert prefill.mempool.stats()["device"]["used"] == 0  # every block sent was let go


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


def test_config_reads_gemma_layer_kinds_ropes_and_defaults():
    """Gemma 2 without layer_types: every other layer sliding, transformers' soft-cap
    defaults. A Gemma 3 config in transformers<5's spelling: five sliding layers per
    global one, the sliding ones on rope_local_base_freq, rope_scaling the global ones'.
    A multimodal Gemma 3 config: its text_config, with transformers' defaults for what it
    leaves out and the top level's EOS ids."""
    gemma2 = ModelConfig.from_dict({**CONFIG, "model_type": "gemma2", "sliding_window": 4096, "hidden_act": "gelu"})
    assert gemma2.sliding_layers == (0, 2, 4) and gemma2.layer_window(0) == 4096 and gemma2.layer_window(1) == 0
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping) == (50.0, 30.0)
    assert gemma2.hidden_act == "gelu_pytorch_tanh" and gemma2.head_dim == 256 and gemma2.attention_scale == 256**-0.5
    assert gemma2.local_rope_parameters is None and not gemma2.qk_norm
    gemma3 = ModelConfig.from_dict({**CONFIG, "model_type": "gemma3_text", "num_hidden_layers": 12, "sliding_window": 512,
                                    "rope_theta": 1e6, "rope_local_base_freq": 1e4, "attn_logit_softcapping": 50.0,
                                    "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert gemma3.sliding_layers == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10) and gemma3.qk_norm
    assert gemma3.rope_parameters == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    assert gemma3.local_rope_parameters == {"rope_type": "default", "rope_theta": 1e4}
    assert gemma3.attn_logit_softcapping is None and gemma3.final_logit_softcapping is None  # as transformers reads it
    multimodal = ModelConfig.from_dict({"model_type": "gemma3", "eos_token_id": [1, 106], "text_config": {
        "model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34,
        "sliding_window": 1024, "rope_scaling": {"factor": 8.0, "rope_type": "linear"}}})
    assert multimodal.model_type == "gemma3_text" and multimodal.eos_token_ids == (1, 106)
    assert (multimodal.vocab_size, multimodal.num_heads, multimodal.num_kv_heads, multimodal.head_dim) == (262208, 8, 4, 256)
    assert multimodal.sliding_layers == tuple(i for i in range(34) if (i + 1) % 6) and multimodal.sliding_window == 1024
    assert multimodal.rope_parameters["rope_theta"] == 1e6 and multimodal.local_rope_parameters["rope_theta"] == 1e4


@pytest.mark.parametrize(("options", "named"), [
    ({"model_type": "phi3", "rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}},
     "rope_scaling type 'longrope'"),
    ({"model_type": "phi3", "rope_scaling": {"type": "su", "short_factor": [1.0], "long_factor": [2.0]}},
     "rope_scaling type 'su'"),
    ({"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling type 'yarn'"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4096}, "use_sliding_window"),
    ({"model_type": "qwen2_moe"}, "model_type 'qwen2_moe'"),
    ({"model_type": "gemma3_text", "use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"model_type": "gemma2", "hidden_activation": "gelu"}, "hidden_act 'gelu'"),
    ({"model_type": "gemma3"}, "model_type 'gemma3' without a text_config"),
    ({"model_type": "gemma3_text", "rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 4.0},
                                                       "sliding_attention": {"rope_type": "default"}}},
     "rope_scaling type 'yarn'"),
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


@pytest.mark.parametrize("cpu_prefill", ["blocked", "sdpa"])
@pytest.mark.parametrize("cpu_attention", ["kernel", "torch"])
@pytest.mark.parametrize("name", ["mistral", "gemma2", "gemma3_text"])
def test_windows_and_softcaps_match_transformers_logits_on_every_attention_path(tmp_path, name, cpu_prefill,
                                                                                 cpu_attention):
    """A 70-token sequence (window 24; Gemma's global layers see it all, Gemma 2 caps its
    scores) prefilled in chunks of 30 and 25 tokens, then decoded one token a step: every
    logit (Gemma's soft-capped) equals transformers' on the whole sequence at once."""
    hf = save_tiny_model(tmp_path, name)
    ids = torch.randint(0, TINY_SIZES["vocab_size"], (70,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    model = load_model(tmp_path, torch.float32, "cpu")
    cache = new_cache(model, 8)
    table = torch.tensor([[3, 1, 5, 0, 2]])  # scattered blocks
    logits = [model.compute_logits(run_chunk(model, cache, table, ids, first, end, cpu_attention=cpu_attention,
                                             cpu_prefill=cpu_prefill))
              for first, end in [(0, 30), (30, 55)] + [(p, p + 1) for p in range(55, 70)]]
    torch.testing.assert_close(torch.cat(logits), expected, atol=1e-4, rtol=1e-4)


def new_cache(model: LlamaForCausalLM, num_blocks: int) -> torch.Tensor:
    cfg = model.config
    return allocate_kv_cache(num_blocks, cfg.num_layers, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim, torch.float32,
                             "cpu")


def run_chunk(model: LlamaForCausalLM, cache: torch.Tensor, table: torch.Tensor, ids: torch.Tensor, first: int,
              end: int, offset: int = 0, cpu_attention: str = "kernel", cpu_prefill: str = "blocked") -> torch.Tensor:
    """The hidden states of ``ids[first:end]`` at positions ``offset + first`` on, their K/V
    written at the sequence's slots ``first:end`` of the blocks in ``table`` [1, blocks]."""
    slots = torch.tensor([table[0, p // BLOCK_SIZE].item() * BLOCK_SIZE + p % BLOCK_SIZE for p in range(first, end)])
    meta = AttentionMetadata(slots, [0, end - first], [end], table, BLOCK_SIZE, cpu_attention=cpu_attention,
                             cpu_prefill=cpu_prefill)
    return model(ids[first:end], torch.arange(offset + first, offset + end), cache, meta)


@pytest.mark.parametrize("cpu_prefill", ["blocked", "sdpa"])
@pytest.mark.parametrize("cpu_attention", ["kernel", "torch"])
def test_an_attention_softcap_that_changes_the_tokens_changes_memserves_alike(tmp_path, cpu_prefill, cpu_attention):
    """Gemma 2 with its attention scores capped at 2: transformers' greedy tokens differ
    from those of the same weights uncapped, and memserve's equal the capped ones."""
    hf = save_tiny_model(tmp_path, "gemma2", attn_logit_softcapping=2.0)
    prompts = random_prompts()
    capped = transformers_greedy(hf, prompts)
    for layer in hf.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    assert transformers_greedy(hf, prompts) != capped
    engine = engine_for(tmp_path, cpu_attention=cpu_attention, cpu_prefill_attention=cpu_prefill)
    assert engine.runner.cpu_prefill == cpu_prefill
    got = generate(engine, prompts, NEW_TOKENS)
    assert [tokens for tokens, _ in got] == capped


def test_multimodal_gemma3_folder_serves_its_text_model(tmp_path):
    """A Gemma3ForConditionalGeneration folder (vision tower, projector, the text model
    under ``language_model.``): memserve loads the text model alone and decodes text
    prompts greedily exactly like transformers' multimodal model."""
    import transformers

    _, text_options = TINY_ARCHITECTURES["gemma3_text"]
    torch.manual_seed(0)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config={**TINY_SIZES, **text_options}, vision_config=vision.to_dict(),
                                       mm_tokens_per_image=4, tie_word_embeddings=False)
    hf = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for param in hf.parameters():
            param.normal_(0.0, 0.2)
    hf.save_pretrained(tmp_path)
    prompts = random_prompts()
    got = generate(engine_for(tmp_path), prompts, NEW_TOKENS)
    assert [tokens for tokens, _ in got] == transformers_greedy(hf, prompts)


def test_gemma3_keys_shift_exactly_with_each_layers_rotary(tmp_path):
    """Gemma 3's sliding and global layers rotate with different bases: a 48-token sequence
    prefilled at offset 40, its blocks shifted by -40 with each layer's rotary, equals the
    sequence prefilled at 0, in every layer (attention sees relative positions only)."""
    save_tiny_model(tmp_path, "gemma3_text")
    model = load_model(tmp_path, torch.float32, "cpu")
    assert model.layer_rotaries[0] is not model.layer_rotaries[1]
    ids = torch.randint(0, TINY_SIZES["vocab_size"], (48,), generator=torch.Generator().manual_seed(5))
    cache = new_cache(model, 9)
    run_chunk(model, cache, torch.tensor([[0, 1, 2]]), ids, 0, 48, offset=40)
    shift_blocks(cache, "aggregated", model.layer_rotaries, [0, 1, 2], [3, 4, 5], -40)
    run_chunk(model, cache, torch.tensor([[6, 7, 8]]), ids, 0, 48)
    torch.testing.assert_close(cache[3:6], cache[6:9], rtol=1e-4, atol=1e-4)


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
