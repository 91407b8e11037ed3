"""A short greedy conversation about Lyon on a live `memserve up`, and what its router
says of where requests went (/metrics): for the routing tests, on local or Ray workers."""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request
from dataclasses import dataclass

from openai import AsyncOpenAI

from helpers.live_server import workers

HEARTBEAT_S = 1.0  # WorkerConfig.heartbeat_s
MAX_TOKENS = 8
SYSTEM = ("You answer questions about the city of Lyon, briefly and precisely, in one sentence. Lyon lies in "
          "eastern France, at the confluence of two rivers, and is known for its old town, its silk weaving "
          "history, its traditional restaurants called bouchons, the Festival of Lights every December and the "
          "basilica of Notre-Dame de Fourviere on its hill. Keep every answer short, factual and friendly.")
TURNS = ["What river runs through Lyon?", "And which second river joins it there?"]
LONG = "Now tell me a long story about the old town."


def router_metrics(server) -> dict[str, float]:
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {m[0]: float(m[1]) for m in re.findall(r"^(memserve_router_\S+) (\S+)$", text, re.MULTILINE)}


def routed(server, instance: int) -> float:
    return router_metrics(server).get(f'memserve_router_routed_requests_total{{instance="{instance}"}}', 0.0)


def routed_counts(server) -> dict[int, float]:
    """Requests routed so far to each worker (dead ones too)."""
    return {i: routed(server, i) for i in workers(server)}


def decisions(server, reason: str) -> float:
    metrics = router_metrics(server)
    return sum(v for k, v in metrics.items() if k.startswith("memserve_router_decisions_total") and
               f'reason="{reason}"' in k)


def holder_of_last_request(server, before: dict[int, float]) -> int:
    """The one worker routed a request since ``before`` (``routed_counts``)."""
    moved = [i for i in before if routed(server, i) > before[i]]
    assert len(moved) == 1, moved
    return moved[0]


def wait_idle(server, timeout_s: float = 20.0) -> None:
    """Until no worker runs or queues a request (the dropped stream was aborted
    everywhere), as the heartbeats report it."""
    time.sleep(HEARTBEAT_S)  # no stale heartbeat from before the drop
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        workers = server.get_json("/health")["workers"]
        if all(w["num_running"] == 0 and w["num_waiting"] == 0 for w in workers):
            return
        time.sleep(0.2)
    raise AssertionError("workers still busy")


def messages(answers: list[str], upto: int, last: str | None = None) -> list[dict]:
    msgs = [{"role": "system", "content": SYSTEM}]
    for turn, answer in zip(TURNS[:upto], answers):
        msgs += [{"role": "user", "content": turn}, {"role": "assistant", "content": answer}]
    return msgs + [{"role": "user", "content": last or TURNS[upto]}]


async def ask(client: AsyncOpenAI, server, msgs: list[dict]) -> tuple[str, int]:
    r = await client.chat.completions.create(model=server.model, messages=msgs, max_tokens=MAX_TOKENS,
                                             temperature=0)
    details = r.usage.prompt_tokens_details
    return r.choices[0].message.content, (details.cached_tokens or 0) if details else 0


def chat(server, msgs: list[dict]) -> tuple[str, int]:
    """``ask`` with a client of its own, outside an event loop."""
    async def one() -> tuple[str, int]:
        async with AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x") as client:
            return await ask(client, server, msgs)

    return asyncio.run(one())


async def streaming_while(client: AsyncOpenAI, server, msgs: list[dict], body) -> object:
    """Run ``body()`` while a long streamed request decodes (it is dropped after)."""
    stream = await client.chat.completions.create(model=server.model, messages=msgs, max_tokens=400, stream=True,
                                                  temperature=0, extra_body={"ignore_eos": True})
    try:
        async for _ in stream:  # its first token: it is decoding on its worker
            break
        return await body()
    finally:
        await stream.close()


@dataclass
class SecondTurn:
    """Where a conversation's two turns went, and what they answered."""

    texts: list[str]
    first_on: int  # the worker that served the first turn
    second_on: int  # the worker that served the second
    cache_hits: float  # cache-hit decisions the second turn added
    cached_tokens: int  # prompt tokens of the second turn found cached


async def second_turn_after_a_busy_start(server) -> SecondTurn:
    """The conversation's first turn while worker 0 decodes a long request (so that it
    starts elsewhere), its second once every worker is idle (least-load would send it to
    worker 0)."""
    async with AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x") as client:
        async def first_turn() -> tuple[str, int]:
            before = routed_counts(server)
            answer, _ = await ask(client, server, messages([], 0))
            return answer, holder_of_last_request(server, before)

        first, first_on = await streaming_while(client, server, [{"role": "user", "content": LONG}], first_turn)
        await asyncio.to_thread(wait_idle, server)
        hits = decisions(server, "cache_hit")
        before = routed_counts(server)
        second, cached = await ask(client, server, messages([first], 1))
        return SecondTurn([first, second], first_on, holder_of_last_request(server, before),
                          decisions(server, "cache_hit") - hits, cached)
