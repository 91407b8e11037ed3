"""Admission control (gateway/routing/admission.py) on a fake clock and hand-built predictions:
the verdict and its Retry-After worked out by hand, each mode (off, reject, queue), the
held queue's bound, its re-judging when work leaves the ledger, its deadline, and the
predictions taken from the router's own candidates and ledger."""

from __future__ import annotations

import asyncio

import pytest

from memserve.costmodel.model import (
    AttentionCost,
    BandwidthCost,
    CostKey,
    CostModel,
    DecodeCost,
    OperatorCost,
)
from memserve.gateway.engine_protocol import RequestRejected
from memserve.gateway.routing.admission import (
    DEADLINE,
    INFEASIBLE,
    QUEUE,
    QUEUE_FULL,
    REJECT,
    SLO_UNATTAINABLE,
    Admission,
    Prediction,
    judge,
    predict,
)
from memserve.gateway.routing.router import Router, RouteRequest, WorkerView
from memserve.ipc.messages import MemPoolStats, TierStats, WorkerStats
from memserve.kvcache.mirror import PromptTreeMirror

BS = 4


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def preds(*pairs: tuple[float, float]) -> list[Prediction]:
    return [Prediction(i, queued, exec_) for i, (queued, exec_) in enumerate(pairs)]


# ------------------------------------------------------------------------- judge
def test_admitted_when_the_best_instance_meets_the_slo():
    # TTFTs 0.9 and 0.5 (0.3 queued + 0.2 prefill): the second meets 0.5 exactly.
    verdict = judge(0.5, 0.0, preds((0.8, 0.1), (0.3, 0.2)))
    assert verdict.admit and verdict.predicted_ttft_s == pytest.approx(0.5)


def test_refused_with_the_time_the_best_queue_needs_to_drain():
    # Best TTFT min(2.7 + 0.2, 3.0 + 0.1) = 2.9 s against 0.4 s: a fresh copy fits in 2.5 s.
    verdict = judge(0.4, 0.0, preds((2.7, 0.2), (3.0, 0.1)))
    assert (verdict.admit, verdict.reason) == (False, SLO_UNATTAINABLE)
    assert verdict.retry_after_s == pytest.approx(2.5)
    assert verdict.predicted_ttft_s == pytest.approx(2.9)


def test_retry_after_is_at_least_one_second():
    verdict = judge(0.4, 0.0, preds((0.3, 0.2)))  # 0.1 s over
    assert verdict.reason == SLO_UNATTAINABLE and verdict.retry_after_s == 1.0


def test_a_prefill_longer_than_the_slo_everywhere_is_infeasible_without_retry():
    verdict = judge(0.4, 0.0, preds((0.0, 0.5), (0.0, 0.45)))
    assert (verdict.admit, verdict.reason, verdict.retry_after_s) == (False, INFEASIBLE, None)


def test_a_request_that_waited_past_its_prefill_budget_is_past_its_deadline():
    # SLO 1.0 s, waited 0.85 s: 0.15 s left, less than the 0.2 s prefill on an idle instance.
    assert judge(1.0, 0.85, preds((0.5, 0.2))).reason == DEADLINE
    # With 0.3 s left it could still fit once the queue drains: not past its deadline.
    assert judge(1.0, 0.7, preds((0.5, 0.2))).reason == SLO_UNATTAINABLE
    # And with the queue gone, 0.2 s <= 0.3 s left: admitted.
    assert judge(1.0, 0.7, preds((0.0, 0.2))).admit


# ------------------------------------------------------------------------ modes
def run(coro):
    return asyncio.run(coro)


def test_off_and_requests_without_slo_are_never_judged():
    never = lambda: pytest.fail("predictions were asked for")
    run(Admission("off").admit(0.001, never))
    admission = Admission(REJECT)
    run(admission.admit(None, never))
    assert admission.stats()["admitted"] == {} and admission.stats()["rejected"] == {}


def test_reject_mode_raises_429_material_and_counts():
    admission = Admission(REJECT)
    with pytest.raises(RequestRejected) as refused:
        run(admission.admit(0.4, lambda: preds((2.7, 0.2))))
    assert refused.value.retry_after_s == pytest.approx(2.5)
    assert "TTFT" in str(refused.value) and "2900 ms" in str(refused.value)
    run(admission.admit(0.4, lambda: preds((0.1, 0.2))))
    assert admission.stats() == {"mode": REJECT, "held": 0, "max_held": 256,
                                 "rejected": {SLO_UNATTAINABLE: 1}, "admitted": {"direct": 1}}


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError):
        Admission("maybe")


async def _until(predicate, timeout_s: float = 2.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.001)


def test_queue_holds_until_work_leaves_the_ledger():
    async def scenario():
        clock = FakeClock()
        admission = Admission(QUEUE, max_held=2, clock=clock)
        queued = [3.0]  # the best instance's queued work, as the ledger would report it
        held = asyncio.create_task(admission.admit(1.0, lambda: preds((queued[0], 0.2))))
        await _until(lambda: admission.held == 1)
        admission.notify()  # nothing changed: judged again, still held
        await asyncio.sleep(0.01)
        assert not held.done() and admission.held == 1
        clock.now += 0.3  # 0.7 s of the SLO left; the queue drops to 0.4 s: 0.6 s fits
        queued[0] = 0.4
        admission.notify()
        await asyncio.wait_for(held, 1.0)
        assert admission.held == 0 and admission.stats()["admitted"] == {"held": 1}

    run(scenario())


