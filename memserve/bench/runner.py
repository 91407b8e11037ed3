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
from memserve.bench.records import RequestRecord
from memserve.bench.workloads import Session, Turn

DEFAULT_MAX_TOKENS = 256
LOAD_STATUSES = frozenset({"429", "503", "timeout"})


@dataclass
class ReplayOptions:
    rate: float = math.inf  # session starts per second
    concurrency: int | None = None
    duration_s: float | None = None
    max_tokens: int | None = None  # natural mode: DEFAULT_MAX_TOKENS when unset
    fixed_output_len: bool = False
    slo_ttft_ms: float | None = None
    slo_tbt_ms: float | None = None
    # Each request's SLOs are the ones above times a scale drawn uniformly from [lo, hi]
    # (one per request, for both), as CacheOpt §5 sets them (scale [0.5, 2.5]).
    slo_scale: tuple[float, float] | None = None
    think_time_s: float = 0.0  # mean of the exponential pause between turns
    seed: int = 0

    def slos(self, session_id: str, turn: int) -> tuple[float | None, float | None]:
        """(TTFT, TBT) SLOs in ms of a session's turn (1-based); the same in every run
        with the same seed, whatever order requests are sent in."""
        if self.slo_scale is None:
            return self.slo_ttft_ms, self.slo_tbt_ms
        scale = random.Random(f"slo:{self.seed}:{session_id}:{turn}").uniform(*self.slo_scale)
        ttft, tbt = self.slo_ttft_ms, self.slo_tbt_ms
        return None if ttft is None else ttft * scale, None if tbt is None else tbt * scale

    def max_tokens_for(self, turn: Turn) -> int:
        """Natural: ``max_tokens`` (default 256). Fixed: the turn's target length, capped
        by ``max_tokens`` when that is set (a turn without one, such as a conversation's
        unanswered last message, falls back to the natural cap)."""
        if not self.fixed_output_len or turn.output_len is None:
            return self.max_tokens or DEFAULT_MAX_TOKENS
        return min(turn.output_len, self.max_tokens) if self.max_tokens else turn.output_len


@dataclass
class ReplayResult:
    records: list[RequestRecord]  # finished requests, successful or not, in finishing order
    duration_s: float
    cancelled: int = 0  # in flight when the run was halted
    interrupted: bool = False
    aborted: str | None = None  # why the run stopped early, if it did


def arrival_offsets(n: int, rate: float, rng: random.Random) -> list[float]:
    """Start times of n sessions from a Poisson process at ``rate``/s; the first at 0."""
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise ValueError("the arrival rate must be positive (or inf)")
    times = [0.0]
    for _ in range(n - 1):
        times.append(times[-1] + rng.expovariate(rate))
    return times


@dataclass
class Replayer:
    client: OpenAIClient
    options: ReplayOptions
    on_request_done: Callable[[RequestRecord], None] | None = None
    _records: list[RequestRecord] = field(default_factory=list, init=False)
    _in_flight: int = field(default=0, init=False)
    _any_ok: bool = field(default=False, init=False)
    _abort_reason: str | None = field(default=None, init=False)
    _halt_requested: bool = field(default=False, init=False)
    _halt: asyncio.Event | None = field(default=None, init=False)
    _slots: asyncio.Semaphore | None = field(default=None, init=False)

    def halt(self) -> None:
        """Stop now (Ctrl-C): cancel requests in flight, keep what finished."""
        self._halt_requested = True
        if self._halt is not None:
            self._halt.set()

    async def run(self, sessions: list[Session]) -> ReplayResult:
        """Replay ``sessions`` once (a Replayer serves one run)."""
        self._halt = asyncio.Event()
        if self._halt_requested:
            self._halt.set()
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
        await asyncio.wait({everything, halted}, return_when=asyncio.FIRST_COMPLETED)
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
            use_recorded = self.options.fixed_output_len and turn.recorded_answer is not None
            answer = turn.recorded_answer if use_recorded else record.output_text
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
