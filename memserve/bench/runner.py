"""Replays sessions against a server the way users would send them.

- Sessions start by a Poisson process at ``rate`` sessions per second (session i starts
  after i exponential gaps; the first at once; ``inf`` starts all at once).
- Within a session, turn k+1 is sent only after turn k's answer has arrived, and its
  history carries that answer: the text the server produced, or the recorded answer
  when output lengths are fixed to the recorded ones (so every server sees the same
  prompts). An optional exponential think time separates the turns.
- ``concurrency`` caps requests in flight; a turn waiting for a slot keeps its place.
- ``duration_s`` stops issuing requests after that many seconds; requests in flight
  finish and are measured.
- ``halt()`` (the CLI calls it on Ctrl-C) cancels what is in flight at once; everything
  that finished is kept.
- An error before any request succeeded (wrong model, bad URL, a server failing every
  request) aborts the run at once rather than repeating it for every session; 429, 503
  and timeouts do not, since they are what overload looks like.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from memserve.bench.client import OpenAIClient, RequestSpec
from memserve.workload.records import RequestRecord
from memserve.workload.replay import (
    LOAD_STATUSES,
    ReplayOptions,
    ReplayResult,
    arrival_offsets,
)
from memserve.workload.workloads import Session, Turn


@dataclass
class Replayer:
    client: OpenAIClient
    options: ReplayOptions
    on_request_done: Callable[[RequestRecord], None] | None = None
    _records: list[RequestRecord] = field(default_factory=list, init=False)
    _in_flight: int = field(default=0, init=False)
    _any_ok: bool = field(default=False, init=False)
    _abort_reason: str | None = field(default=None, init=False)
    # Set by ``halt``, even before ``run``: an Event binds its loop on first wait (Python 3.10+).
    _halt: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    _slots: asyncio.Semaphore | None = field(default=None, init=False)

    def halt(self) -> None:
        """Stop now (Ctrl-C): cancel requests in flight, keep what finished."""
        self._halt.set()

    async def run(self, sessions: list[Session]) -> ReplayResult:
        """Replay ``sessions`` once (a Replayer serves one run)."""
        self._slots = asyncio.Semaphore(self.options.concurrency) if self.options.concurrency else None
        rng = random.Random(f"arrivals:{self.options.seed}")
        start = self.client.now()
        deadline = start + self.options.duration_s if self.options.duration_s else math.inf
        offsets = arrival_offsets(len(sessions), self.options.rate, rng)
        tasks = [
            asyncio.create_task(self._session(s, start + off, deadline))
            for s, off in zip(sessions, offsets)
        ]
        everything = asyncio.gather(*tasks)
        halted = asyncio.create_task(self._halt.wait())
        await asyncio.wait((everything, halted), return_when=asyncio.FIRST_COMPLETED)
        halted.cancel()
        cancelled = 0
        if self._halt.is_set():
            cancelled = self._in_flight
            for t in tasks:
                t.cancel()
            await asyncio.gather(everything, return_exceptions=True)
        else:
            await everything  # surfaces a failure of the replay code itself
        return ReplayResult(
            records=list(self._records),
            duration_s=self.client.now() - start,
            cancelled=cancelled,
            interrupted=self._halt.is_set() and self._abort_reason is None,
            aborted=self._abort_reason,
        )

    async def _session(self, session: Session, start_at: float, deadline: float) -> None:
        if start_at >= deadline:
            return
        await asyncio.sleep(max(0.0, start_at - self.client.now()))
        think = random.Random(f"think:{self.options.seed}:{session.session_id}")
        history = [{"role": "system", "content": session.system}] if session.system else []
        for k, turn in enumerate(session.turns, 1):
            if k > 1 and self.options.think_time_s > 0:
                pause = think.expovariate(1.0 / self.options.think_time_s)
                await asyncio.sleep(min(pause, max(0.0, deadline - self.client.now())))
            messages = history + [{"role": "user", "content": turn.user}]
            record = await self._send(session, k, turn, messages, deadline)
            if record is None or not record.ok:
                return
            answer = record.output_text
            if self.options.fixed_output_len and turn.recorded_answer is not None:
                answer = turn.recorded_answer
            history = messages + [{"role": "assistant", "content": answer}]

    async def _send(
        self, session: Session, k: int, turn: Turn, messages: list[dict], deadline: float
    ) -> RequestRecord | None:
        """One turn, once a slot is free; None if the run ended before it could go."""
        slo_ttft_ms, slo_tbt_ms = self.options.slos(session.session_id, k)
        spec = RequestSpec(
            session_id=session.session_id,
            turn=k,
            messages=messages,
            max_tokens=self.options.max_tokens_for(turn),
            fixed_output_len=self.options.fixed_output_len,
            slo_ttft_ms=slo_ttft_ms,
            slo_tbt_ms=slo_tbt_ms,
        )
        if self._slots is not None:
            await self._slots.acquire()
        try:
            if self.client.now() >= deadline or self._halt.is_set():
                return None
            self._in_flight += 1
            try:
                record = await self.client.send(spec)
            finally:
                self._in_flight -= 1
        finally:
            if self._slots is not None:
                self._slots.release()
        self._records.append(record)
        if record.ok:
            self._any_ok = True
        elif not self._any_ok and record.status not in LOAD_STATUSES and self._abort_reason is None:
            self._abort_reason = f"the server failed the first request with {record.status}: {record.error}"
            self._halt.set()
        if self.on_request_done is not None:
            self.on_request_done(record)
        return record
