"""Failures in a disaggregated deployment, on real workers: a decode instance killed
while decoding (the request resumes on the other one with every token so far, and the
client sees the tokens it would have seen anyway); a decode instance that stops
answering during the handoff (the request goes to the other one within the handoff
timeout); a prefill instance killed mid-prefill (the request is retried on the other
prefill instance). With one instance of each role, the survivor of either takes the
other's requests over. Afterwards no worker holds a block for any of them. The first
three run with by-request-agg and with by-layer transfers (where the decode instance is
named, and receives KV, before the prefill ends). The decode failures run with the KV
read in place (shm, the default) and as ZeroMQ frames (zmq)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
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


async def wait_restarted(client, instance: int, old_pid: int, timeout_s: float = 120.0) -> None:
    """Until the watcher has replaced the process ``old_pid`` of ``instance`` and the new one is ready."""
    deadline = time.monotonic() + timeout_s
    while client.cluster.workers[instance].process is None or client.cluster.workers[instance].process.pid == old_pid:
        assert time.monotonic() < deadline, f"worker {instance} was not restarted"
        await asyncio.sleep(0.2)
    await wait_ready(client, instance, timeout_s)


def live_leaks(client) -> dict[int, int]:
    return {i: n for i, n in leaks(client).items() if client.cluster.states()[i] == "ok"}


async def decode_failures(transfer_mode: str, transport: str = "shm") -> None:
    async with pd_cluster(["prefill", "decode", "decode"], "pd-caching-2", heartbeat_timeout_s=10.0,
                          handoff_timeout_s=HANDOFF_TIMEOUT_S, transfer_mode=transfer_mode,
                          kv_same_host_transport=transport) as (client, tok):
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
        # it takes the next one (pd-caching-2 follows the prefix), but it stops answering
        # before the request is sent (frozen at the first token, a fast handoff could have
        # finished already): once its heartbeats are late the handoff is given up and the
        # request goes to 1, back by then.
        await wait_ready(client, 1)
        frozen = client.cluster.workers[2].process.pid
        try:
            tokens = []
            os.kill(frozen, signal.SIGSTOP)
            async for out in client.generate("frozen-decode", prompt, long_answer(40)):
                if not tokens:
                    first_at = time.monotonic()
                elif len(tokens) == 1:
                    resumed_after = time.monotonic() - first_at
                tokens += out.new_token_ids
                assert out.error is None
            assert tokens == reference
            assert resumed_after < 5 * HANDOFF_TIMEOUT_S + 10  # heartbeat checks, then D2's recompute
            if transfer_mode == "by-layer":  # the KV may have reached D before it froze: D is lost decoding
                assert client.pd.counts["handoff_failed"] + client.pd.counts["decode_lost"] == 2
            else:  # D2's silence fails the handoff, or fails the naming and the handoff goes to 1
                counts = client.pd.counts
                assert (counts["handoff_failed"], counts["handoffs"]) in ((1, 1), (0, 2)), dict(counts)
        finally:
            with contextlib.suppress(ProcessLookupError):  # the watcher may have declared it dead already
                os.kill(frozen, signal.SIGKILL)
        await wait_restarted(client, 2, frozen)
        left = await settled(client)
        assert not any(v for i, v in left.items() if i != 2), left


# by-layer and zmq are slower variants of the same failure paths: `make test-all` runs them.
@pytest.mark.parametrize("transfer_mode,transport", [
    ("by-request-agg", "shm"),
    pytest.param("by-request-agg", "zmq", marks=pytest.mark.slow),
    pytest.param("by-layer", "shm", marks=pytest.mark.slow),
])
def test_decode_instance_failures(transfer_mode, transport):
    asyncio.run(decode_failures(transfer_mode, transport))


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
        # Nothing had streamed from the killed instance: each of its requests is retried on
        # the other prefill instance, and every client gets the tokens it would have got.
        for tokens, _, reason, error in results:
            assert error is None and reason == "length" and tokens == reference, (tokens, reason, error)
        await wait_ready(client, 0)
        assert await settled(client) == {0: 0, 1: 0, 2: 0}


@pytest.mark.slow
@pytest.mark.parametrize("transfer_mode", ["by-request-agg", "by-layer"])
def test_prefill_instance_killed_mid_prefill(transfer_mode):
    asyncio.run(prefill_failure(transfer_mode))


async def lone_instance_failures() -> None:
    async with pd_cluster(["prefill", "decode"], "pd-caching-3") as (client, tok):
        prompt = tok.encode_chat([{"role": "user", "content": user_turns(1, 1)[0][0]}])
        reference, _, _, _ = await collect(client.generate("ref", prompt, long_answer(40), instance=0))

        # The decode instance is killed after 12 tokens: the prefill instance decodes the rest.
        tokens: list[int] = []
        async for out in client.generate("killed-decode", prompt, long_answer(40)):
            assert out.error is None
            tokens += out.new_token_ids
            if len(tokens) >= 12 and client.cluster.workers[1].alive:
                assert client.streams["killed-decode"].worker == 1
                os.kill(client.cluster.workers[1].process.pid, signal.SIGKILL)
        assert tokens == reference and client.pd.counts["decode_lost"] == 1
        await wait_ready(client, 1)

        # The prefill instance is killed while it prefills: the decode instance runs it all.
        text = " ".join(users[0] for users in user_turns(6, 1))
        long_prompt = tok.encode_chat([{"role": "user", "content": text}])
        reference, _, _, _ = await collect(client.generate("ref-long", long_prompt, long_answer(8), instance=1))
        request = asyncio.create_task(collect(client.generate("killed-prefill", long_prompt, long_answer(8))))
        await asyncio.sleep(0.05)
        os.kill(client.cluster.workers[0].process.pid, signal.SIGKILL)
        tokens, _, reason, error = await request
        assert error is None and reason == "length" and tokens == reference
        await wait_ready(client, 0)
        assert await settled(client) == {0: 0, 1: 0}


@pytest.mark.slow  # two worker restarts: about a minute on 2 busy cores
def test_a_lone_instance_of_either_role_takes_over_the_requests_of_the_other(caplog):
    """One prefill and one decode instance: a request whose decode instance dies mid-decode
    finishes on the prefill instance, one whose prefill instance dies mid-prefill runs on
    the decode instance; neither gets an error, both the tokens they would have got."""
    with caplog.at_level(logging.WARNING, "memserve.gateway"):
        asyncio.run(lone_instance_failures())
    assert "its prefill instance died; running it on decode instance 1" in caplog.text
