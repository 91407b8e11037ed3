"""The gateway side of ``--truncation``: which tokens an over-long chat loses
(whole blocks right after the system prompt), what the worker is told, and the 400 of
``error``; then a long conversation through the gateway onto a real in-process engine,
served from shifted KV (kv-shift) or recomputed (recompute)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer
from helpers.fake_engine import async_test

from memserve.config import EngineConfig
from memserve.gateway.app import create_app
from memserve.ipc.messages import AddRequest, RequestOutput, SamplingParams
from memserve.text.tokenizer import Tokenizer
from memserve.text.truncation import (
    CannotTruncate,
    Truncation,
    head_messages,
    overflows,
    prompt_limit,
    tail_messages,
    truncate,
)
from memserve.workers.engine.engine import Engine
from memserve.workers.real_engine import build_engine

BS = 16
MODEL = "SmolLM2-135M-Instruct"


# ----------------------------------------------------------------------------- pure policy


def test_truncate_drops_the_fewest_whole_blocks_after_the_head_blocks() -> None:
    prompt = list(range(100))
    cut = truncate(prompt, head_len=20, tail_len=30, limit=70, block_size=BS)
    assert cut.dropped_at == 32  # the head's 20 tokens end in block 1: blocks 0-1 stay
    assert cut.dropped_ids == list(range(32, 64))  # 30 too many -> 2 whole blocks
    assert cut.prompt_ids == list(range(32)) + list(range(64, 100)) and len(cut.prompt_ids) <= 70
    assert truncate(prompt, 20, 30, 100, BS) == Truncation(prompt)  # it fits: untouched


def test_truncate_never_cuts_into_the_head_or_the_last_message() -> None:
    with pytest.raises(CannotTruncate):
        truncate(list(range(100)), head_len=60, tail_len=1, limit=40, block_size=BS)  # 64 kept + 64 dropped > 99
    with pytest.raises(CannotTruncate):
        truncate(list(range(100)), head_len=20, tail_len=40, limit=70, block_size=BS)  # 32 + 32 > 100 - 40
    assert truncate(list(range(100)), head_len=20, tail_len=36, limit=70, block_size=BS).dropped_at == 32


def test_budget_and_head_messages() -> None:
    assert overflows(200, 256, 57) and not overflows(200, 256, 56)
    assert overflows(256, 256, None) and not overflows(255, 256, None)
    assert prompt_limit(256, 56) == 200 and prompt_limit(256, None) == 192  # a quarter kept for the answer
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}]
    assert head_messages(messages) == [messages[0], {"role": "user", "content": ""}]
    assert tail_messages(messages) == [messages[0], messages[2]] and tail_messages(messages[1:]) == [messages[2]]


# ----------------------------------------------------------------------------- the gateway


class RecordingEngine:
    """An ``EngineClient`` that answers one EOS and keeps what it was asked."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self.eos = tokenizer.eos_token_ids[:1]
        self.requests: list[tuple[list[int], SamplingParams]] = []

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       session_id: str | None = None, slo: dict | None = None,
                       streaming: bool = True) -> AsyncIterator[RequestOutput]:
        self.requests.append((prompt_token_ids, params))
        yield RequestOutput(request_id, self.eos, True, "stop", len(prompt_token_ids))

    async def abort(self, request_id: str) -> None:
        pass

    def stats(self) -> dict:
        return {"workers": []}


class InProcessEngine(RecordingEngine):
    """The real engine behind the gateway, stepped on the event loop's thread."""

    def __init__(self, tokenizer: Tokenizer, engine: Engine) -> None:
        super().__init__(tokenizer, engine.max_model_len)
        self.engine = engine

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       session_id: str | None = None, slo: dict | None = None,
                       streaming: bool = True) -> AsyncIterator[RequestOutput]:
        self.requests.append((prompt_token_ids, params))
        self.engine.add_request(AddRequest(request_id, prompt_token_ids, params))
        while True:
            for out in self.engine.step():
                yield out
                if out.finished:
                    return
            await asyncio.sleep(0)


@asynccontextmanager
async def serve(engine: RecordingEngine, tokenizer: Tokenizer, truncation: str) -> AsyncIterator[TestClient]:
    app = create_app(engine, tokenizer, MODEL, truncation=truncation, block_size=BS)
    async with TestClient(TestServer(app)) as client:
        yield client


def conversation(turns: int, words: int = 30) -> list[dict]:
    messages = [{"role": "system", "content": "You answer questions about numbers."}]
    for i in range(turns):
        messages.append({"role": "user", "content": f"Question {i}: " + " ".join(f"n{i}x{j}" for j in range(words))})
        messages.append({"role": "assistant", "content": f"Answer {i}: " + " ".join(f"a{j}" for j in range(words))})
    messages.append({"role": "user", "content": "And the last one?"})
    return messages


