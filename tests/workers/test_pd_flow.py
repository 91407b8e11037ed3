"""Disaggregated prefill/decode on real workers (`prefill,decode`, pd-caching-3): the
client sees the same tokens as when the prefill instance serves the request alone
(greedy multi-turn ShareGPT, and seeded sampling with penalties: the first token counts
as output and the seed's draws carry over); the second turn's KV transfer moves only the
blocks the decode instance lacks; the decode-phase KV returns to the prefill instance,
whose next prefill reports it cached; aborts during the handoff and during decoding
leave no block held on either instance. On both same-host paths: the decode instance
reading the KV out of the prefill instance's pool (shm), and ZeroMQ frames (zmq)."""

from __future__ import annotations

import asyncio
import math

import pytest
from helpers.pd_harness import (
    BLOCK,
    collect,
    pd_cluster,
    settled,
    user_turns,
    wait_stats,
)

from memserve.ipc.messages import SamplingParams

PREFILL, DECODE = 0, 1
GREEDY = SamplingParams(max_tokens=16, temperature=0.0)
# SmolLM2-135M: 30 layers x (K, V) x 3 KV heads x 64 dims x 16 tokens x 4 bytes.
BLOCK_BYTES = 30 * 2 * 3 * 64 * BLOCK * 4


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


async def conversation(client, tok, name: str, users: list[str]) -> list[tuple[list[int], list[int], int]]:
    """Each turn's (prompt, answer, cached tokens), served disaggregated; between turns
    the answer's KV has gone back to the prefill instance (pd-caching-3)."""
    messages, turns = [], []
    for i, user in enumerate(users):
        messages.append({"role": "user", "content": user})
        prompt = tok.encode_chat(messages)
        returned = client.pd.counts["returned_blocks"]
        answer, cached, reason, error = await collect(client.generate(f"{name}-{i}", prompt, GREEDY))
        assert error is None and reason in ("stop", "length")
        turns.append((prompt, answer, cached))
        messages.append({"role": "assistant", "content": tok.decode(answer, skip_special_tokens=True)})
        for _ in range(80):  # the return runs in the background
            if client.pd.counts["returned_blocks"] > returned or client.pd.counts["return_failed"]:
                break
            await asyncio.sleep(0.1)
    return turns


async def scenario(transport: str) -> None:
    async with pd_cluster(["prefill", "decode"], "pd-caching-3", kv_same_host_transport=transport) as (client, tok):
        conversations = user_turns(2, 2)
        results = [await conversation(client, tok, f"c{n}", users) for n, users in enumerate(conversations)]
        assert client.pd.counts["handoffs"] == 4 and not client.pd.counts["handoff_failed"]

        # Turn 2 of the first conversation: P caches turn 1's prompt and answer (returned by
        # D), and D pinned what it held, so only the rest of the prompt moved.
        (p1, a1, _), (p2, _, cached2) = results[0]
        expect = min(common_prefix(p1 + a1[:-1], p2), len(p2) - 1) // BLOCK * BLOCK
        assert expect > len(p1) // BLOCK * BLOCK  # the answer's KV counts, not only the prompt's
        assert cached2 == expect

        sent = await wait_stats(client, PREFILL, "handoffs", 4)
        assert sent == 4
        stats = client.cluster.workers[PREFILL].stats.pd
        total_blocks = sum(math.ceil(len(p) / BLOCK) for turns in results for p, _, _ in turns)
        assert stats.blocks_skipped > 0
        assert stats.blocks_sent + stats.blocks_skipped == total_blocks
        assert stats.bytes_sent == stats.blocks_sent * BLOCK_BYTES
        assert 4 <= stats.messages <= stats.blocks_sent  # by-request-agg: a frame per run of blocks
        # shm: the handoffs and the returns all read in place, the other way round too
        assert (stats.in_place_sent >= 4) == (stats.in_place_received > 0) == (transport == "shm"), stats

        # The same prompts on the prefill instance alone give the same tokens.
        for n, turns in enumerate(results):
            for i, (prompt, answer, _) in enumerate(turns):
                alone, _, _, _ = await collect(client.generate(f"ref{n}-{i}", prompt, GREEDY, instance=PREFILL))
                assert alone == answer, (n, i)

        # Sampling with a seed and penalties: the first token (sampled on P) is output on D.
        prompt = tok.encode_chat([{"role": "user", "content": conversations[1][0]}])
        sampled = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=11, frequency_penalty=0.8,
                                 presence_penalty=0.4)
        disagg, _, _, _ = await collect(client.generate("seeded", prompt, sampled))
        alone, _, _, _ = await collect(client.generate("seeded-ref", prompt, sampled, instance=PREFILL))
        assert disagg == alone

        # Aborts: right after the first token (during the handoff) and while decoding.
        for stop_after in (1, 4):
            stream = client.generate(f"abort-{stop_after}", prompt, SamplingParams(max_tokens=200, temperature=0.0,
                                                                                   ignore_eos=True))
            seen = 0
            async for out in stream:
                seen += len(out.new_token_ids)
                if seen >= stop_after:
                    break
            await stream.aclose()
        assert await settled(client) == {PREFILL: 0, DECODE: 0}


# zmq is the slower variant of the same flow: `make test-all` runs it.
@pytest.mark.parametrize("transport", ["shm", pytest.param("zmq", marks=pytest.mark.slow)])
def test_disaggregated_flow_matches_the_prefill_instance_alone(transport):
    asyncio.run(scenario(transport))


async def handoff_during_a_long_prefill() -> None:
    """P names D while a request prefills, so the request's KV leaves when its prefill
    step ends. A long prompt arriving just after it must not hold the handoff up: the
    short request's second token (from D) comes before the long prompt's first (the end
    of P's next step). Naming D only after the first token left the ``HandoffStart``
    unread until that step ended, and the order was the other way round."""
    async with pd_cluster(["prefill", "decode"], "pd-basic", num_blocks=256) as (client, tok):
        # The short prompt's prefill step must still be running when the long one arrives
        # 50 ms later (else both share a step, or P is idle when D is named).
        short = tok.encode_chat([{"role": "user", "content": " ".join(u[0] for u in user_turns(32, 1)[:8])}])
        long = tok.encode_chat([{"role": "user", "content": " ".join(u[0] for u in user_turns(32, 1)[8:]) * 2}])
        assert len(long) > 1200 and 150 < len(short) < 400
        arrivals: dict[str, list[float]] = {"short": [], "long": []}

        async def run(name: str, prompt: list[int], delay_s: float) -> None:
            await asyncio.sleep(delay_s)
            params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
            async for out in client.generate(name, prompt, params):
                loop_time = asyncio.get_running_loop().time()
                arrivals[name] += [loop_time] * len(out.new_token_ids)

        await asyncio.gather(run("short", short, 0.0), run("long", long, 0.05))
        assert len(arrivals["short"]) == 4 and len(arrivals["long"]) == 4
        assert arrivals["short"][1] < arrivals["long"][0], arrivals
        assert await settled(client) == {PREFILL: 0, DECODE: 0}


@pytest.mark.slow  # over 10 s; `make test-all` runs it
def test_the_handoff_does_not_wait_for_the_next_prefill_step():
    asyncio.run(handoff_during_a_long_prefill())
