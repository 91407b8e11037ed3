"""LoRA adapters on the real engine (CPU, float32): tiny random base models and adapters
made with ``peft`` (different targets, ranks and alphas, one rsLoRA) give peft's greedy
tokens, each alone and all mixed in one batch with the base model; an adapter evicted
from the ready slots and read back gives the same tokens; adapters that do not fit are
refused naming why."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.hf_greedy import transformers_greedy
from helpers.one_thread import one_intra_op_thread  # noqa: F401 (autouse fixture)
from helpers.peft_adapters import make_adapter, peft_greedy

from memserve.config import EngineConfig
from memserve.ipc.messages import AddRequest, SamplingParams
from memserve.model_files.adapter_digest import adapter_digest
from memserve.testing.random_models import TINY_SIZES, save_tiny_model
from memserve.workers.model.lora import AdapterError
from memserve.workers.real_engine import build_engine

NEW_TOKENS = 8
PROMPT_LENGTHS = (5, 40, 17)
# name -> (LoraConfig options): attention only; MLP only; everything, rsLoRA.
ADAPTERS = {
    "attn": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
    "mlp": {"r": 4, "lora_alpha": 4, "target_modules": ["gate_proj", "up_proj", "down_proj"]},
    "all": {"r": 16, "lora_alpha": 8, "use_rslora": True,
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]},
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(base folder, adapter folders, prompts, reference tokens per adapter name or None)."""
    root = tmp_path_factory.mktemp("lora")
    base = save_tiny_model(root / "base", "qwen2")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, TINY_SIZES["vocab_size"], (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    reference: dict[str | None, list[list[int]]] = {None: transformers_greedy(base, prompts, NEW_TOKENS)}
    folders = {}
    for seed, (name, options) in enumerate(ADAPTERS.items()):
        folders[name] = root / name
        make_adapter(save_tiny_model(root / "scratch", "qwen2"), folders[name], seed, **options)
        reference[name] = peft_greedy(lambda: save_tiny_model(root / "scratch", "qwen2"), folders[name], prompts,
                                      NEW_TOKENS)
    assert len({tuple(map(tuple, r)) for r in reference.values()}) == len(reference)  # each adapter changes tokens
    return root / "base", folders, prompts, reference


def engine(base: Path, folders: dict[str, Path], **options):
    cfg = EngineConfig(model=str(base), dtype="float32", num_blocks=64, max_num_seqs=16, enable_lora=True,
                       lora_modules=[[n, str(f)] for n, f in folders.items()], **options)
    return build_engine(cfg, base)


def run(eng, requests: list[tuple[str, list[int], str | None]],
        adapters_per_step: list[int] | None = None) -> dict[str, list[int]]:
    """All requests added at once (one batch), greedy, to the end; ``adapters_per_step``
    collects how many adapters each step ran."""
    out: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    for rid, prompt, lora in requests:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, lora_name=lora)
        assert eng.add_request(AddRequest(rid, prompt, params)) is None
    while eng.has_work:
        for o in eng.step():
            out[o.request_id] += o.new_token_ids
        if adapters_per_step is not None:
            adapters_per_step.append(len({seq.params.lora_name for seq in eng.scheduler.running} - {None}))
    return out


def test_each_adapter_alone_gives_peft_tokens(served):
    base, folders, prompts, reference = served
    eng = engine(base, folders, max_loras=3)
    for name in (None, *ADAPTERS):
        got = run(eng, [(f"{name}-{i}", p, name) for i, p in enumerate(prompts)])
        assert [got[f"{name}-{i}"] for i in range(len(prompts))] == reference[name], name


@pytest.mark.parametrize("max_loras", [3, 1])
def test_adapters_and_base_mixed_in_one_batch(served, max_loras):
    """Every prompt under every adapter and the base, sent together: with three slots all
    adapters run in the same steps; with one, each step runs the base and one adapter
    (vLLM's --max-loras), the others wait and are read back in as the slot turns over."""
    base, folders, prompts, reference = served
    eng = engine(base, folders, max_loras=max_loras)
    requests = [(f"{name}-{i}", p, name) for name in (None, *ADAPTERS) for i, p in enumerate(prompts)]
    adapters_per_step: list[int] = []
    got = run(eng, requests, adapters_per_step)
    for name in (None, *ADAPTERS):
        assert [got[f"{name}-{i}"] for i in range(len(prompts))] == reference[name], name
    assert max(adapters_per_step) == max_loras
    loads = eng.runner.loras.loads
    assert run(eng, [("again", prompts[0], "mlp")])["again"] == reference["mlp"][0]
    assert eng.runner.loras.loads >= loads  # read back if it had been evicted, the same tokens either way
    if max_loras == 1:  # "mlp" ran before the last adapter took the slot: evicted, read again, the same tokens
        assert eng.runner.loras.loads > len(ADAPTERS)


