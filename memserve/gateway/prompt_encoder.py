"""Prompt tokenisation that neither stalls the event loop nor works on hopeless input.

Tokenising holds the GIL, even in a thread: one 3.9 MB prompt froze every other stream
(and /health) for seconds. So, first, a prompt longer than the context window could hold
whatever it says (``max_model_len`` x the most characters one token stands for) is
refused by its length alone, before any tokenising. Then a long prompt, or a long
conversation (the chat template is rendered with it), is tokenised in a small pool of
processes that each hold a copy of the tokenizer; short ones, the common case, stay
inline, where a process round trip would cost more than the work.

The pool starts on the first long prompt (spawned, not forked: the gateway has threads)."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Callable, TypeVar

import orjson

from memserve.gateway.errors import APIError
from memserve.text.tokenizer import Tokenizer

# Above this, work goes to the pool: ~10 ms of tokenising, well over a round trip's cost.
INLINE_MAX_CHARS = 8192
# Rendering a conversation costs about as much per message as this many characters.
MESSAGE_COST_CHARS = 32
DEFAULT_PROCESSES = min(2, os.cpu_count() or 1)

T = TypeVar("T")


class PromptTooLong(ValueError):
    """The text to tokenise has more characters than any prompt that fits."""

    def __init__(self, num_chars: int) -> None:
        super().__init__(num_chars)
        self.num_chars = num_chars


def _encode(tokenizer: Tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    return tokenizer.encode(text, add_special_tokens)


def _encode_chat(tokenizer: Tokenizer, messages: list[dict], max_chars: int, tools: list[dict] | None,
                 add_generation_prompt: bool, template_kwargs: dict | None) -> list[int]:
    """The rendered conversation is bounded like a completion prompt, before tokenising."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt, tools, template_kwargs)
    if len(text) > max_chars:
        raise PromptTooLong(len(text))
    return tokenizer.encode(text, add_special_tokens=False)


_process_tokenizer: Tokenizer | None = None  # in a pool process: its copy of the tokenizer


def _exit_when_orphaned(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def _load_tokenizer(tokenizer: Tokenizer, gateway: int) -> None:
    """Pool process initializer. The gateway stops its pool: Ctrl-C, which reaches the
    whole process group, is left to it; and a gateway killed outright (SIGKILL) cannot,
    so the process leaves by itself once it is orphaned (even before it got here)."""
    global _process_tokenizer
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_when_orphaned, args=(gateway,), daemon=True).start()
    _process_tokenizer = tokenizer


def _in_process(work: Callable[..., T], *args: object) -> T:
    assert _process_tokenizer is not None
    return work(_process_tokenizer, *args)


class PromptEncoder:
    """Token ids of completion prompts and chat conversations, for one tokenizer."""

    def __init__(self, tokenizer: Tokenizer, processes: int = DEFAULT_PROCESSES) -> None:
        self._tokenizer = tokenizer
        self._max_chars_per_token = tokenizer.max_chars_per_token  # now, at startup, not on a request
        self._processes = processes
        self._pool: ProcessPoolExecutor | None = None

    def max_prompt_chars(self, max_model_len: int) -> int:
        return max_model_len * self._max_chars_per_token

    async def encode(self, text: str, max_model_len: int, add_special_tokens: bool = True) -> list[int]:
        try:
            if len(text) > self.max_prompt_chars(max_model_len):
                raise PromptTooLong(len(text))
            return await self._run(len(text), _encode, text, add_special_tokens)
        except PromptTooLong as e:
            raise self._too_long(e, max_model_len, "prompt") from None

    async def encode_chat(self, messages: list[dict], max_model_len: int, tools: list[dict] | None = None,
                          add_generation_prompt: bool = True, template_kwargs: dict | None = None) -> list[int]:
        """Raises ``ChatTemplateError`` when the template refuses the conversation.
        ``tools`` (function definitions) are rendered too, and cost as their JSON does;
        ``template_kwargs``: the request's ``chat_template_kwargs``."""
        cost = sum(len(m["content"]) + len(m.get("reasoning_content", "")) + MESSAGE_COST_CHARS for m in messages) \
            + (len(orjson.dumps(tools)) if tools else 0)
        try:
            return await self._run(cost, _encode_chat, messages, self.max_prompt_chars(max_model_len), tools,
                                   add_generation_prompt, template_kwargs)
        except PromptTooLong as e:
            raise self._too_long(e, max_model_len, "messages") from None

    async def _run(self, cost: int, work: Callable[..., list[int]], *args: object) -> list[int]:
        if cost <= INLINE_MAX_CHARS:
            return work(self._tokenizer, *args)
        try:
            # Submitted from a thread: a submit may spawn a process, and handing it the
            # tokenizer (megabytes through a pipe) blocks until the new process reads it.
            future = await asyncio.to_thread(self._get_pool().submit, _in_process, work, *args)
            return await asyncio.wrap_future(future)
        except BrokenProcessPool:
            self._pool = None  # a tokenizer process died (killed?): the next long prompt starts a fresh pool
            raise APIError(503, "the tokenizer process failed; retry the request",
                           headers={"Retry-After": "1"}) from None

    def _too_long(self, error: PromptTooLong, max_model_len: int, param: str) -> APIError:
        return APIError(400, f"This model's maximum context length is {max_model_len} tokens, so a prompt can have "
                        f"at most {self.max_prompt_chars(max_model_len)} characters; yours has {error.num_chars}. "
                        "Please reduce the prompt.", param, "context_length_exceeded")

    def _get_pool(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(self._processes, multiprocessing.get_context("spawn"),
                                             initializer=_load_tokenizer, initargs=(self._tokenizer, os.getpid()))
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
