"""Disaggregated prefill/decode between two GPU workers placed as ``--instances
prefill:0,decode:0`` places them (skipped without a GPU; ``scripts/gpu_check`` runs it on
one GPU): the gateway's own cluster starts both workers, each seeing every GPU and bound
to its own; the decode worker reads the handed-off KV out of the prefill worker's device
pool by CUDA IPC (by request and by layer), and the client gets the tokens the prefill
worker gives alone."""

from __future__ import annotations

import asyncio

import pytest
import torch
from helpers.pd_harness import collect, pd_cluster, wait_stats

from memserve.ipc.messages import SamplingParams
from memserve.testing.random_models import TINY_SIZES, save_tiny_model

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PREFILL, DECODE = 0, 1
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
PROMPT_LENGTHS = (40, 70, 129)


async def handoffs(folder, transfer_mode: str) -> None:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, TINY_SIZES["vocab_size"], (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    async with pd_cluster(["prefill", "decode"], "pd-basic", transfer_mode=transfer_mode, model_dir=folder,
                          gpus=[0, 0]) as (client, _):
        answers = []
        for i, prompt in enumerate(prompts):
            answer, _, reason, error = await collect(client.generate(f"pd{i}", prompt, GREEDY))
            assert error is None and reason == "length"
            answers.append(answer)
        assert client.pd.counts["handoffs"] == len(prompts) and not client.pd.counts["handoff_failed"]
        # Read in place (the sender counts those): all but the first handoff, which may go as
        # frames while the decode worker's answer to the mapping handshake is on its way.
        assert await wait_stats(client, PREFILL, "in_place_sent", len(prompts)) >= len(prompts) - 1
        assert await wait_stats(client, DECODE, "resumed", len(prompts)) == len(prompts)
        for i, prompt in enumerate(prompts):
            alone, _, _, _ = await collect(client.generate(f"alone{i}", prompt, GREEDY, instance=PREFILL))
            assert alone == answers[i], i


@pytest.mark.parametrize("transfer_mode", ["by-request-agg", "by-layer"])
def test_two_workers_on_one_gpu_hand_off_kv_by_cuda_ipc(tmp_path, transfer_mode):
    save_tiny_model(tmp_path, "llama")
    asyncio.run(asyncio.wait_for(handoffs(tmp_path, transfer_mode), 240))
