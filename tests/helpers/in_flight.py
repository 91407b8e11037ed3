"""Sixteen greedy completions in flight on a live 2-worker `memserve up` (least-load
routing), 12 collected and 4 streamed, with a fault injected once every stream has
tokens; and the check that the clients saw what a run without the fault gives them: for
the tests of a worker's death, by its process or its Ray node."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp
import orjson

PROMPTS = [f"Story {i}: once upon a time, in a land of {thing}," for i, thing in enumerate(
    ["rivers", "mountains", "deserts", "forests", "islands", "glaciers", "canyons", "meadows",
     "volcanoes", "lakes", "caves", "valleys", "marshes", "cliffs", "plains", "reefs"])]
COLLECTED_TOKENS = 32
STREAMED_TOKENS = 48


def body(prompt: str, stream: bool) -> dict:
    return {"prompt": prompt, "temperature": 0, "ignore_eos": True, "stream": stream,
            "max_tokens": STREAMED_TOKENS if stream else COLLECTED_TOKENS,
            **({"stream_options": {"include_usage": True}, "logprobs": 1} if stream else {})}


async def collected(session: aiohttp.ClientSession, url: str, prompt: str) -> tuple[int, str]:
    async with session.post(url, json=body(prompt, False)) as r:
        answer = await r.json()
        return r.status, answer["choices"][0]["text"] if r.status == 200 else str(answer)


async def streamed(session: aiohttp.ClientSession, url: str, prompt: str, started: asyncio.Event) -> dict:
    """The stream as the client saw it: status, text, ids, usage, error events, [DONE]."""
    seen: dict = {"text": "", "tokens": [], "ids": set(), "usage": None, "errors": [], "done": False, "chunks": 0}
    async with session.post(url, json=body(prompt, True)) as r:
        seen["status"] = r.status
        async for line in r.content:
            if not line.startswith(b"data: "):
                continue
            payload = line[len(b"data: "):].strip()
            if payload == b"[DONE]":
                seen["done"] = True
                continue
            event = orjson.loads(payload)
            if "error" in event:
                seen["errors"].append(event)
                continue
            seen["ids"].add(event["id"])
            seen["usage"] = event.get("usage") or seen["usage"]
            for choice in event["choices"]:
                seen["text"] += choice["text"]
                seen["tokens"] += (choice["logprobs"] or {}).get("tokens", [])
                seen["chunks"] += bool(choice["text"])
            if seen["chunks"] >= 3:
                started.set()
    return seen


async def run(base_url: str, fault: Callable[[], None] | None) -> tuple[list[tuple[int, str]], list[dict]]:
    """Two streams (one per worker), then the 12 collected requests, then two more
    streams; with ``fault``, it is called (in a thread: it may block) once every stream
    has tokens (the collected requests, which arrived before the last two streams, have
    tokens too)."""
    url = base_url + "/v1/completions"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        flags = [asyncio.Event() for _ in range(4)]
        streams = []
        for i in range(2):
            streams.append(asyncio.create_task(streamed(session, url, PROMPTS[12 + i], flags[i])))
            await flags[i].wait()  # routed (least load): the first to worker 0, the second to worker 1
        answers = [asyncio.create_task(collected(session, url, p)) for p in PROMPTS[:12]]
        await asyncio.sleep(0.2)
        streams += [asyncio.create_task(streamed(session, url, PROMPTS[14 + i], flags[2 + i])) for i in range(2)]
        await asyncio.gather(*(flag.wait() for flag in flags))
        if fault is not None:
            await asyncio.to_thread(fault)
        return await asyncio.gather(*answers), await asyncio.gather(*streams)


def assert_as_without_the_fault(got: tuple[list[tuple[int, str]], list[dict]],
                                reference: tuple[list[tuple[int, str]], list[dict]]) -> None:
    """Every request answered 200 with the reference's text; every stream one stream (one
    id, no error event, a logprob for every token, usage as without the fault, fewer
    tokens cached than its prompt has)."""
    answers, streams = got
    reference_answers, reference_streams = reference
    assert [status for status, _ in answers] == [200] * len(answers), answers
    assert answers == reference_answers
    for seen, want in zip(streams, reference_streams):
        assert seen["status"] == 200 and seen["done"] and not seen["errors"], seen
        assert len(seen["ids"]) == 1 and seen["text"] == want["text"]
        assert seen["tokens"] == want["tokens"] and len(seen["tokens"]) == STREAMED_TOKENS  # logprobs carry on
        usage = {k: seen["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        assert usage == {k: want["usage"][k] for k in usage} and usage["completion_tokens"] == STREAMED_TOKENS
        assert seen["usage"]["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"]


def idle_and_whole(worker: dict) -> bool:
    """Running nothing, and every device block allocatable again."""
    return (worker["alive"] and worker["num_running"] == 0 and worker["num_waiting"] == 0
            and worker["free_blocks"]["device"] == worker["kv_blocks"]["device"]["total"])
