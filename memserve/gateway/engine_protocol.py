"""What the HTTP layer needs from the engine side (the ZeroMQ engine client).

The gateway's handlers code against this protocol only, so they can be tested with a
scripted fake engine and wired to the real cluster without changes."""

from __future__ import annotations

from typing import AsyncIterator, Protocol

from memserve.ipc.messages import RequestOutput, SamplingParams


class RequestEngine(Protocol):
    """What one request's generation needs: the engine client itself, or one choice's
    view of an n > 1 request (``parallel_choices.py``)."""

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        session_id: str | None = None,
        slo: dict | None = None,
        streaming: bool = True,
    ) -> AsyncIterator[RequestOutput]:
        """Yield ``RequestOutput`` deltas until one has ``finished`` set. ``streaming``:
        the caller passes them on as they come (a client's stream) rather than collecting
        the answer; an engine that moves requests off a failed worker may re-run a
        collected answer, but must resume a streamed one after the deltas it yielded."""
        ...

    async def abort(self, request_id: str) -> None:
        """Stop a request; must be harmless for unknown or already finished ids."""
        ...


class EngineClient(RequestEngine, Protocol):
    max_model_len: int

    async def abort_choice(self, request_id: str, index: int) -> None:
        """Stop choice ``index`` of an n > 1 request alone (its other choices go on)."""
        ...

    def stats(self) -> dict:
        """``{"workers": [{"instance_id", "alive", "num_running", "num_waiting",
        "free_blocks": {tier: n}, "cache_hit_rate", "cached_tokens_total"}, ...]}``."""
        ...


class RequestRejected(Exception):
    """Raised by ``generate`` before the first output when admission refuses a request
    (it cannot meet its SLO anywhere); the gateway answers 429 with Retry-After."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineUnavailable(Exception):
    """Raised by ``generate`` when no live worker can take the request; answered 503,
    with Retry-After when the engine knows when to expect one back."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
