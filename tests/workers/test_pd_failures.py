"""Failures in a disaggregated deployment, on real workers: a decode instance killed
while decoding (the request resumes on the other one with every token so far, and the
client sees the tokens it would have seen anyway); a decode instance that stops
answering during the handoff (the request goes to the other one within the handoff
timeout); a prefill instance killed mid-prefill (the request is retried on the other
prefill instance). Afterwards no worker holds a block for any of them. Each runs with
by-request-agg and with by-layer transfers (where the decode instance is named, and
receives KV, before the prefill ends)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import pytest
from helpers.pd_harness import collect, leaks, pd_cluster, settled, user_turns

from memserve.ipc.messages import SamplingParams

HANDOFF_TIMEOUT_S = 2.0


def long_answer(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


async def wait_ready(client, instance: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not client.cluster.workers[instance].alive or client.cluster.states()[instance] != "ok":
        assert time.monotonic() < deadline, f"worker {instance} did not come back"
        await asyncio.sleep(0.2)


def live_leaks(client) -> dict[int, int]:
    return {i: n for i, n in leaks(client).items() if client.cluster.states()[i] == "ok"}


async def decode_failures(transfer_mode: str) -> None:
    async with pd_cluster(["prefill", "decode", "decode"], "pd-caching-2", heartbeat_timeout_s=10.0,
                          handoff_timeout_s=HANDOFF_TIMEOUT_S, transfer_mode=transfer_mode) as (client, tok):
        prompt = tok.encode_chat([{"role": "user", "content": user_turns(1, 1)[0][0]}])
        reference, _, _, _ = await collect(client.generate("ref", prompt, long_answer(40), instance=0))

        # Decode instance 1 (the least loaded, lowest id) is killed after 12 tokens.
        tokens: list[int] = []
        reason = None
        async for out in client.generate("killed-decode", prompt, long_answer(40)):
            tokens += out.new_token_ids
            reason = out.finish_reason
            if len(tokens) >= 12 and client.cluster.workers[1].alive:
                assert client.streams["killed-decode"].worker == 1
                os.kill(client.cluster.workers[1].process.pid, signal.SIGKILL)
        assert reason == "length" and tokens == reference
        assert client.pd.counts["decode_lost"] == 1

        # Decode instance 2 caches the prompt now (the killed request finished there), so
        # it takes the next one (pd-caching-2 follows the prefix) and stops answering as
        # the handoff starts: once its heartbeats are late the handoff is given up and the
        # request goes to 1, back by then.
        await wait_ready(client, 1)
        frozen = client.cluster.workers[2].process.pid
        try:
            tokens = []
            async for out in client.generate("frozen-decode", prompt, long_answer(40)):
                if not tokens:
                    os.kill(frozen, signal.SIGSTOP)
                    first_at = time.monotonic()
                elif len(tokens) == 1:
                    resumed_after = time.monotonic() - first_at
                tokens += out.new_token_ids
                assert out.error is None
            assert tokens == reference
            assert resumed_after < 5 * HANDOFF_TIMEOUT_S + 10  # heartbeat checks, then D2's recompute
            if transfer_mode == "by-layer":  # the KV may have reached D before it froze: D is lost decoding
                assert client.pd.counts["handoff_failed"] + client.pd.counts["decode_lost"] == 2
            else:
                assert client.pd.counts["handoff_failed"] == 1
        finally:
            with contextlib.suppress(ProcessLookupError):  # the watcher may have declared it dead already
                os.kill(frozen, signal.SIGKILL)
        await asyncio.sleep(1.5)  # the watcher sees it die and restarts it
        left = await settled(client)
        assert not any(v for i, v in left.items() if i != 2), left


# by-layer is the slower variant of the same failure paths: `make test-all` runs it.
@pytest.mark.parametrize("transfer_mode", ["by-request-agg", pytest.param("by-layer", marks=pytest.mark.slow)])
def test_decode_instance_failures(transfer_mode):
    asyncio.run(decode_failures(transfer_mode))


async def prefill_failure(transfer_mode: str) -> None:
    async with pd_cluster(["prefill", "prefill", "decode"], "pd-caching-1", transfer_mode=transfer_mode) as (client,
                                                                                                           tok):
        text = " ".join(users[0] for users in user_turns(6, 1))
        prompt = tok.encode_chat([{"role": "user", "content": text}])
        reference, _, _, _ = await collect(client.generate("ref", prompt, long_answer(8), instance=1))
        streams = [asyncio.create_task(collect(client.generate(f"r{i}", prompt, long_answer(8)))) for i in range(3)]
        await asyncio.sleep(0.05)
        os.kill(client.cluster.workers[0].process.pid, signal.SIGKILL)  # least loaded: it took the first
        results = await asyncio.gather(*streams)
        for tokens, _, reason, error in results:
            assert (error is None and tokens == reference) or (reason == "error" and error), (tokens, error)
        assert sum(error is None for *_, error in results) >= 1
        await wait_ready(client, 0)
        assert await settled(client) == {0: 0, 1: 0, 2: 0}


@pytest.mark.slow
@pytest.mark.parametrize("transfer_mode", ["by-request-agg", "by-layer"])
def test_prefill_instance_killed_mid_prefill(transfer_mode):
    asyncio.run(prefill_failure(transfer_mode))
