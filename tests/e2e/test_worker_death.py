"""A worker's death costs clients nothing, on a real `memserve up --cpu-workers 2`: one
worker is SIGKILLed while 12 collected and 4 streamed greedy completions are in flight,
and every one is answered 200 with the text a run without the kill gives. The collected
ones on the dead worker are re-run on the other; the streamed ones resume there after
their last sent token, and the client sees one stream (one id, no error event, a
logprob for every token, usage as without the kill). The surviving worker holds no KV block once the requests are done,
and the dead one is being restarted."""

from __future__ import annotations

import asyncio
import os
import signal

import aiohttp
import orjson
import pytest
from helpers.live_server import wait_until, workers
from helpers.paths import REPO

from memserve.bench.server_process import start_server, stop_server

NUM_BLOCKS = 256
PROMPTS = [f"Story {i}: once upon a time, in a land of {thing}," for i, thing in enumerate(
    ["rivers", "mountains", "deserts", "forests", "islands", "glaciers", "canyons", "meadows",
     "volcanoes", "lakes", "caves", "valleys", "marshes", "cliffs", "plains", "reefs"])]
COLLECTED_TOKENS = 32
STREAMED_TOKENS = 48


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    handle = start_server(["--cpu-workers", "2", "--num-blocks", str(NUM_BLOCKS), "--router", "least-load"],
                          tmp_path_factory.mktemp("worker-death") / "memserve.log", threads=1, cwd=REPO)
    yield handle
    stop_server(handle)


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


async def run(base_url: str, kill_pid: int | None) -> tuple[list[tuple[int, str]], list[dict]]:
    """Two streams (one per worker), then the 12 collected requests, then two more
    streams; with ``kill_pid``, that worker is SIGKILLed once every stream has tokens
    (the collected requests, which arrived before the last two streams, have tokens too)."""
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
        if kill_pid is not None:
            os.kill(kill_pid, signal.SIGKILL)
        return await asyncio.gather(*answers), await asyncio.gather(*streams)


def idle_and_whole(worker: dict) -> bool:
    """Running nothing, and every device block allocatable again."""
    return (worker["alive"] and worker["num_running"] == 0 and worker["num_waiting"] == 0
            and worker["free_blocks"]["device"] == worker["kv_blocks"]["device"]["total"])


@pytest.mark.slow  # a 2-worker server and two runs of 16 requests: 35-90 s on 2 cores
def test_a_killed_worker_costs_the_clients_nothing(server):
    reference_answers, reference_streams = asyncio.run(run(server.base_url, None))
    assert all(status == 200 for status, _ in reference_answers), reference_answers
    wait_until(lambda: all(map(idle_and_whole, workers(server).values())), 30, "the reference run to settle")
    victim = workers(server)[0]

    answers, streams = asyncio.run(run(server.base_url, victim["pid"]))

    assert [status for status, _ in answers] == [200] * 12, answers
    assert answers == reference_answers
    for got, want in zip(streams, reference_streams):
        assert got["status"] == 200 and got["done"] and not got["errors"], got
        assert len(got["ids"]) == 1 and got["text"] == want["text"]
        assert got["tokens"] == want["tokens"] and len(got["tokens"]) == STREAMED_TOKENS  # logprobs carry on
        usage = {k: got["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        assert usage == {k: want["usage"][k] for k in usage} and usage["completion_tokens"] == STREAMED_TOKENS
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"]
    log = server.log_path.read_text()
    assert "worker 0 died" in log and "resume on worker 1" in log and "rerun on worker 1" in log
    # The survivor took them all and holds no block for any; the dead worker is being restarted.
    wait_until(lambda: idle_and_whole(workers(server)[1]), 30, "worker 1 to free every KV block")
    restarted = workers(server)[0]
    assert restarted["restarts"] == 1 and restarted["pid"] != victim["pid"]
