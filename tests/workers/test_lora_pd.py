"""A LoRA adapter's request handed from a prefill worker to a decode worker (real
processes, pd-caching-3, the embedded SmolLM2 with a rank-8 adapter made by ``peft``):
the decode side runs the adapter too (peft's greedy tokens), and the prompt's blocks,
named with the adapter at both ends of the handoff, are found again under it and never
under the base model."""

from __future__ import annotations

import asyncio

import pytest
from helpers.hf_greedy import transformers_greedy
from helpers.pd_harness import collect, pd_cluster
from helpers.peft_adapters import peft_greedy

from memserve.ipc.messages import SamplingParams
from memserve.model_files.adapter_digest import adapter_digest
from memserve.model_files.gguf_convert import ensure_model_dir
from memserve.testing.random_adapters import make_adapters

NEW_TOKENS = 8


@pytest.mark.slow  # two SmolLM2 workers with adapters, and peft's reference
def test_an_adapters_request_crosses_the_handoff_with_its_adapter_and_its_kv_apart(tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir = ensure_model_dir(None)
    folders = make_adapters(model_dir, tmp_path, 1, 8, std=0.05)
    prompt = list(range(1000, 1000 + 70))  # 4 full blocks and a partial one

    def base_model():
        return AutoModelForCausalLM.from_pretrained(model_dir)

    expected = {"adapter0": peft_greedy(base_model, tmp_path / "adapter0", [prompt], NEW_TOKENS)[0],
                None: transformers_greedy(base_model().eval(), [prompt], NEW_TOKENS)[0]}
    assert expected["adapter0"] != expected[None]

    async def scenario() -> list[tuple[list[int], int]]:
        async with pd_cluster(["prefill", "decode"], enable_lora=True,
                              lora_modules=[[n, f] for n, f in folders.items()]) as (client, _):
            out = []
            for i, lora in enumerate(("adapter0", "adapter0", None)):
                params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, lora_name=lora,
                                        lora_digest=adapter_digest(folders[lora]) if lora else "")
                tokens, cached, reason, error = await collect(client.generate(f"r{i}", prompt, params))
                assert error is None and reason == "length"
                out.append((tokens, cached))
            return out

    first, again, base = asyncio.run(scenario())
    assert first == (expected["adapter0"], 0)
    assert again == (expected["adapter0"], 64)  # its four full blocks, found under the adapter
    assert base == (expected[None], 0)  # never under the base model