def test_the_held_queue_is_bounded():
    async def scenario():
        admission = Admission(QUEUE, max_held=2, clock=FakeClock())
        busy = lambda: preds((30.0, 0.2))
        holders = [asyncio.create_task(admission.admit(10.0, busy)) for _ in range(2)]
        await _until(lambda: admission.held == 2)
        with pytest.raises(RequestRejected) as refused:
            await admission.admit(10.0, busy)
        assert refused.value.retry_after_s == pytest.approx(20.2)  # 30.2 s predicted - 10 s SLO
        assert admission.stats()["rejected"] == {QUEUE_FULL: 1}
        for task in holders:  # a client that goes away leaves the queue
            task.cancel()
        await asyncio.gather(*holders, return_exceptions=True)
        assert admission.held == 0

    run(scenario())


def test_a_held_request_is_refused_once_its_prefill_no_longer_fits():
    async def scenario():
        clock = FakeClock()
        admission = Admission(QUEUE, clock=clock)
        held = asyncio.create_task(admission.admit(1.0, lambda: preds((5.0, 0.2))))
        await _until(lambda: admission.held == 1)
        clock.now += 0.81  # 0.19 s left < the 0.2 s prefill
        admission.notify()
        with pytest.raises(RequestRejected) as refused:
            await asyncio.wait_for(held, 1.0)
        assert refused.value.retry_after_s == pytest.approx(4.2)
        assert admission.stats()["rejected"] == {DEADLINE: 1} and admission.held == 0

    run(scenario())


def test_a_held_request_wakes_itself_at_its_deadline():
    """No event needed: the wait ends when the prefill alone would no longer fit (real
    clock, a 30 ms budget)."""
    async def scenario():
        admission = Admission(QUEUE)
        with pytest.raises(RequestRejected):
            await asyncio.wait_for(admission.admit(0.05, lambda: preds((5.0, 0.02))), 2.0)
        assert admission.stats()["rejected"] == {DEADLINE: 1}

    run(scenario())


# -------------------------------------------------------- router's predictions
def linear_cost() -> CostModel:
    """exec(x, y) = 0.01 s per new token; a decode step 0.05 s whatever the batch."""
    return CostModel(CostKey("toy", "float32", "test"), BS, kv_bytes_per_token=1,
                     operators={"gemm": OperatorCost(per_token=0.01)}, attention=AttentionCost(0, 0, 0, 0),
                     decode=DecodeCost(0.05, 0.0, 0.0), copy=BandwidthCost(0.0, 1.0), transfer=BandwidthCost(0.0, 1.0))


def test_predictions_are_the_routers_queued_work_plus_the_prefill():
    cost = linear_cost()
    router = Router.named("least-load", cost, clock=FakeClock())
    views = [WorkerView(i, "ok", 0, WorkerStats(), PromptTreeMirror(i, BS)) for i in (0, 1)]
    # Worker 0 holds a 30-token prompt not yet prefilled, worker 1 a request decoding.
    router.route(RouteRequest("a", list(range(30)), max_tokens=8), views)
    views[0].in_flight = 1
    router.route(RouteRequest("b", list(range(50, 60)), max_tokens=8), views)
    router.observe("b", 1)
    new = RouteRequest("c", list(range(200, 220)))
    got = predict(router.candidates(new, views), cost, new, BS)
    # Worker 0: 0.30 s prefill + (1 waiting + 1) decode steps of an empty batch (0 s) = 0.30.
    # Worker 1: no prefill + 1 step of its 1-request decode batch = 0.05. Prefill of c: 0.20.
    assert [(p.instance, round(p.queued_s, 9), round(p.exec_s, 9)) for p in got] == [(0, 0.3, 0.2), (1, 0.05, 0.2)]
    assert judge(0.25, 0.0, got).admit and not judge(0.24, 0.0, got).admit


@pytest.mark.parametrize("prompt, slo_ms, queued_s", [
    # A 0.2 s SLO is 4 decode steps: "a" and "b" grow by 4 tokens (a block each), room 8.
    (28, 200, 0.05),  # needs 8 blocks (28 tokens and its first): fits now, the queued work alone
    # A 0.5 s SLO is 10 steps: "a" grows 7 (to 4 blocks), "b" 10 (to 5 blocks), room 7.
    (28, 500, 7 * 0.05),  # 7 steps on, "a" ends and frees 4; "b" grew 17 (to 7 blocks): room 9
    (40, 500, 23 * 0.05),  # needs 11: once "b" ends too, 23 steps on, 16 are free
    (28, None, 7 * 0.05),  # no SLO: counted to their ends (a: 4, b: 8 blocks), room 4, then 8
])
def test_predictions_wait_for_kv_room_when_kv_binds(prompt, slo_ms, queued_s):
    cost = linear_cost()
    router = Router.named("least-load", cost, clock=FakeClock())
    device = TierStats(total=16, free=10, used=6)
    view = WorkerView(0, "ok", 0, WorkerStats(mempool=MemPoolStats(tiers={"device": device})), PromptTreeMirror(0, BS))
    # Two requests decoding, one token out each, 3 blocks (9 tokens) held each: "a" expects
    # 8 tokens (7 to go), "b" 24 (23 to go). A decode step takes 0.05 s.
    for rid, max_tokens in (("a", 8), ("b", 24)):
        router.route(RouteRequest(rid, list(range(8)), max_tokens=max_tokens), [view])
        router.observe(rid, 1)
    new = RouteRequest("c", list(range(100, 100 + prompt)), slo={} if slo_ms is None else {"ttft_ms": slo_ms})
    [got] = predict(router.candidates(new, [view]), cost, new, BS, router.ledger)
    assert (got.queued_s, got.exec_s) == (pytest.approx(queued_s), pytest.approx(prompt * 0.01))
    # Without the ledger the prediction knows nothing of KV: one decode step of queued work.
    assert predict(router.candidates(new, [view]), cost, new, BS)[0].queued_s == pytest.approx(0.05)
