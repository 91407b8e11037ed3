"""Tensor-parallel workers behind the gateway's engine client (real worker processes, each
with its rank processes; the embedded SmolLM2, 9 heads over 3 KV heads, at three ranks):

- disaggregated prefill and decode between two such workers (KV sent by request, every
  rank's share of each block; or by layer, every rank's share of each layer gathered as
  the prefill step computes it) gives the tokens of colocated serving at one rank, and
  leaves no block held on either side;
- a rank killed with SIGKILL under load takes its worker down as one: the worker's
  requests complete on the other worker, the worker comes back with new ranks, and no
  block stays held."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from helpers.pd_harness import collect, pd_cluster, settled, user_turns

from memserve.ipc.messages import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
RANKS = 3


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


async def answers(roles: list[str], tensor_parallel_size: int, prompts: list[list[int]],
                  transfer_mode: str = "by-request-agg") -> list[list[int]]:
    async with pd_cluster(roles, "pd-caching-3", tensor_parallel_size=tensor_parallel_size,
                          transfer_mode=transfer_mode) as (client, _):
        out = []
        for i, prompt in enumerate(prompts):
            tokens, _, _, error = await collect(client.generate(f"r{i}", prompt, GREEDY))
            assert error is None
            out.append(tokens)
        if "prefill" in roles:  # every request's KV went over, none was recomputed
            assert client.pd.counts["handoffs"] == len(prompts), dict(client.pd.counts)
            assert not client.pd.counts["resumed_without_kv"] and not client.pd.counts["handoff_failed"]
        assert not any((await settled(client)).values())
        return out


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("transfer_mode", ["by-request-agg", "by-layer"])
def test_pd_between_tensor_parallel_workers_gives_one_ranks_tokens(transfer_mode):
    from memserve.model_files.gguf_convert import ensure_model_dir
    from memserve.text.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(ensure_model_dir(None))
    prompts = [tok.encode_chat([{"role": "user", "content": users[0]}]) for users in user_turns(3, 1)]
    colocated = asyncio.run(answers(["colocated"], 1, prompts))
    assert asyncio.run(answers(["prefill", "decode"], RANKS, prompts, transfer_mode)) == colocated


@pytest.mark.timeout(300)
def test_a_killed_rank_takes_its_worker_down_as_one():
    async def scenario() -> None:
        async with pd_cluster(["colocated", "colocated"], "pd-caching-3", tensor_parallel_size=RANKS) as (client, tok):
            prompts = [tok.encode_chat([{"role": "user", "content": users[0]}]) for users in user_turns(4, 1)]
            params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
            tasks = [asyncio.create_task(collect(client.generate(f"k{i}", p, params))) for i, p in enumerate(prompts)]
            await asyncio.sleep(1.0)
            victim = client.cluster.workers[0]
            assert victim.process is not None
            pid = victim.process.pid
            ranks = children(pid)
            assert len(ranks) == RANKS - 1
            os.kill(ranks[-1], signal.SIGKILL)
            results = await asyncio.gather(*tasks)
            assert all(error is None and len(tokens) == 24 for tokens, _, _, error in results), results
            deadline = time.monotonic() + 120
            while not (victim.ready and victim.process is not None and victim.process.pid != pid):
                assert time.monotonic() < deadline, "the worker did not come back"
                await asyncio.sleep(0.2)
            assert not any((await settled(client)).values())

    asyncio.run(scenario())
