"""The gateway's ledger of the requests it has in flight on each worker, priced by the
cost model: MemServe eq. 1's first term (the work queued on instance p) from prompt
tokens still to prefill and the decode batch still expected to run, rather than from
request counts. A prompt longer than the workers' token budget per step
(``step_tokens``, the engine's ``max_num_batched_tokens``) is prefilled in chunks, one a
step, each step also running the decode batch. It also remembers what the router
predicted for each request's TTFT so that the error of the cost model can be measured
against the first token's real arrival.

Pure Python on an injected clock: the simulator runs it unchanged."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from memserve.costmodel.model import CostModel

# Decode steps assumed for a request whose max_tokens is unknown or larger: most
# answers stop at end-of-sequence well before a large max_tokens. One that runs past its
# expected length is then expected to run as long again (up to its max_tokens).
EXPECTED_OUTPUT_CAP = 512


def expected_output_tokens(max_tokens: int | None, n: int = 1) -> int:
    """Tokens a request is expected to generate, all choices together: ``max_tokens`` per
    choice, capped at ``EXPECTED_OUTPUT_CAP``."""
    return min(max_tokens or EXPECTED_OUTPUT_CAP, EXPECTED_OUTPUT_CAP) * max(n, 1)


def prefill_chunks_s(cost: CostModel, prompt_tokens: int, cached_tokens: int, step_tokens: int | None) -> list[float]:
    """exec() of each step a prefill takes: its uncached tokens in chunks of at most
    ``step_tokens`` (all in one without a budget), each attending to everything before
    it. At least one token is computed (the engine needs its logits)."""
    start, chunks = min(cached_tokens, prompt_tokens - 1), []
    while start < prompt_tokens:
        end = min(prompt_tokens, start + (step_tokens or prompt_tokens))
        chunks.append(cost.prefill_s(end, start / end))
        start = end
    return chunks


@dataclass
class _Entry:
    instance: int
    prompt_tokens: int
    uncached_tokens: int  # prompt tokens it computes (its KV blocks to allocate)
    prefill_s: float  # exec(x, y) predicted at routing time
    first_step_s: float  # its first chunk's share of prefill_s: the step a prefix push waits behind
    steps: int  # prefill chunks it takes
    expected_tokens: int  # decode steps expected over all choices
    max_total_tokens: int | None  # max_tokens over all choices; None: unbounded
    routed_at: float
    predicted_ttft_s: float | None
    generated: int = 0


class WorkScores(NamedTuple):
    """What the router scores a worker on: ``QueuedWork.work_s``, ``step_s``, ``decode_s``
    and ``waiting_tokens`` of one instance."""

    work_s: float
    step_s: float
    decode_s: float
    waiting_tokens: int


@dataclass(frozen=True)
class TTFTSample:
    predicted_s: float
    actual_s: float


class QueuedWork:
    def __init__(self, cost: CostModel | None, clock: Callable[[], float], step_tokens: int | None = None) -> None:
        self.cost = cost
        self.clock = clock
        self.step_tokens = step_tokens  # None: a prompt is prefilled in one step
        self._entries: dict[str, _Entry] = {}
        self._on: dict[int, dict[str, _Entry]] = {}  # the same entries by instance

    def __len__(self) -> int:
        return len(self._entries)

    def admit(self, request_id: str, instance: int, prompt_tokens: int, cached_tokens: int,
              max_tokens: int | None, n: int = 1, predicted_ttft_s: float | None = None) -> None:
        """Record a routed request (again, when it is re-routed after its worker died)."""
        prefill, first, steps = self._prefill(prompt_tokens, cached_tokens)
        expected = expected_output_tokens(max_tokens, n)
        self.release(request_id)
        entry = _Entry(instance, prompt_tokens, prompt_tokens - min(cached_tokens, prompt_tokens), prefill, first, steps,
                       expected, max_tokens * max(n, 1) if max_tokens else None, self.clock(), predicted_ttft_s)
        self._entries[request_id] = self._on.setdefault(instance, {})[request_id] = entry

    def _prefill(self, prompt_tokens: int, cached_tokens: int) -> tuple[float, float, int]:
        """A prefill's predicted seconds, its first chunk's, and its steps (0 s without a cost model)."""
        chunks = prefill_chunks_s(self.cost, prompt_tokens, cached_tokens, self.step_tokens) if self.cost else []
        return sum(chunks), chunks[0] if chunks else 0.0, max(len(chunks), 1)

    def use_cost_model(self, cost: CostModel) -> None:
        """Price by ``cost`` from now on, the requests already here too."""
        self.cost = cost
        for e in self._entries.values():
            e.prefill_s, e.first_step_s, e.steps = self._prefill(e.prompt_tokens, e.prompt_tokens - e.uncached_tokens)

    def observe(self, request_id: str, new_tokens: int, at: float | None = None) -> TTFTSample | None:
        """Count tokens the request produced; its first ones give a TTFT sample (when a
        prediction was made)."""
        entry = self._entries.get(request_id)
        if entry is None or new_tokens <= 0:
            return None
        return self._count(entry, new_tokens, at)

    def observe_each(self, request_id: str, times: Sequence[float]) -> list[TTFTSample]:
        """``observe`` of one token of the request at each of ``times``, in order (a run of
        decode steps); returns the TTFT samples they gave."""
        entry = self._entries.get(request_id)
        if entry is None:
            return []
        if 0 < entry.generated and entry.generated + len(times) < entry.expected_tokens:
            entry.generated += len(times)  # no first token, and the expected length is not reached
            return []
        count = self._count
        return [sample for at in times if (sample := count(entry, 1, at)) is not None]

    def _count(self, entry: _Entry, new_tokens: int, at: float | None) -> TTFTSample | None:
        first = entry.generated == 0
        entry.generated += new_tokens
        if entry.generated >= entry.expected_tokens:  # past the cap: as long again, within max_tokens
            entry.expected_tokens = min(2 * entry.generated, entry.max_total_tokens or 2 * entry.generated)
        if first and entry.predicted_ttft_s is not None:
            return TTFTSample(entry.predicted_ttft_s, (self.clock() if at is None else at) - entry.routed_at)
        return None

    def release(self, request_id: str) -> None:
        entry = self._entries.pop(request_id, None)
        if entry is not None:
            del self._on[entry.instance][request_id]

    def scores(self, instance: int) -> WorkScores:
        """``work_s``, ``step_s``, ``decode_s`` and ``waiting_tokens`` of ``instance`` in one
        pass over its requests: those with no token yet wait (admission order), those
        still expected to generate decode."""
        waiting: list[_Entry] = []
        decoding = decoding_tokens = 0
        for e in self._on.get(instance, {}).values():
            if e.generated == 0:
                waiting.append(e)
            elif e.generated < e.expected_tokens:
                decoding += 1
                decoding_tokens += e.prompt_tokens + e.generated
        decode_s = self.cost.decode_step_s(decoding, decoding_tokens) if self.cost is not None else 0.0
        return WorkScores(sum(e.prefill_s for e in waiting) + (sum(e.steps for e in waiting) + 1) * decode_s,
                          (waiting[0].first_step_s if waiting else 0.0) + decode_s, decode_s,
                          sum(e.uncached_tokens for e in waiting))

    def waiting_tokens(self, instance: int) -> int:
        """Prompt tokens the requests on ``instance`` that have no token yet still compute:
        the KV they allocate there, possibly after the worker's last report of its free
        blocks (counted whether or not that report already shows them)."""
        return self.scores(instance).waiting_tokens

    def kv_wait_s(self, instance: int, blocks: int, free_blocks: int, block_size: int,
                  horizon_tokens: int | None = None) -> float:
        """Predicted wait before a newcomer that needs ``blocks`` KV blocks to start fits on
        ``instance``, which can allocate ``free_blocks`` now (free and evictable, less what
        its waiting prompts compute). The queued work ignores KV; under KV pressure this is
        the longer wait. 0 when it fits now.

        A newcomer starting t decode steps (of ``decode_s``) from now finds room when what
        the requests there hold by then leaves ``blocks`` free: each grows by a token a
        step towards its expected length until ``horizon_tokens`` steps past t (when the
        newcomer's first token is due; None: to its end, as an engine that admits on the
        prompt alone preempts a newcomer when the others grow), and a decoding one frees
        all it holds when it finishes. t is 0 or the moment one of them finishes."""
        # (tokens to go, decoding, tokens now, blocks held now) of each request there
        now = [(max(e.expected_tokens - e.generated, 1), e.generated > 0, e.prompt_tokens + e.generated,
                math.ceil((e.prompt_tokens + e.generated if e.generated else e.uncached_tokens) / block_size))
               for e in self._on.get(instance, {}).values()]

        def room(t: int) -> int:
            free = free_blocks
            for left, decoding, tokens, held in now:
                if decoding and left <= t:
                    free += held
                else:
                    grown = left if horizon_tokens is None else min(left, t + horizon_tokens)
                    free -= math.ceil((tokens + grown) / block_size) - held
            return free

        for t in [0, *sorted({left for left, decoding, _, _ in now if decoding})]:
            if blocks <= room(t):
                break
        return t * self.decode_s(instance)

    def step_s(self, instance: int) -> float:
        """Predicted length of the step ``instance`` runs now: the first chunk of its
        oldest waiting prefill with its decode batch. A worker serves a prefix push
        between two steps, so a pull from it starts after about this long (not after the
        whole of a long prefill)."""
        return self.scores(instance).step_s

    def decode_s(self, instance: int) -> float:
        """Predicted length of one step of the decode batch running on ``instance``: the
        requests that produced tokens and are still expected to be generating."""
        return self.scores(instance).decode_s

    def work_s(self, instance: int) -> float:
        """Predicted delay before a new request's prefill on ``instance`` finishes its
        queue: the prefills still to run there (eq. 1's sum of exec(x', y')) plus one step
        of the running decode batch per prefill step (each chunk of each waiting prefill,
        and the new request's first), since the engine batches prefills with the decodes
        of the requests still expected to be generating."""
        return self.scores(instance).work_s