def test_adapters_that_do_not_fit_are_refused_at_start(served, tmp_path):
    base, folders, _, _ = served
    make_adapter(save_tiny_model(tmp_path / "other", "qwen2", hidden_size=64), tmp_path / "other-adapter", 0, r=4,
                 target_modules=["q_proj"])
    make_adapter(save_tiny_model(tmp_path / "b", "qwen2"), tmp_path / "big", 0, r=32, target_modules=["q_proj"])
    (tmp_path / "empty").mkdir()
    for name, why in (("other-adapter", "another base model"), ("big", "rank 32 is over --max-lora-rank 16"),
                      ("empty", "not a LoRA adapter")):
        with pytest.raises(AdapterError, match=f"--lora-modules bad: .*{why}"):
            engine(base, {"bad": tmp_path / name})
    with pytest.raises(AdapterError, match="unknown LoRA adapter 'nope'"):
        engine(base, folders).runner.loras.key("nope", "")


def test_speculative_drafts_are_verified_through_the_adapter(served):
    """N-gram drafts from the prompt, verified by the model run through the adapter: the
    adapter's tokens (as without drafts, which equal peft's above), drafts proposed and
    accepted."""
    base, folders, prompts, reference = served
    echo = prompts[1] + reference["attn"][1] + prompts[1]  # tokens it produces are found in the prompt
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    plain = run(engine(base, folders), [("p", echo, "attn")])["p"]
    drafted = engine(base, folders, speculative_config=spec)
    assert run(drafted, [("s", echo, "attn")])["s"] == plain
    stats = drafted.stats()
    assert stats["spec_draft_tokens_total"] > 0 and stats["spec_accepted_tokens_total"] > 0


def test_adapters_loaded_and_unloaded_while_serving(served):
    """Runtime changes as the gateway makes them (requests carry the adapter's digest): an
    adapter loaded later serves peft's tokens; one unloaded while a request runs on it
    lets the requests sent before finish with its tokens, is dropped once nothing runs on
    it, and a request that still names it then fails with an error naming it; the name
    loaded again from other weights gives those weights' tokens and none of the old
    weights' cached KV; an adapter refused at run time is not served."""
    base, folders, prompts, reference = served
    eng = engine(base, {"attn": folders["attn"]}, max_loras=1)
    loras = eng.runner.loras
    eng.runner.set_adapter("mlp", str(folders["mlp"]))
    assert run(eng, [("m", prompts[0], "mlp")])["m"] == reference["mlp"][0]
    attn = adapter_digest(folders["attn"])

    def add(rid: str, prompt: list[int], digest: str) -> None:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, lora_name="attn",
                                lora_digest=digest)
        assert eng.add_request(AddRequest(rid, prompt, params)) is None

    add("running", prompts[1], attn)
    outputs = list(eng.step())  # its prefill: it runs on the adapter now
    eng.runner.set_adapter("attn", None)
    add("sent-before", prompts[2], attn)  # sent by the gateway before the unload reached it
    while eng.has_work:
        outputs += eng.step()
    for rid, i in (("running", 1), ("sent-before", 2)):
        assert [t for o in outputs if o.request_id == rid for t in o.new_token_ids] == reference["attn"][i]
    assert run(eng, [("base", prompts[0], None)])["base"] == reference[None][0]  # a step with nothing on it
    assert ("attn", attn) not in loras.slots  # so it was dropped
    add("late", prompts[0], attn)  # a request that still names it
    outputs = []
    while eng.has_work:
        outputs += eng.step()
    assert outputs[-1].finish_reason == "error" and "'attn' was unloaded" in (outputs[-1].error or "")
    eng.runner.set_adapter("attn", str(folders["all"]))
    swapped = adapter_digest(folders["all"])
    add("swapped", prompts[1], swapped)
    outputs = []
    while eng.has_work:
        outputs += eng.step()
    assert [t for o in outputs for t in o.new_token_ids] == reference["all"][1]
    assert outputs[-1].num_cached_tokens == 0  # the old weights' blocks are other blocks
    with pytest.raises(AdapterError, match="rank 32 is over"):
        big = folders["attn"].parent / "big-runtime"
        make_adapter(save_tiny_model(big.parent / "b2", "qwen2"), big, 0, r=32, target_modules=["q_proj"])
        eng.runner.set_adapter("big", str(big))
    assert "big" not in loras.served


def test_an_adapters_blocks_on_disk_are_found_after_a_restart_under_it_alone(served, tmp_path):
    """A prompt run through an adapter, its KV saved to the disk tier at a graceful close:
    the engine started again on the same directory finds it under that adapter (its
    tokens still peft's), and not under another adapter or the base model."""
    base, folders, prompts, reference = served
    options = {"disk_cache_dir": str(tmp_path / "kv"), "disk_cache_gb": 0.01, "num_host_blocks": 8}
    digests = {name: adapter_digest(folder) for name, folder in folders.items()}

    def once(eng, rid: str, lora: str | None) -> tuple[list[int], int]:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, lora_name=lora,
                                lora_digest=digests[lora] if lora else "")
        assert eng.add_request(AddRequest(rid, prompts[1], params)) is None
        tokens, cached = [], 0
        while eng.has_work:
            for o in eng.step():
                tokens += o.new_token_ids
                cached = max(cached, o.num_cached_tokens)
        return tokens, cached

    first = engine(base, folders, **options)
    assert once(first, "first", "attn") == (reference["attn"][1], 0)
    first.close()  # what the faster tiers cache goes to disk
    again = engine(base, folders, **options)
    assert once(again, "again", "attn") == (reference["attn"][1], 32)  # its two full blocks, from disk
    assert once(again, "other", "mlp") == (reference["mlp"][1], 0)
    assert once(again, "base", None) == (reference[None][1], 0)
