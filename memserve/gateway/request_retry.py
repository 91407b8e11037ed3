"""What becomes of a colocated request whose worker died (``engine_client.ZmqEngineClient``
drives it; ``pd_flow.py`` has its own rules for disaggregated requests).

The request moves to a live worker unless it was pinned to its worker or has already
moved ``MAX_MOVES`` times; with no live worker left it fails too (``EngineUnavailable``
while its caller has been given nothing, else an error output). How it moves depends on
what its caller has been given:

- nothing: it is sent again as it was (``RESEND``);
- tokens of one sequence, to a caller that passes them on as they come (a client's
  stream), or sampled without a seed (no run can reproduce them): it *resumes*
  (``RESUME``). The new worker gets the prompt with those tokens as output already
  generated (``AddRequest.output_token_ids``: they count towards ``max_tokens``, penalties,
  ``min_tokens``, the grammar and the seeded draws), prefills both, from its prefix cache
  where it has them, and samples on;
- tokens, to a caller that collects the whole answer before using it, or of several
  choices: it is *re-run* from scratch with the same parameters and seed (``RERUN``), so
  that a greedy or seeded answer is the one an undisturbed run gives. The tokens the
  caller has are produced again and dropped here, after checking they are the same;
- tokens of several choices sampled without a seed cannot be reproduced or resumed as
  one request: it fails.

Invariant: the caller never sees a token twice, nor a token that the run producing the
rest did not condition on: a re-run that produces other tokens than those the caller has
(a numerical near-tie) fails instead of splicing two answers. After a move with tokens
given, outputs report the cached prompt tokens the caller was first told (the new
worker's count covers the tokens it was given as well), and a request's prompt
logprobs come once."""

from __future__ import annotations

import dataclasses
import enum

from memserve.gateway.routing.route_types import RouteRequest
from memserve.ipc.messages import AddRequest, RequestOutput, SamplingParams

# Moves of one request to another worker after its worker died, before it fails.
MAX_MOVES = 2


class Move(enum.Enum):
    RESEND = "resend"
    RESUME = "resume"
    RERUN = "rerun"
    FAIL = "fail"


def choose_move(moves: int, pinned: bool, produced: bool, streaming: bool, params: SamplingParams) -> Move:
    """The move of a request whose worker died: ``moves`` made already, ``pinned`` to its
    worker, ``produced``: its caller has tokens, ``streaming``: the caller passes them on
    as they come."""
    if pinned or moves >= MAX_MOVES:
        return Move.FAIL
    if not produced:
        return Move.RESEND
    reproducible = params.greedy or params.seed is not None
    if params.n == 1 and (streaming or not reproducible):
        return Move.RESUME
    return Move.RERUN if reproducible else Move.FAIL


class RequestProgress:
    """What a request's caller has been given, per choice, and the moves it made: it
    builds the request to send on a move and filters the outputs of the run after it."""

    def __init__(self, request_id: str, params: SamplingParams, streaming: bool, pinned: bool) -> None:
        self.request_id = request_id
        self.params = params
        self.streaming = streaming
        self.pinned = pinned
        self.tokens: list[list[int]] = [[] for _ in range(params.n)]
        self.finished: set[int] = set()
        self.moves = 0
        self._cached = 0  # the cached prompt tokens the caller was told of
        self._cached_fixed = False  # moved after the caller had tokens: it is told the same from then on
        # RERUN: the tokens of each choice that the caller has and the re-run has not produced again yet.
        self._replay: list[list[int]] | None = None

    @property
    def produced(self) -> bool:
        return any(self.tokens)

    def choose(self) -> Move:
        return choose_move(self.moves, self.pinned, self.produced, self.streaming, self.params)

    def move(self, move: Move, add: AddRequest, route: RouteRequest) -> tuple[AddRequest, RouteRequest]:
        """Record ``move`` (not ``FAIL``); the message for the new worker and the routing
        request that finds it, from the request's original ones."""
        self.moves += 1
        self._cached_fixed = self._cached_fixed or self.produced
        self._replay = [list(done) for done in self.tokens] if move is Move.RERUN else None
        if move is not Move.RESUME:
            return add, route
        done = self.tokens[0]
        params = dataclasses.replace(add.params, prompt_logprobs=None)  # the caller has them
        resumed = dataclasses.replace(add, params=params, output_token_ids=list(done))
        max_tokens = None if route.max_tokens is None else route.max_tokens - len(done)
        return resumed, dataclasses.replace(route, prompt_token_ids=route.prompt_token_ids + done,
                                            max_tokens=max_tokens)

    def pass_on(self, out: RequestOutput, worker: int) -> RequestOutput | None:
        """``out`` as the caller is to see it (None: nothing for it), recorded; an error
        output when a re-run did not reproduce what the caller has."""
        if out.error is not None or out.finish_reason == "error":
            return out  # the worker's own failure of the request
        if self._replay is not None:
            replayed = self._replayed(out, worker)
            if replayed is None or replayed.error is not None:
                return replayed
            out = replayed
        if self._cached_fixed:
            out = dataclasses.replace(out, num_cached_tokens=self._cached)
        else:
            self._cached = max(self._cached, out.num_cached_tokens)
        self.tokens[out.index] += out.new_token_ids
        if out.finished:
            self.finished.add(out.index)
        return out

    def _replayed(self, out: RequestOutput, worker: int) -> RequestOutput | None:
        """A re-run's output less the tokens the caller has; None when nothing is left."""
        assert self._replay is not None
        if out.index in self.finished:
            return None
        replay = self._replay[out.index]
        count = min(len(replay), len(out.new_token_ids))
        if out.new_token_ids[:count] != replay[:count] or (out.finished and count < len(replay)):
            return self.failed(f"the re-run on worker {worker} did not reproduce the tokens already produced")
        del replay[:count]
        if not count:
            return out
        rest = dataclasses.replace(out, new_token_ids=out.new_token_ids[count:], prompt_logprobs=None,
                                   logprobs=None if out.logprobs is None else out.logprobs[count:])
        return rest if rest.new_token_ids or rest.finished else None

    def failed(self, reason: str) -> RequestOutput:
        """The error output that ends the request."""
        return RequestOutput(self.request_id, [], True, "error", error=reason)
