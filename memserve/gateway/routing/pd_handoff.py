"""The states of a disaggregated request, one definition for the gateway's flow
(``gateway/pd_flow.py``) and the simulator's (``sim/pd_flow.py``).

A request moves through three phases, as vLLM keeps a remote-KV request in a status of
its own (``WAITING_FOR_REMOTE_KVS``) until its connector reports the KV there:

    PREFILL  --first token, unfinished-->        HANDOFF   (P parks the KV, D is named)
    PREFILL  --P died, a prefill instance live--> PREFILL  (retried there: nothing streamed)
    PREFILL  --P died, none live-->              DECODE    (a decode instance runs it all)
    HANDOFF  --KV arrived at D-->                DECODE    (D resumes with the KV)
    HANDOFF  --handoff failed or stalled-->      DECODE    (a live instance recomputes it)
    DECODE   --D died-->                         DECODE    (another instance recomputes it)

Invariants:

- ``tokens`` are the output tokens the client was sent, in order; a resume carries them
  all, so whichever instance goes on produces what the client would have seen anyway.
- ``cached`` is what the request's first output found cached (normally P's prefill), and
  every later output reports it: the request's cached tokens, not the resuming
  instance's.
- Every resume after a handoff or a decode instance failed counts; past ``MAX_RESUMES``
  the request fails rather than chase instances forever.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from memserve.ipc.messages import AddRequest, RequestOutput

# Resumes of one request after failures, before it fails.
MAX_RESUMES = 3


class Phase(enum.Enum):
    PREFILL = "prefill"  # on its prefill instance P, before its first token
    HANDOFF = "handoff"  # first token out, its KV on the way to the decode instance D
    DECODE = "decode"  # decoding on D (or wherever it resumed)


@dataclass
class Handoff:
    """One disaggregated request's progress (see the module docstring)."""

    add: AddRequest
    prefill: int  # the prefill instance P now running (or that ran) its prefill
    phase: Phase = Phase.PREFILL
    tokens: list[int] = field(default_factory=list)  # output tokens so far
    cached: int | None = None  # prompt tokens found cached, from the first output
    resumes: int = 0

    @property
    def request_id(self) -> str:
        return self.add.request_id

    def prefill_output(self, out: RequestOutput) -> bool:
        """Take an output of P; True when it is the first token of a request that goes
        on, which starts the handoff (PREFILL -> HANDOFF)."""
        assert self.phase is Phase.PREFILL, self.phase
        self.cached = out.num_cached_tokens
        self.tokens += out.new_token_ids
        if out.finished or not out.new_token_ids:
            return False
        self.phase = Phase.HANDOFF
        return True

    def decode_output(self, out: RequestOutput) -> None:
        """Take an output after the handoff; it reports the request's cached tokens."""
        self.tokens += out.new_token_ids
        if self.cached is None:  # it went to a decode instance before any output
            self.cached = out.num_cached_tokens
        else:
            out.num_cached_tokens = self.cached

    def output(self, out: RequestOutput) -> bool:
        """``prefill_output`` or ``decode_output`` by phase; True when the handoff starts."""
        if self.phase is Phase.PREFILL:
            return self.prefill_output(out)
        self.decode_output(out)
        return False

    def retried(self, prefill: int) -> None:
        """P died before the first token; another prefill instance runs it afresh."""
        assert self.phase is Phase.PREFILL, self.phase
        self.prefill = prefill

    def run_on_decode(self) -> None:
        """P died before the first token and no prefill instance is live: a decode
        instance runs the whole request (PREFILL -> DECODE)."""
        assert self.phase is Phase.PREFILL, self.phase
        self.phase = Phase.DECODE

    def resume(self) -> bool:
        """The request goes on decoding elsewhere (-> DECODE); False once it has resumed
        more than ``MAX_RESUMES`` times (it fails instead)."""
        self.phase = Phase.DECODE
        self.resumes += 1
        return self.resumes <= MAX_RESUMES