async def chat(client: TestClient, messages: list[dict], max_tokens: int) -> tuple[int, dict]:
    async with client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": max_tokens,
                                                         "temperature": 0}) as resp:
        return resp.status, await resp.json()


@pytest.mark.parametrize("mode", ["kv-shift", "recompute"])
@async_test
async def test_an_over_long_chat_keeps_its_system_prompt_and_loses_whole_blocks(tokenizer: Tokenizer,
                                                                               mode: str) -> None:
    engine = RecordingEngine(tokenizer, max_model_len=256)
    messages = conversation(6)
    full = tokenizer.encode_chat(messages)
    system = tokenizer.encode_chat(messages[:1], add_generation_prompt=False)
    assert len(full) > 256
    async with serve(engine, tokenizer, mode) as client:
        status, body = await chat(client, messages, max_tokens=32)
    assert status == 200, body
    [(prompt, params)] = engine.requests
    assert 256 - 32 - BS < len(prompt) <= 256 - 32  # the fewest whole blocks dropped
    dropped = len(full) - len(prompt)
    at = [a for a in range(0, len(prompt), BS) if prompt == full[:a] + full[a + dropped:]]
    assert dropped % BS == 0 and at and len(system) <= at[0] < len(system) + 2 * BS  # right after the system prompt
    if mode == "kv-shift":
        assert params.dropped_at in at
        assert prompt[: params.dropped_at] + params.dropped_token_ids + prompt[params.dropped_at :] == full
    else:
        assert params.dropped_at == 0 and params.dropped_token_ids == []
    assert body["usage"]["prompt_tokens"] == len(prompt)


@async_test
async def test_error_mode_answers_400_context_length_exceeded(tokenizer: Tokenizer) -> None:
    engine = RecordingEngine(tokenizer, max_model_len=256)
    async with serve(engine, tokenizer, "error") as client:
        status, body = await chat(client, conversation(6), max_tokens=32)
    assert status == 400 and engine.requests == []
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "context_length_exceeded"
    assert error["type"] == "BadRequestError" and "256" in error["message"]


@async_test
async def test_the_last_message_is_never_cut(tokenizer: Tokenizer) -> None:
    engine = RecordingEngine(tokenizer, max_model_len=256)
    messages = conversation(1) + [{"role": "assistant", "content": "ok"},
                                  {"role": "user", "content": "word " * 300}]
    async with serve(engine, tokenizer, "kv-shift") as client:
        status, body = await chat(client, messages, max_tokens=8)
    assert status == 400 and body["error"]["code"] == "context_length_exceeded" and engine.requests == []


@async_test
async def test_a_chat_that_fits_is_not_truncated(tokenizer: Tokenizer) -> None:
    engine = RecordingEngine(tokenizer, max_model_len=1024)
    messages = conversation(2)
    async with serve(engine, tokenizer, "kv-shift") as client:
        assert (await chat(client, messages, max_tokens=8))[0] == 200
    [(prompt, params)] = engine.requests
    assert prompt == tokenizer.encode_chat(messages) and params.dropped_token_ids == []


@async_test
async def test_a_long_conversation_is_served_from_shifted_kv(tokenizer: Tokenizer, model_dir: Path) -> None:
    """Turn 1 fits the 256-token window and is cached; turn 2 does not: with kv-shift
    the kept turns' blocks come from the cache (shifted), with recompute only the system
    prompt's blocks do. Same engine, two different conversations."""
    engine = InProcessEngine(tokenizer, build_engine(
        EngineConfig(dtype="float32", num_blocks=128, max_model_len=256, max_num_batched_tokens=256), model_dir))
    cached = {}
    for mode, topic in (("recompute", "apples"), ("kv-shift", "pears")):
        first = conversation(3, words=8)  # 226 tokens
        first[1]["content"] += f" about {topic}"
        async with serve(engine, tokenizer, mode) as client:
            status, body = await chat(client, first, max_tokens=2)
            assert status == 200, body
            second = first + [{"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                              {"role": "user", "content": "Now " + " ".join(f"m{j}" for j in range(12))}]
            assert len(tokenizer.encode_chat(second)) + 4 > 256  # over the window with its budget
            status, body = await chat(client, second, max_tokens=4)
            assert status == 200, body
        cached[mode] = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    head_blocks = -(-len(tokenizer.encode_chat(first[:1], add_generation_prompt=False)) // BS) * BS + BS
    assert cached["recompute"] <= head_blocks, cached
    assert cached["kv-shift"] > head_blocks + 2 * BS, cached
