"""Hugging Face folders written as GGUF files the way llama.cpp's ``convert_hf_to_gguf.py``
writes them (float32, nothing quantized), for the GGUF conversion tests: its architecture
for each model type, the metadata keys each of its model classes writes, its tensor names
and the changes it makes to tensors (the llama architecture's Q/K rows permuted for its
rotary, experts stacked, Gemma's norm weights stored as ``w + 1``, Llama 3's rope scaling
as per-frequency divisors, Gemma 2's lm_head dropped).

Written from that converter and apart from memserve's reader, so the tests hold the reader
to llama.cpp's conventions rather than to itself. Each tensor name is also checked against
the ``gguf`` package's own tables: the tensors llama.cpp declares for the architecture,
and its map from Hugging Face names."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors.numpy import load_file
from transformers.convert_slow_tokenizer import bytes_to_unicode

# Hugging Face model_type -> llama.cpp architecture (its converter registers Mistral and
# Mixtral as LlamaModel).
ARCHITECTURES = {
    "llama": gguf.MODEL_ARCH.LLAMA,
    "mistral": gguf.MODEL_ARCH.LLAMA,
    "mixtral": gguf.MODEL_ARCH.LLAMA,
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
    "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE,
    "phi3": gguf.MODEL_ARCH.PHI3,
    "gemma2": gguf.MODEL_ARCH.GEMMA2,
    "gemma3_text": gguf.MODEL_ARCH.GEMMA3,
}
GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
# Within model.layers.N.
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv",  # Phi-3
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate_up_proj": "ffn_up",  # Phi-3: gate and up in one tensor
    "mlp.gate": "ffn_gate_inp",  # Qwen3-MoE's router
    "block_sparse_moe.gate": "ffn_gate_inp",  # Mixtral's
}
GEMMA_LAYER_NAMES = LAYER_NAMES | {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
# An expert projection's Hugging Face name -> (the name of the stacked tensor that the
# converter maps, llama.cpp's name).
EXPERT_NAMES = {
    "block_sparse_moe.experts.{e}.w1": ("layers.{bid}.feed_forward.experts.w1", "ffn_gate_exps"),
    "block_sparse_moe.experts.{e}.w2": ("layers.{bid}.feed_forward.experts.w2", "ffn_down_exps"),
    "block_sparse_moe.experts.{e}.w3": ("layers.{bid}.feed_forward.experts.w3", "ffn_up_exps"),
    "mlp.experts.{e}.gate_proj": ("model.layers.{bid}.mlp.experts.gate_proj", "ffn_gate_exps"),
    "mlp.experts.{e}.up_proj": ("model.layers.{bid}.mlp.experts.up_proj", "ffn_up_exps"),
    "mlp.experts.{e}.down_proj": ("model.layers.{bid}.mlp.experts.down_proj", "ffn_down_exps"),
}


def write_gguf(folder: Path, path: Path, window_key: bool = False,
               quantized: gguf.GGMLQuantizationType | None = None) -> Path:
    """The model in ``folder`` (config.json, model.safetensors) converted into ``path``.
    ``window_key``: also write a Mistral's sliding window under the key llama.cpp's other
    architectures use (its converter leaves it out of the llama architecture).
    ``quantized``: store the matrices in that type, quantized by the ``gguf`` package's
    own quantizers (the embedding in Q8_0, as llama.cpp's Q4 mixes do)."""
    config = json.loads((folder / "config.json").read_text())
    arch = ARCHITECTURES[config["model_type"]]
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    write_metadata(writer, config)
    if window_key:
        writer.add_sliding_window(config["sliding_window"])
    write_byte_level_tokenizer(writer, config["vocab_size"])
    for name, values in gguf_tensors(config, load_file(folder / "model.safetensors")):
        values = np.ascontiguousarray(values, dtype=np.float32)
        if quantized is not None and values.ndim == 2 and values.shape[1] % 32 == 0:
            kind = gguf.GGMLQuantizationType.Q8_0 if name == "token_embd.weight" else quantized
            writer.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_metadata(writer: gguf.GGUFWriter, c: dict[str, Any]) -> None:
    """What each of the converter's model classes writes: TextModel.set_gguf_parameters,
    with LlamaModel's, Qwen2MoeModel's and Gemma3Model's additions; Phi3MiniModel and
    Gemma2Model write their own sets."""
    model_type = c["model_type"]
    rope = c.get("rope_parameters") or {}
    global_rope = rope.get("full_attention", rope)
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if model_type == "phi3":
        writer.add_rope_freq_base(global_rope["rope_theta"])
        writer.add_rope_scaling_orig_ctx_len(c["original_max_position_embeddings"])
        rot_pct = rope.get("partial_rotary_factor", 1.0)
        writer.add_rope_dimension_count(int(rot_pct * c["hidden_size"]) // c["num_attention_heads"])
        writer.add_sliding_window(c.get("sliding_window") or 0)
        if global_rope.get("rope_type") == "longrope":
            scale = c["max_position_embeddings"] / c["original_max_position_embeddings"]
            writer.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(c["original_max_position_embeddings"])))
        return
    if c.get("head_dim") is not None:
        writer.add_key_length(c["head_dim"])
        writer.add_value_length(c["head_dim"])
    if model_type == "gemma2":
        writer.add_attn_logit_softcapping(c["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(c["final_logit_softcapping"])
        writer.add_sliding_window(c["sliding_window"])
        return
    writer.add_rope_freq_base(global_rope["rope_theta"])
    if global_rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(global_rope["factor"])
    if "sliding_attention" in rope:
        writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    experts = c.get("num_local_experts") or c.get("num_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(c["num_experts_per_tok"])
    if model_type in ("llama", "mistral", "mixtral"):
        writer.add_vocab_size(c["vocab_size"])
        writer.add_rope_dimension_count(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
    if model_type == "qwen3_moe":
        writer.add_expert_feed_forward_length(c["moe_intermediate_size"])
    if model_type == "gemma3_text":
        if c.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(c["final_logit_softcapping"])
        if c.get("sliding_window_pattern") != 1:
            writer.add_sliding_window(c["sliding_window"])


def gguf_tensors(c: dict[str, Any], weights: dict[str, np.ndarray]) -> Iterator[tuple[str, np.ndarray]]:
    """(llama.cpp name, values) of every tensor the converter writes."""
    arch = ARCHITECTURES[c["model_type"]]
    gemma = c["model_type"] in ("gemma2", "gemma3_text")
    layer_names = GEMMA_LAYER_NAMES if gemma else LAYER_NAMES
    heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
    stacked: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for hf_name, values in weights.items():
        if c["model_type"] == "gemma2" and hf_name == "lm_head.weight":
            continue  # Gemma2Model drops it: llama.cpp ties Gemma 2's output to the embedding
        base, _, kind = hf_name.rpartition(".")
        if gemma and hf_name.endswith("norm.weight"):
            values = values + 1  # Gemma's RMSNorm computes (1 + w); llama.cpp's computes w
        if arch == gguf.MODEL_ARCH.LLAMA and base.endswith("self_attn.q_proj"):
            values = llama_cpp_permute(values, heads)
        elif arch == gguf.MODEL_ARCH.LLAMA and base.endswith("self_attn.k_proj"):
            values = llama_cpp_permute(values, kv_heads)
        if base in GLOBAL_NAMES:
            yield checked_name(arch, c, base, GLOBAL_NAMES[base]) + f".{kind}", values
            continue
        _, _, bid_text, rest = base.split(".", 3)
        bid = int(bid_text)
        for pattern in EXPERT_NAMES:
            head, _, tail = pattern.partition("{e}")
            if rest.startswith(head) and rest.endswith(tail):
                stacked.setdefault((bid, pattern), {})[int(rest[len(head): len(rest) - len(tail)])] = values
                break
        else:
            name = checked_name(arch, c, f"model.layers.{bid}.{rest}", f"blk.{bid}.{layer_names[rest]}")
            yield f"{name}.{kind}", values
    for (bid, pattern), experts in sorted(stacked.items()):
        merged, gguf_name = EXPERT_NAMES[pattern]
        name = checked_name(arch, c, merged.format(bid=bid), f"blk.{bid}.{gguf_name}")
        yield f"{name}.weight", np.stack([experts[e] for e in range(len(experts))])
    yield from rope_tensors(c)


def rope_tensors(c: dict[str, Any]) -> Iterator[tuple[str, np.ndarray]]:
    """LlamaModel's rope_freqs for Llama 3's rope scaling (a divisor of each rotary
    frequency), Phi3MiniModel's long and short factors for longrope."""
    rope = c.get("rope_parameters") or {}
    if rope.get("rope_type") == "llama3":
        dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
        factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old_context = rope["original_max_position_embeddings"]
        divisors = []
        for freq in freqs:
            wavelen = 2 * math.pi / freq
            if wavelen < old_context / high:
                divisors.append(1)
            elif wavelen > old_context / low:
                divisors.append(factor)
            else:
                smooth = (old_context / wavelen - low) / (high - low)
                divisors.append(1 / ((1 - smooth) / factor + smooth))
        yield "rope_freqs.weight", np.array(divisors, dtype=np.float32)
    elif rope.get("rope_type") == "longrope":
        yield "rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32)
        yield "rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32)


def checked_name(arch: gguf.MODEL_ARCH, c: dict[str, Any], hf_name: str, gguf_name: str) -> str:
    """``gguf_name``, once the gguf package agrees: it is a tensor llama.cpp declares for
    ``arch``, and the one its Hugging Face name map gives for ``hf_name``."""
    layers = c["num_hidden_layers"]
    declared = {gguf.TENSOR_NAMES[t].format(bid=bid) for t in gguf.MODEL_TENSORS[arch] for bid in range(layers)}
    assert gguf_name in declared, f"{gguf_name} is not a tensor of llama.cpp's {gguf.MODEL_ARCH_NAMES[arch]}"
    mapped = gguf.get_tensor_name_map(arch, layers).get_name(hf_name)
    assert mapped == gguf_name, f"gguf maps {hf_name} to {mapped}, not {gguf_name}"
    return gguf_name


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """LlamaModel.permute: each head's rotary halves interleaved (rows, or a bias)."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_byte_level_tokenizer(writer: gguf.GGUFWriter, vocab_size: int) -> None:
    """A GPT-2-style byte-level BPE vocabulary of ``vocab_size`` tokens (the 256 bytes,
    then two-letter merges) as _set_vocab_gpt2 writes one: the tiny models have no
    tokenizer of their own, and the tests feed token ids."""
    byte_symbols = bytes_to_unicode()
    letters = "abcdefghijklmnopqrstuvwxyz"
    pairs = [a + b for a in letters for b in letters][: vocab_size - 256]
    assert len(pairs) == vocab_size - 256, "vocabulary too small or too large for this tokenizer"
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([byte_symbols[b] for b in range(256)] + pairs)
    writer.add_token_types([gguf.TokenType.NORMAL] * vocab_size)
    writer.add_token_merges([f"{pair[0]} {pair[1]}" for pair in pairs])
