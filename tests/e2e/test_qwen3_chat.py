"""Qwen3 through the official ``openai`` client: the gateway on a loopback port with
``--tool-call-parser auto`` (Qwen3's template picks Hermes' ``<tool_call>`` tags) and
``--reasoning-parser qwen3``, Qwen3's published chat template on a tokenizer with
Qwen3's added tokens (helpers/tokenizer_files.py), and a scripted engine answering as
Qwen3 does. Every prompt the engine receives must be, token for token, what
transformers' ``apply_chat_template`` renders from the same messages and tools."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import openai
import pytest
from helpers.fake_engine import MODEL, FakeEngine, async_test, scripted, serve
from helpers.tokenizer_files import qwen3_tokenizer_folder
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion

from memserve.text.tokenizer import Tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
QUESTION = [{"role": "system", "content": "You are a weather assistant."},
            {"role": "user", "content": "What is the weather in Paris?"}]
THOUGHT = "The user wants the weather in Paris, which get_weather tells."
CALL = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
CALL_TEXT = f"<tool_call>\n{json.dumps(CALL)}\n</tool_call>"
# Qwen3's answer: its reasoning, then its call (the engine's EOS, <|im_end|>, follows).
REPLY = f"<think>\n{THOUGHT}\n</think>\n\n{CALL_TEXT}"
TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
# Qwen3's prompts with tools are longer than the fake engine's default window.
MAX_MODEL_LEN = 4096


@pytest.fixture(scope="module")
def qwen3_folder(tokenizer_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return qwen3_tokenizer_folder(tokenizer_folder, tmp_path_factory.mktemp("qwen3-tokenizer"))


@pytest.fixture(scope="module")
def qwen3(qwen3_folder: Path) -> Tokenizer:
    return Tokenizer.from_folder(qwen3_folder)


@pytest.fixture(scope="module")
def hf_qwen3(qwen3_folder: Path) -> Any:
    """The same folder in transformers: the reference renderer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen3_folder)


def qwen3_engine(tokenizer: Tokenizer, reply: str) -> FakeEngine:
    engine = scripted(tokenizer, reply)
    engine.max_model_len = MAX_MODEL_LEN
    return engine


@asynccontextmanager
async def qwen3_api(engine: FakeEngine, tokenizer: Tokenizer) -> AsyncIterator[openai.OpenAI]:
    """An ``openai.OpenAI`` client of the gateway, which aiohttp's test server serves on a
    loopback port. The client blocks: call it in a thread (``asyncio.to_thread``) so
    that the gateway, on this event loop, answers."""
    async with serve(engine, tokenizer, tool_call_parser="auto", reasoning_parser="qwen3") as client:
        yield openai.OpenAI(base_url=str(client.make_url("/v1")), api_key="unused", max_retries=0)


def complete(api: openai.OpenAI, stream: bool, **fields: Any) -> ChatCompletion:
    """One chat completion with the weather tool. Streamed, its chunks are put together
    by the openai library's own accumulator, and no delta may carry a tag."""
    if not stream:
        return api.chat.completions.create(model=MODEL, tools=[WEATHER], **fields)
    state: ChatCompletionStreamState = ChatCompletionStreamState()
    for chunk in api.chat.completions.create(model=MODEL, tools=[WEATHER], stream=True, **fields):
        for choice in chunk.choices:
            texts = (choice.delta.content or "", getattr(choice.delta, "reasoning_content", None) or "")
            assert not any(tag in text for tag in TAGS for text in texts), chunk
        state.handle_chunk(chunk)
    return state.get_final_completion()


def assert_prompt(engine: FakeEngine, tokenizer: Tokenizer, hf: Any, messages: list[dict], **kwargs: Any) -> str:
    """The engine's last prompt is what transformers renders (with ``kwargs``, Qwen3's
    ``enable_thinking``) and tokenises; returns that rendering."""
    want = hf.apply_chat_template(messages, tools=[WEATHER], add_generation_prompt=True, tokenize=False, **kwargs)
    prompt = engine.requests[-1]["prompt_token_ids"]
    assert tokenizer.decode(prompt, skip_special_tokens=False) == want
    assert prompt == hf.encode(want, add_special_tokens=False)
    return want


def assert_called(answer: ChatCompletion) -> None:
    """The answer is one call of ``CALL``, with no content (null; a stream's is the empty
    string its opening delta announces)."""
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content, choice
    calls = choice.message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [(CALL["name"], CALL["arguments"])]
    assert calls[0].id.startswith("call_")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@async_test
async def test_reasoning_then_tool_call(qwen3: Tokenizer, hf_qwen3: Any, stream: bool) -> None:
    engine = qwen3_engine(qwen3, REPLY)
    async with qwen3_api(engine, qwen3) as api:
        answer = await asyncio.to_thread(complete, api, stream, messages=QUESTION)
    assert_called(answer)
    assert getattr(answer.choices[0].message, "reasoning_content", None) == f"\n{THOUGHT}\n"
    assert assert_prompt(engine, qwen3, hf_qwen3, QUESTION).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@async_test
async def test_thinking_disabled(qwen3: Tokenizer, hf_qwen3: Any, stream: bool) -> None:
    """``enable_thinking: false``: the template writes an empty think block, and Qwen3
    calls at once, its answer carrying no reasoning."""
    engine = qwen3_engine(qwen3, CALL_TEXT)
    async with qwen3_api(engine, qwen3) as api:
        answer = await asyncio.to_thread(complete, api, stream, messages=QUESTION,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert_called(answer)
    assert getattr(answer.choices[0].message, "reasoning_content", None) is None
    prompt = assert_prompt(engine, qwen3, hf_qwen3, QUESTION, enable_thinking=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize("reasoning_back", [True, False], ids=["reasoning-back", "call-only"])
@async_test
async def test_tool_result_round_trip(qwen3: Tokenizer, hf_qwen3: Any, reasoning_back: bool) -> None:
    """An agent's loop: Qwen3's answer goes back as the assistant turn (as the openai
    library sends its message object: null content, and ``reasoning_content`` unless
    the agent drops it), then the tool's result as a ``tool`` message. The template
    renders the call in Hermes' tags, after its reasoning when that came back, and the
    result as a ``<tool_response>`` in a user turn."""
    result = '{"temperature": 21, "sky": "sunny"}'
    final = "It is 21 °C and sunny in Paris."
    engine = qwen3_engine(qwen3, REPLY)
    async with qwen3_api(engine, qwen3) as api:
        called = (await asyncio.to_thread(complete, api, False, messages=QUESTION)).choices[0].message
        turn = called.to_dict()
        if not reasoning_back:
            del turn["reasoning_content"]
        history = [*QUESTION, turn, {"role": "tool", "tool_call_id": turn["tool_calls"][0]["id"], "content": result}]
        engine.outputs = scripted(qwen3, f"<think>\nThe tool answered.\n</think>\n\n{final}").outputs
        answer = await asyncio.to_thread(complete, api, False, messages=history)
    message = answer.choices[0].message
    assert message.content == final and getattr(message, "reasoning_content", None) == "\nThe tool answered.\n"
    # The gateway reads a null content as empty; transformers drops null keys, and
    # Qwen3's template needs the content, so the reference is given it empty.
    prompt = assert_prompt(engine, qwen3, hf_qwen3, [*QUESTION, {**turn, "content": ""}, history[-1]])
    thought = f"<think>\n{THOUGHT}\n</think>\n\n" if reasoning_back else ""
    assert (f"<|im_start|>assistant\n{thought}{CALL_TEXT}<|im_end|>\n"
            f"<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n<|im_start|>assistant\n") in prompt
