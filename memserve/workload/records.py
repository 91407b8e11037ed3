"""What one request measured: the client fills it, the metrics read it.

Times are seconds on one monotonic clock (``time.perf_counter``) relative to the start of
the run, so records of one run can be laid on one time line.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestRecord:
    session_id: str
    turn: int  # 1-based turn index within the session
    start: float  # request sent
    end: float | None = None  # stream closed (or error seen)
    chunk_times: list[float] = field(default_factory=list)  # arrival of each SSE chunk with output
    chunk_tokens: list[int] = field(default_factory=list)  # tokens each of those chunks carried
    prompt_tokens: int | None = None
    completion_tokens: int | None = None  # server's usage; else the sum of chunk_tokens
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, if reported
    status: str = "ok"  # "ok", an HTTP status ("429"), or "connection", "timeout", "stream_error", ...
    error: str | None = None
    output_text: str = ""
    slo_ttft_ms: float | None = None
    slo_tbt_ms: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def output_tokens(self) -> int:
        if self.completion_tokens is not None:
            return self.completion_tokens
        return sum(self.chunk_tokens)

    def to_json(self) -> dict:
        """The record without the output text (kept small for results files)."""
        d = dict(vars(self))  # shallow: every field is a scalar or a list of scalars
        del d["output_text"]
        d["chunk_times"] = [round(t, 6) for t in self.chunk_times]
        d["chunk_tokens"] = list(self.chunk_tokens)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "RequestRecord":
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})
