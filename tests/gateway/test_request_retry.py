"""Requests on a worker that died move to a live one (gateway/request_retry.py), driven
through the real engine client with a recording channel and a scripted cluster: a
streamed request resumes after the tokens its caller has (the new worker gets them as
output already generated), a collected one is re-run from scratch and its replayed
tokens are dropped, outputs of the dead worker that arrive late are ignored, and a
request fails only when it was pinned, moved twice already, could not be reproduced, or
no live worker is left. The HTTP layer tells the engine which of its requests stream."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from helpers.fake_engine import FakeEngine, MESSAGES, MODEL, async_test, post, serve

from memserve.gateway.engine_client import ZmqEngineClient
from memserve.gateway.engine_protocol import EngineUnavailable
from memserve.gateway.request_retry import MAX_MOVES, Move, choose_move
from memserve.ipc.channel import WorkerUnreachable
from memserve.ipc.messages import AddRequest, RequestOutput, SamplingParams, StepOutputs, WorkerStats
from memserve.text.tokenizer import Tokenizer

PROMPT = list(range(100, 140))
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


class FakeCluster:
    """The workers as the engine client sees them; ``kill`` makes one dead."""

    def __init__(self, num_workers: int) -> None:
        self.workers = {i: SimpleNamespace(instance_id=i, alive=True, process=None, stats=WorkerStats(),
                                           config=SimpleNamespace(role="colocated"))
                        for i in range(num_workers)}
        self.restarted: list[int] = []

    def states(self, busy_s=None) -> dict[int, str]:
        return {i: "ok" if h.alive else "starting" for i, h in self.workers.items()}

    def restart(self, handle) -> None:
        self.restarted.append(handle.instance_id)


class Harness:
    """An engine client over ``FakeCluster``; ``sent`` holds what it sent to which worker."""

    def __init__(self, num_workers: int = 2) -> None:
        self.sent: list[tuple[int, object]] = []
        self.unreachable: set[int] = set()  # workers whose socket is gone, not yet seen dead
        self.cluster = FakeCluster(num_workers)
        self.client = ZmqEngineClient(SimpleNamespace(send=self._send), self.cluster, 16)
        self.client.max_model_len = 1024

    async def _send(self, instance: int, msg: object, bulk=()) -> None:
        if instance in self.unreachable:
            raise WorkerUnreachable(f"worker {instance} is not connected")
        self.sent.append((instance, msg))

    def adds(self) -> list[tuple[int, AddRequest]]:
        return [(i, m) for i, m in self.sent if isinstance(m, AddRequest)]

    def emit(self, worker: int, tokens: list[int], finished: bool = False, index: int = 0, cached: int = 0,
             logprobs: list | None = None) -> None:
        out = RequestOutput("r", tokens, finished, "length" if finished else None, len(PROMPT), cached, index=index,
                            logprobs=logprobs)
        self.client._dispatch(worker, StepOutputs(worker, [out]))

    def kill(self, worker: int) -> None:
        self.cluster.workers[worker].alive = False
        self.client._fail_worker(self.cluster.workers[worker])

    def revive(self, worker: int) -> None:
        self.cluster.workers[worker].alive = True


async def run(h: Harness, params: SamplingParams, script, streaming: bool = True,
              instance: int | None = None) -> list[RequestOutput]:
    """The outputs the caller of ``generate`` sees while ``script(h)`` plays the workers."""
    seen: list[RequestOutput] = []

    async def consume() -> None:
        async for out in h.client.generate("r", PROMPT, params, instance=instance, streaming=streaming):
            seen.append(out)

    task = asyncio.create_task(consume())
    await settle()
    await script(h)
    await asyncio.wait_for(task, 5)
    return seen


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def tokens(outputs: list[RequestOutput], index: int = 0) -> list[int]:
    return [t for out in outputs if out.index == index for t in out.new_token_ids]


def test_the_move_follows_what_the_caller_has() -> None:
    seeded = SamplingParams(temperature=1.0, seed=7)
    sampled = SamplingParams(temperature=1.0)
    assert choose_move(0, False, False, True, sampled) is Move.RESEND
    assert choose_move(0, False, True, True, GREEDY) is Move.RESUME
    assert choose_move(0, False, True, False, GREEDY) is Move.RERUN
    assert choose_move(0, False, True, False, seeded) is Move.RERUN
    assert choose_move(0, False, True, False, sampled) is Move.RESUME  # no run could reproduce it
    assert choose_move(0, False, True, True, SamplingParams(n=2, seed=7)) is Move.RERUN
    assert choose_move(0, False, True, False, SamplingParams(n=2)) is Move.FAIL
    assert choose_move(0, True, False, True, GREEDY) is Move.FAIL  # pinned
    assert choose_move(MAX_MOVES, False, False, True, GREEDY) is Move.FAIL


@async_test
async def test_a_streamed_request_resumes_after_the_tokens_it_gave() -> None:
    async def script(h: Harness) -> None:
        h.emit(0, [5], cached=32)
        h.emit(0, [6], cached=32)
        await settle()
        h.kill(0)
        h.emit(0, [99], cached=32)  # sent before it died, read after: never reaches the caller
        await settle()
        h.emit(1, [7], cached=48)  # worker 1 found the prompt and a streamed token cached
        h.emit(1, [8], finished=True, cached=48)

    h = Harness()
    seen = await run(h, SamplingParams(max_tokens=8, temperature=0.0, prompt_logprobs=1), script)
    assert tokens(seen) == [5, 6, 7, 8] and seen[-1].finish_reason == "length"
    assert {out.num_cached_tokens for out in seen} == {32}
    (first, add), (second, resumed) = h.adds()
    assert (first, second) == (0, 1) and h.cluster.restarted == [0]
    assert resumed.prompt_token_ids == PROMPT and resumed.output_token_ids == [5, 6]
    assert resumed.params.prompt_logprobs is None and resumed.params.max_tokens == add.params.max_tokens
    assert dict(h.client.moves) == {"resume": 1}
    assert not h.client.streams


@async_test
async def test_a_collected_request_is_rerun_and_its_replayed_tokens_dropped() -> None:
    def lp(token: int) -> tuple[float, list[int], list[float]]:
        return (-float(token), [token], [-float(token)])

    async def script(h: Harness) -> None:
        h.emit(0, [5], logprobs=[lp(5)])
        h.emit(0, [6], logprobs=[lp(6)])
        await settle()
        h.kill(0)
        await settle()
        h.emit(1, [5], logprobs=[lp(5)])
        h.emit(1, [6, 7], logprobs=[lp(6), lp(7)])
        h.emit(1, [8], finished=True, logprobs=[lp(8)])

    h = Harness()
    seen = await run(h, SamplingParams(max_tokens=4, temperature=0.0, logprobs=0), script, streaming=False)
    assert tokens(seen) == [5, 6, 7, 8] and all(out.error is None for out in seen)
    assert [lp[0] for out in seen for lp in out.logprobs or []] == [-5.0, -6.0, -7.0, -8.0]
    (_, add), (worker, rerun) = h.adds()
    assert worker == 1 and rerun == add  # the same request: same seed and parameters
    assert dict(h.client.moves) == {"rerun": 1}


@async_test
async def test_a_rerun_that_does_not_reproduce_the_tokens_fails() -> None:
    async def script(h: Harness) -> None:
        h.emit(0, [5, 6])
        await settle()
        h.kill(0)
        await settle()
        h.emit(1, [5, 9])

    seen = await run(Harness(), GREEDY, script, streaming=False)
    assert tokens(seen) == [5, 6]
    assert seen[-1].finish_reason == "error" and "did not reproduce" in seen[-1].error


@async_test
async def test_a_rerun_of_several_choices_drops_the_finished_ones() -> None:
    async def script(h: Harness) -> None:
        h.emit(0, [5], index=0)
        h.emit(0, [7], index=1, finished=True)
        await settle()
        h.kill(0)
        await settle()
        h.emit(1, [7], index=1, finished=True)
        h.emit(1, [5, 6], index=0, finished=True)

    seen = await run(Harness(), SamplingParams(max_tokens=2, temperature=1.0, seed=3, n=2), script, streaming=False)
    assert (tokens(seen, 0), tokens(seen, 1)) == ([5, 6], [7]) and all(out.error is None for out in seen)
    assert sum(out.finished for out in seen) == 2


@async_test
async def test_a_request_fails_when_it_cannot_move() -> None:
    async def die_after_a_token(h: Harness) -> None:
        h.emit(0, [5])
        await settle()
        h.kill(0)

    pinned = await run(Harness(), GREEDY, die_after_a_token, instance=0)
    assert pinned[-1].finish_reason == "error" and pinned[-1].error == "worker 0 died"

    async def last_worker_dies(h: Harness) -> None:
        await die_after_a_token(h)
        await settle()
        h.kill(1)

    alone = await run(Harness(), GREEDY, last_worker_dies)
    assert tokens(alone) == [5] and "no live worker" in alone[-1].error

    async def dies_three_times(h: Harness) -> None:
        await die_after_a_token(h)
        for dead in (1, 0):
            await settle()
            h.revive(1 - dead)
            h.kill(dead)

    h = Harness()
    moved = await run(h, GREEDY, dies_three_times)
    assert len(h.adds()) == 1 + MAX_MOVES and moved[-1].error == "worker 0 died"


@async_test
async def test_nothing_produced_and_no_live_worker_is_engine_unavailable() -> None:
    async def both_die(h: Harness) -> None:
        h.cluster.workers[1].alive = False
        h.kill(0)

    with pytest.raises(EngineUnavailable):
        await run(Harness(), GREEDY, both_die)


@async_test
async def test_a_worker_dead_before_the_gateway_saw_it_is_unavailable_not_an_error() -> None:
    """Its process killed but not reaped yet: the router still picks it and the send finds
    no socket. A request with nothing produced is answered 503 with Retry-After; one that
    gave tokens and cannot move ends with an error output."""
    h = Harness(1)
    h.unreachable.add(0)
    with pytest.raises(EngineUnavailable) as exc:
        await run(h, GREEDY, lambda h: settle())
    assert "worker 0 is not connected" in str(exc.value) and exc.value.retry_after_s
    assert not h.client.streams

    async def moves_to_a_dead_one(h: Harness) -> None:
        h.emit(0, [5])
        await settle()
        h.unreachable.add(1)
        h.kill(0)

    seen = await run(Harness(), GREEDY, moves_to_a_dead_one)
    assert tokens(seen) == [5] and seen[-1].error == "worker 0 died and worker 1 is unreachable"


@async_test
async def test_the_http_layer_says_which_requests_stream(tokenizer: Tokenizer) -> None:
    engine = FakeEngine(tokenizer)
    async with serve(engine, tokenizer) as client:
        for stream in (False, True):
            status, _ = await post(client, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES,
                                                                    "stream": stream})
            assert status == 200
    assert [r["streaming"] for r in engine.requests] == [False, True]
