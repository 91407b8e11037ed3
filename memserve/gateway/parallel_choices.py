"""``n > 1`` at the gateway: one engine request whose outputs carry their choice's index
(the worker forks the choices on the prompt's shared KV: workers/engine/parallel_sampling.py),
seen by each choice's generation as an engine of its own.

``choice_engines`` gives n such engines. The first ``generate`` call starts the one engine
request; each engine yields its choice's outputs only (an error output or an exception
reaches every choice). Aborting a choice stops that choice alone in the worker; when every
choice has stopped reading, the engine request is closed, which aborts whatever still runs
there, so no KV block outlives the HTTP request."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

from memserve.gateway.engine_protocol import EngineClient, RequestEngine
from memserve.ipc.messages import RequestOutput, SamplingParams


def choice_engines(engine: EngineClient, n: int) -> list[RequestEngine]:
    """The engines of a request's n choices: ``engine`` itself when n is 1."""
    return [engine] if n == 1 else _SharedRequest(engine, n).choices


class _SharedRequest:
    def __init__(self, engine: EngineClient, n: int) -> None:
        self._engine = engine
        self.choices: list[RequestEngine] = [_ChoiceEngine(self, i) for i in range(n)]
        self._queues: list[asyncio.Queue[RequestOutput | Exception | None]] = [asyncio.Queue() for _ in range(n)]
        self._finished: set[int] = set()
        self._started: set[int] = set()
        # The prompt is computed once, by choice 0: its prompt logprobs (echo) are every choice's.
        self._prompt_logprobs: list | None = None
        self._reading = n
        self._request_id = ""
        self._pump: asyncio.Task | None = None

    def start(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, session_id: str | None,
              slo: dict | None, streaming: bool) -> None:
        if self._pump is None:
            self._request_id = request_id
            outputs = self._engine.generate(request_id, prompt_token_ids, params, session_id, slo, streaming=streaming)
            self._pump = asyncio.create_task(self._fan_out(outputs))

    async def _fan_out(self, outputs: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in outputs:
                if out.finish_reason == "error":
                    self._broadcast(out)
                    continue
                if out.prompt_logprobs is not None:
                    self._prompt_logprobs = out.prompt_logprobs
                elif out.index not in self._started and self._prompt_logprobs is not None:
                    out.prompt_logprobs = self._prompt_logprobs
                self._started.add(out.index)
                if out.finished:
                    self._finished.add(out.index)
                self._queues[out.index].put_nowait(out)
        except Exception as e:  # noqa: BLE001 - refused or unavailable before any output: every choice raises it
            self._broadcast(e)
        finally:
            self._broadcast(None)  # an engine stream that ended early: the choices' readers see it end
            close = getattr(outputs, "aclose", None)
            if close is not None:
                await close()

    def _broadcast(self, item: RequestOutput | Exception | None) -> None:
        for queue in self._queues:
            queue.put_nowait(item)

    async def next(self, index: int) -> RequestOutput | None:
        item = await self._queues[index].get()
        if isinstance(item, Exception):
            raise item
        return item

    async def abort(self, index: int) -> None:
        """Stop one choice in the worker (the others go on)."""
        if index not in self._finished and self._pump is not None and not self._pump.done():
            self._finished.add(index)
            await self._engine.abort_choice(self._request_id, index)

    def leave(self) -> None:
        """A choice stopped reading; the last one closes the engine request."""
        self._reading -= 1
        if self._reading == 0 and self._pump is not None:
            self._pump.cancel()


class _ChoiceEngine:
    """One choice's view of the shared request, as a ``RequestEngine``."""

    def __init__(self, shared: _SharedRequest, index: int) -> None:
        self._shared = shared
        self._index = index

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       session_id: str | None = None, slo: dict | None = None,
                       streaming: bool = True) -> AsyncIterator[RequestOutput]:
        self._shared.start(request_id, prompt_token_ids, params, session_id, slo, streaming)
        try:
            while (out := await self._shared.next(self._index)) is not None:
                if self._index:  # usage counts the shared prompt (and its cached part) once
                    out = dataclasses.replace(out, num_cached_tokens=0)
                yield out
                if out.finished:
                    return
        finally:
            self._shared.leave()

    async def abort(self, request_id: str) -> None:
        await self._shared.abort(self._index)
