"""Our Llama model over the paged KV cache must decode greedily exactly like Hugging Face
transformers, loaded independently from the same GGUF: a batch of plain and chat prompts,
chunked prefill, mixed prefill/decode batches and both KV layouts; plus tiny random
models for the variants SmolLM2 does not use (biases, untied head, rope scalings, sparse
mixture-of-experts MLPs)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from memserve.model_files.default_model import default_gguf_path
from memserve.workers.model.attention import AttentionMetadata, allocate_kv_cache
from memserve.workers.model.llama import LlamaForCausalLM
from memserve.workers.model.loader import load_model
from memserve.workers.model.model_config import ModelConfig

NEW_TOKENS = 32
BLOCK_SIZE = 16
PLAIN_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]
CHAT_PROMPTS = [
    "What is the boiling point of water at sea level?",
    "Write a haiku about autumn leaves.",
]


@dataclass
class Sequence:
    tokens: list[int]
    prompt_len: int
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]


class PagedGreedyDriver:
    """Drives the model the way the engine does: flattened batches, block tables, slots."""

    def __init__(self, model: LlamaForCausalLM, layout: str = "aggregated", num_blocks: int = 96):
        cfg = model.config
        self.model, self.layout = model, layout
        self.cache = allocate_kv_cache(
            num_blocks, cfg.num_layers, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu", layout
        )
        self.free_blocks = list(range(num_blocks))  # block 0 included: it is also the table padding
        random.Random(0).shuffle(self.free_blocks)  # scattered blocks, as after some churn

    def step(self, schedule: list[tuple[Sequence, int]]) -> torch.Tensor:
        """Compute ``n`` more tokens of each scheduled sequence; sequences whose known tokens
        are then all computed get their greedy next token appended. Returns the hidden states."""
        input_ids, positions, slots, starts, context_lens = [], [], [], [0], []
        for seq, n in schedule:
            end = seq.num_computed + n
            while len(seq.blocks) * BLOCK_SIZE < end:
                seq.blocks.append(self.free_blocks.pop())
            for pos in range(seq.num_computed, end):
                input_ids.append(seq.tokens[pos])
                positions.append(pos)
                slots.append(seq.blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            starts.append(starts[-1] + n)
            context_lens.append(end)
        width = max(len(seq.blocks) for seq, _ in schedule)
        tables = torch.tensor([seq.blocks + [0] * (width - len(seq.blocks)) for seq, _ in schedule])
        meta = AttentionMetadata(torch.tensor(slots), starts, context_lens, tables, BLOCK_SIZE, self.layout)
        hidden = self.model(torch.tensor(input_ids), torch.tensor(positions), self.cache, meta)
        finishing = [i for i, (seq, n) in enumerate(schedule) if seq.num_computed + n == len(seq.tokens)]
        next_tokens = self.model.compute_logits(hidden[[starts[i + 1] - 1 for i in finishing]]).argmax(-1).tolist()
        for seq, n in schedule:
            seq.num_computed += n
        for i, token in zip(finishing, next_tokens):
            schedule[i][0].tokens.append(token)
        return hidden

    def generate(self, prompts: list[list[int]], chunk: int = 10_000, stagger: int = 0) -> list[list[int]]:
        """Greedy NEW_TOKENS for every prompt; prompt i joins at step i * stagger and its
        prompt is prefilled ``chunk`` tokens per step."""
        seqs = [Sequence(list(p), len(p)) for p in prompts]
        step = 0
        while any(len(s.generated) < NEW_TOKENS for s in seqs):
            schedule = [
                (seq, min(chunk, len(seq.tokens) - seq.num_computed))
                for i, seq in enumerate(seqs)
                if step >= i * stagger and len(seq.generated) < NEW_TOKENS
            ]
            self.step(schedule)
            step += 1
        return [s.generated for s in seqs]


@pytest.fixture(scope="module", autouse=True)
def one_intra_op_thread():
    """Decoding this small model is memory-bound, so a second thread gains little, while on
    a shared 2-core machine two spinning OpenMP threads run several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def prompts(model_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    chats = [
        tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=False)
        for c in CHAT_PROMPTS
    ]
    return [tok(text).input_ids for text in PLAIN_PROMPTS + chats]


