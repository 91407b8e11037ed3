"""CacheOpt's KV ledger (workers/engine/policies/cacheopt/ledger.py) on a counted pool: promised blocks
are kept from others, growth past an allocation takes free blocks then the reserve,
embedding lends a host's unused allocation and gives it back, held requests wait."""

from __future__ import annotations

from memserve.ipc.messages import SamplingParams
from memserve.workers.engine.policies.cacheopt.ledger import KVLedger
from memserve.workers.engine.sequence import Sequence


class Pool:
    """Blocks in use by ``grant``s that passed; the ledger sees the rest as available."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.held: dict[str, int] = {}

    def available(self) -> int:
        return self.total - sum(self.held.values())

    def take(self, ledger: KVLedger, s: Sequence, need: int) -> bool:
        ok = ledger.grant(s, self.held.get(s.request_id, 0), need)
        if ok:
            self.held[s.request_id] = self.held.get(s.request_id, 0) + need
        return ok

    def free(self, ledger: KVLedger, s: Sequence) -> None:
        ledger.release(s)
        self.held.pop(s.request_id, None)


def seq(rid: str) -> Sequence:
    return Sequence(rid, [1, 2, 3], SamplingParams(), 0.0)


def test_allocations_are_promised_and_growth_past_them_takes_free_then_reserve():
    pool = Pool(20)
    ledger = KVLedger(pool.available, reserve_blocks=8, basic_blocks=lambda s: 1)
    a = seq("a")
    assert ledger.free_blocks() == 12  # 20 - reserve 8
    ledger.plan({"a": (10, None)}, set())
    assert pool.take(ledger, a, 2)  # admitted: 10 promised, 2 held
    assert (ledger.unheld_blocks, ledger.free_blocks()) == (8, 2)
    b = seq("b")
    assert not pool.take(ledger, b, 3)  # basic 1, but 3 needed now: only 2 free
    assert pool.take(ledger, b, 2)
    assert ledger.free_blocks() == 0
    assert pool.take(ledger, a, 8)  # within its allocation: nobody asked
    assert pool.take(ledger, a, 3)  # past it, nothing free: the reserve
    assert (ledger.reserve_used, ledger.num_reserve_grants) == (3, 1)
    assert not pool.take(ledger, a, 6)  # only 5 reserve blocks left
    pool.free(ledger, a)
    assert (ledger.reserve_used, ledger.unheld_blocks, ledger.free_blocks()) == (0, 0, 10)


def test_an_embedded_request_borrows_its_hosts_unused_allocation_and_returns_it():
    pool = Pool(40)
    ledger = KVLedger(pool.available, reserve_blocks=0, basic_blocks=lambda s: 1)
    host, guest = seq("host"), seq("guest")
    ledger.plan({"host": (20, None)}, set())
    assert pool.take(ledger, host, 5)
    free_before = ledger.free_blocks()  # 40 - 5 held - 15 unheld = 20
    ledger.plan({"guest": (4, "host")}, set())
    assert pool.take(ledger, guest, 1)
    assert ledger.allocations["host"].allocated == 16 and ledger.allocations["guest"].allocated == 4
    assert ledger.free_blocks() == free_before == 20  # lived in the host's space
    assert ledger.num_embedded == 1
    pool.free(ledger, guest)
    assert ledger.allocations["host"].allocated == 20 and ledger.allocations["host"].borrowers == []


def test_a_held_request_waits_and_an_unplanned_one_gets_its_basic_need():
    pool = Pool(40)
    ledger = KVLedger(pool.available, reserve_blocks=0, basic_blocks=lambda s: 6)
    ledger.plan({}, {"held"})
    assert not pool.take(ledger, seq("held"), 1)
    assert pool.take(ledger, seq("free"), 1)
    assert ledger.allocations["free"].allocated == 6 and ledger.unheld_blocks == 5


def test_a_shortfall_is_promised_from_admission_paid_down_by_growth_and_dropped_at_release():
    pool = Pool(40)
    ledger = KVLedger(pool.available, reserve_blocks=0, basic_blocks=lambda s: 1)
    cut, other, never = seq("cut"), seq("other"), seq("never")
    ledger.plan({"cut": (3, None), "other": (2, None), "never": (2, None)}, set(),
                {"cut": 5, "other": 2, "never": 4})
    assert ledger.promised_blocks == 0  # planned, not yet admitted: nothing promised
    assert pool.take(ledger, cut, 1) and pool.take(ledger, other, 1)
    assert ledger.shortfalls == {"cut": 5, "other": 2}  # "never" was not admitted this step
    ledger.plan({}, set())
    assert pool.take(ledger, cut, 2)  # 3 held: inside its allocation, owes the same
    assert ledger.shortfalls["cut"] == 5
    assert pool.take(ledger, cut, 2)  # 5 held: 2 past its allocation of 3 are paid
    assert ledger.shortfalls == {"cut": 3, "other": 2}
    ledger.resize("cut", 8)  # a proactive top-up of 3 pays the rest
    assert ledger.shortfalls == {"other": 2} and ledger.promised_blocks == 2
    assert pool.take(ledger, never, 1)  # admitted a step later without a plan: owes nothing
    assert "never" not in ledger.shortfalls
    pool.free(ledger, other)
    assert ledger.shortfalls == {} and ledger.promised_blocks == 0
