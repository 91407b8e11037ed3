"""A scripted fake engine behind the gateway's real HTTP app, and the client helpers to talk to it."""

from __future__ import annotations

import asyncio
import functools
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator

import orjson
from aiohttp.test_utils import TestClient, TestServer

from memserve.gateway.app import create_app
from memserve.gateway.engine_client import worker_entry
from memserve.ipc.messages import MemPoolStats, RequestOutput, SamplingParams, TierStats, WorkerStats
from memserve.text.tokenizer import Tokenizer

MODEL = "smollm2-test"
REPLY = "Hello! 😀 你好. The end is near."
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Greet me"}]


@dataclass
class FakeWorker:
    """A worker as the fake engine reports it: its latest heartbeat's stats, shown as the
    real engine client shows them."""

    instance_id: int
    stats: WorkerStats
    alive: bool = True

    def entry(self) -> dict:
        return {"instance_id": self.instance_id, "alive": self.alive, **worker_entry(self.stats)}


class FakeEngine:
    """An ``EngineClient`` that streams a scripted reply, one token per output, then EOS;
    it records what it was asked and which requests were aborted."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int = 256) -> None:
        self.max_model_len = max_model_len
        self.outputs = [[t] for t in tokenizer.encode(REPLY)] + [tokenizer.eos_token_ids[:1]]
        self.finish_reason = "stop"
        self.num_cached_tokens = 3
        self.delay_s = 0.0
        self.error: str | None = None  # reported on the last output
        self.exception: Exception | None = None  # raised before the first output
        self.requests: list[dict] = []
        self.aborted: list[str] = []
        busy = MemPoolStats(tiers={"device": TierStats(total=128, free=90, cached=12, evictable=10, used=28),
                                   "host": TierStats(total=512, free=400, used=112)})
        self.workers = [
            FakeWorker(0, WorkerStats(num_running=2, num_waiting=1, num_held_admissions=3, cache_hit_rate=0.25,
                                      cached_tokens_total=48, prompt_tokens_total=192, spec_draft_tokens_total=40,
                                      spec_accepted_tokens_total=25, mempool=busy)),
            FakeWorker(1, WorkerStats(mempool=MemPoolStats(tiers={"device": TierStats(total=128, free=128)}))),
        ]

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       session_id: str | None = None, slo: dict | None = None,
                       streaming: bool = True) -> AsyncIterator[RequestOutput]:
        self.requests.append({"request_id": request_id, "prompt_token_ids": prompt_token_ids, "params": params,
                              "session_id": session_id, "slo": slo, "streaming": streaming})
        if self.exception is not None:
            raise self.exception
        for i, token_ids in enumerate(self.outputs):
            await asyncio.sleep(self.delay_s)
            last = i == len(self.outputs) - 1
            yield RequestOutput(request_id, token_ids, finished=last,
                                finish_reason=("error" if self.error else self.finish_reason) if last else None,
                                num_prompt_tokens=len(prompt_token_ids), num_cached_tokens=self.num_cached_tokens,
                                error=self.error if last else None)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def stats(self) -> dict:
        return {"workers": [w.entry() for w in self.workers]}


def async_test(fn):
    """Run an async test function on a fresh event loop (no pytest-asyncio needed)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return asyncio.run(fn(*args, **kwargs))
    return wrapper


@asynccontextmanager
async def serve(engine: FakeEngine, tokenizer: Tokenizer, **app_kwargs) -> AsyncIterator[TestClient]:
    async with TestClient(TestServer(create_app(engine, tokenizer, MODEL, **app_kwargs))) as client:
        yield client


def sse_events(body: str) -> list[dict | str]:
    """Parse an SSE body into JSON events; ``[DONE]`` stays a string."""
    events: list[dict | str] = []
    for block in body.split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            payload = block[len("data: "):]
            events.append(payload if payload == "[DONE]" else orjson.loads(payload))
    return events


async def post(client: TestClient, path: str, body: dict) -> tuple[int, dict | list]:
    async with client.post(path, json=body) as resp:
        text = await resp.text()
        if resp.content_type == "text/event-stream":
            return resp.status, sse_events(text)
        return resp.status, orjson.loads(text)


def scripted(tokenizer: Tokenizer, reply: str) -> FakeEngine:
    """A fake engine that plays ``reply`` as the model's answer, one token an output, then EOS."""
    engine = FakeEngine(tokenizer)
    engine.outputs = [[t] for t in tokenizer.encode(reply, add_special_tokens=False)] + [tokenizer.eos_token_ids[:1]]
    return engine