@pytest.fixture(scope="module")
def reference(prompts) -> list[list[int]]:
    """Hugging Face greedy tokens, from its own GGUF loader (independent of our converter)."""
    from transformers import AutoModelForCausalLM

    gguf = default_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    out = []
    for ids in prompts:
        input_ids = torch.tensor([ids])
        generated = hf.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),  # pad id == <|im_end|>: never infer a mask
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,  # always NEW_TOKENS tokens, even past end-of-turn
        )
        out.append(generated[0, len(ids) :].tolist())
    assert all(len(tokens) == NEW_TOKENS for tokens in out)
    return out


@pytest.fixture(scope="module")
def model(model_dir) -> LlamaForCausalLM:
    return load_model(model_dir, torch.float32, "cpu")


def test_greedy_matches_transformers(model, prompts, reference):
    """All prompts decoded together: their prefills in one step, then batched decodes."""
    assert PagedGreedyDriver(model).generate(prompts) == reference


def test_prefill_in_two_chunks_matches(model, prompts, reference):
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    ids = prompts[longest]
    assert PagedGreedyDriver(model).generate([ids], chunk=(len(ids) + 1) // 2) == [reference[longest]]


def test_batched_steps_mixing_prefill_and_decode_match(model, prompts, reference):
    """Prompts of 5, 41 and 18 tokens joining one step apart, prefilled 12 tokens per step:
    steps mix decodes with prefill chunks that attend to their cached earlier chunks, and
    in step 4 a prefill chunk sits between two decodes in the flat batch."""
    chosen = [0, 3, 1]
    generated = PagedGreedyDriver(model).generate([prompts[i] for i in chosen], chunk=12, stagger=1)
    assert generated == [reference[i] for i in chosen]


def test_layer_major_layout_matches(model, prompts, reference):
    chosen = [1, 4]
    generated = PagedGreedyDriver(model, layout="layer-major").generate([prompts[i] for i in chosen], stagger=1)
    assert generated == [reference[i] for i in chosen]


TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


@pytest.mark.parametrize(
    ("architecture", "options"),
    [
        ("LlamaConfig", {"tie_word_embeddings": False, "attention_bias": True, "mlp_bias": True, "rope_parameters": LLAMA3_ROPE}),
        ("LlamaConfig", {"tie_word_embeddings": True, "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}),
        ("Qwen2Config", {"tie_word_embeddings": False}),
        ("Qwen3Config", {"tie_word_embeddings": False, "head_dim": 16}),
        ("Qwen3Config", {"tie_word_embeddings": True, "head_dim": 32}),
        ("Qwen3MoeConfig", {"head_dim": 16, "num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 32,
                            "norm_topk_prob": False, "decoder_sparse_step": 2}),
        ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "tie_word_embeddings": True}),
        ("Phi3Config", {"partial_rotary_factor": 0.5, "pad_token_id": 0}),
        ("Phi3Config", {"tie_word_embeddings": True, "pad_token_id": 0}),
    ],
)
def test_tiny_random_variants_match_transformers_logits(tmp_path, architecture, options):
    """Biases, untied heads, rotary scalings, Phi-3's fused weights and partial rotary, and
    MoE routing (Qwen3-MoE with a dense layer between sparse ones, top-3 unnormalised;
    Mixtral) the default model does not exercise:
    a tiny random model saved by transformers must give the same logits through our
    loader, prefilled in two chunks (the second attends to the cached first)."""
    import transformers

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(getattr(transformers, architecture)(**TINY, **options)).eval()
    with torch.no_grad():
        for param in hf.parameters():
            param.normal_(0.0, 0.2)
    hf.save_pretrained(tmp_path)
    ids = torch.randint(0, TINY["vocab_size"], (70,)).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]

    model = load_model(tmp_path, torch.float32, "cpu")
    driver, seq = PagedGreedyDriver(model, num_blocks=8), Sequence(list(ids), len(ids))
    hidden = torch.cat([driver.step([(seq, 45)]), driver.step([(seq, 25)])])
    torch.testing.assert_close(model.compute_logits(hidden), expected, atol=1e-4, rtol=1e-4)


def test_config_reads_legacy_rope_spelling():
    legacy = {**TINY, "model_type": "llama", "rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 4.0}}
    config = ModelConfig.from_dict(legacy)
    assert config.rope_parameters == {"rope_type": "linear", "rope_theta": 500000.0, "factor": 4.0}
    assert ModelConfig.from_dict({**TINY, "model_type": "qwen2"}).qkv_bias
