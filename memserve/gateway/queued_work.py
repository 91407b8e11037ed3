"""The gateway's ledger of the requests it has in flight on each worker, priced by the
cost model: MemServe eq. 1's first term (the work queued on instance p) from prompt
tokens still to prefill and the decode batch still expected to run, rather than from
request counts. It
also remembers what the router predicted for each request's TTFT so that the error of
the cost model can be measured against the first token's real arrival.

Pure Python on an injected clock: the simulator runs it unchanged."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from memserve.gateway.cost_model import CostModel

# Decode steps assumed for a request whose max_tokens is unknown or larger: most
# answers stop at end-of-sequence well before a large max_tokens.
EXPECTED_OUTPUT_CAP = 512


@dataclass
class _Entry:
    instance: int
    prompt_tokens: int
    prefill_s: float  # exec(x, y) predicted at routing time
    expected_tokens: int  # decode steps expected over all choices
    routed_at: float
    predicted_ttft_s: float | None
    generated: int = 0


@dataclass(frozen=True)
class TTFTSample:
    predicted_s: float
    actual_s: float


class QueuedWork:
    def __init__(self, cost: CostModel | None, clock: Callable[[], float]) -> None:
        self.cost = cost
        self.clock = clock
        self._entries: dict[str, _Entry] = {}
        self._on: dict[int, dict[str, _Entry]] = {}  # the same entries by instance

    def __len__(self) -> int:
        return len(self._entries)

    def admit(self, request_id: str, instance: int, prompt_tokens: int, cached_tokens: int,
              max_tokens: int | None, n: int = 1, predicted_ttft_s: float | None = None) -> None:
        """Record a routed request (again, when it is re-routed after its worker died)."""
        prefill = self.cost.prefill_s(prompt_tokens, cached_tokens / prompt_tokens) if self.cost and prompt_tokens else 0.0
        expected = min(max_tokens or EXPECTED_OUTPUT_CAP, EXPECTED_OUTPUT_CAP) * max(n, 1)
        self.release(request_id)
        entry = _Entry(instance, prompt_tokens, prefill, expected, self.clock(), predicted_ttft_s)
        self._entries[request_id] = self._on.setdefault(instance, {})[request_id] = entry

    def observe(self, request_id: str, new_tokens: int, at: float | None = None) -> TTFTSample | None:
        """Count tokens the request produced; its first ones give a TTFT sample (when a
        prediction was made)."""
        entry = self._entries.get(request_id)
        if entry is None or new_tokens <= 0:
            return None
        first = entry.generated == 0
        entry.generated += new_tokens
        if first and entry.predicted_ttft_s is not None:
            return TTFTSample(entry.predicted_ttft_s, (self.clock() if at is None else at) - entry.routed_at)
        return None

    def release(self, request_id: str) -> None:
        entry = self._entries.pop(request_id, None)
        if entry is not None:
            del self._on[entry.instance][request_id]

    def step_s(self, instance: int) -> float:
        """Predicted length of the step ``instance`` runs now: its oldest waiting prefill
        with its decode batch. A worker serves a prefix push between two steps, so a pull
        from it starts after about this long."""
        if self.cost is None:
            return 0.0
        prefill, decoding, context = 0.0, 0, 0
        for e in self._on.get(instance, {}).values():  # admission order: the first waiting one runs first
            if e.generated == 0 and not prefill:
                prefill = e.prefill_s
            elif 0 < e.generated < e.expected_tokens:
                decoding += 1
                context += e.prompt_tokens + e.generated
        return prefill + self.cost.decode_step_s(decoding, context)

    def work_s(self, instance: int) -> float:
        """Predicted delay before a new request's prefill on ``instance`` finishes its
        queue: the prefills still to run there (eq. 1's sum of exec(x', y')) plus one step
        of the running decode batch per prefill step, since the engine batches prefills
        with the decodes of the requests still expected to be generating."""
        if self.cost is None:
            return 0.0
        prefill, waiting, decoding, context = 0.0, 0, 0, 0
        for e in self._on.get(instance, {}).values():
            if e.generated == 0:
                prefill += e.prefill_s
                waiting += 1
            elif e.generated < e.expected_tokens:
                decoding += 1
                context += e.prompt_tokens + e.generated
        return prefill + (waiting + 1) * self.cost.decode_step_s(decoding, context)
