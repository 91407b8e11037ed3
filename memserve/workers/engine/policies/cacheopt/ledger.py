"""CacheOpt's KV allocations as a ledger over the paged pool (the policy's ``KVGate``).

In a paged pool blocks are interchangeable, so allocating a request its predicted
demand M_i up front (CacheOpt §3.3) is the same as *promising* it M_i blocks: the ledger
records each running request's allocation a_i (blocks) beside the blocks it holds u_i,
and the blocks free for new promises are the pool's allocatable blocks minus every
request's promised-but-unheld blocks minus the global reserve's unused part. The pool
still hands out blocks on demand, so the runner's block tables are untouched and an
allocation costs nothing until it is used.

- A request grows inside its allocation without asking anyone; past it, it takes
  blocks from the free part (the KV other requests released), then from the global
  reserve (§3.3.3); when neither has room it is refused and the scheduler preempts.
- An *embedded* request (§3.3.1) is promised part of a running request's unused
  allocation (its host's a_j shrinks by as much); when it leaves, the host gets it back.
- An allocation cut short of the demand is admitted only against KV that running
  requests will free before the cut one runs out (§3.3.2); its shortfall stays
  *promised* out of such releases (``shortfalls``) until it leaves, less what it has
  since grown by (a shortfall it took is no longer owed it: counting it on would keep
  blocks promised twice and hold back every later cut request).
- Plans: the policy proposes, once per step, the allocation of each request it expects
  to admit (``plan``), and which must wait; a request admitted without a plan gets
  its basic need (``basic_blocks``: its prompt and B more tokens, so that a long
  prompt's later chunks never find themselves without room).

Invariant: ``_unheld`` is the sum over allocations of max(0, a_i - u_i), and
``reserve_used`` the reserve blocks promised to requests still running."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from memserve.workers.engine.sequence import Sequence


@dataclass(slots=True)
class Allocation:
    allocated: int  # a_i, blocks
    held: int  # u_i, blocks, as of the last grant
    from_reserve: int = 0  # blocks taken from the global reserve
    lender: str | None = None  # the request whose allocation this one is embedded in
    lent: int = 0  # blocks that lender gave up for it
    borrowers: list[str] = field(default_factory=list)  # requests embedded in this one

    @property
    def unheld(self) -> int:
        return max(0, self.allocated - self.held)


class KVLedger:
    def __init__(self, available_blocks: Callable[[], int], reserve_blocks: int,
                 basic_blocks: Callable[[Sequence], int]) -> None:
        self._available = available_blocks  # the pool's allocatable device blocks now
        self._basic = basic_blocks
        self.reserve_blocks = reserve_blocks
        self.reserve_used = 0
        self.allocations: dict[str, Allocation] = {}
        self._unheld = 0
        self._plans: dict[str, tuple[int, str | None]] = {}  # request id -> (blocks, lender)
        self._hold: set[str] = set()  # requests the plan says must wait
        self._plan_shortfalls: dict[str, int] = {}  # planned cut request -> its shortfall
        self.shortfalls: dict[str, int] = {}  # cut request -> blocks it counts on others freeing
        self.num_embedded = 0
        self.num_reserve_grants = 0

    # ----------------------------------------------------------------- queries
    def free_blocks(self) -> int:
        """Blocks no allocation has been promised and not the reserve's."""
        return self._available() - self._unheld - (self.reserve_blocks - self.reserve_used)

    @property
    def unheld_blocks(self) -> int:
        """Allocated to running requests but not used yet (padding and over-allocation)."""
        return self._unheld

    # ----------------------------------------------------------------- plans
    def plan(self, plans: dict[str, tuple[int, str | None]], hold: set[str],
             shortfalls: dict[str, int] | None = None) -> None:
        """This step's proposed allocations of requests about to be admitted (replacing
        the previous step's): ``blocks`` each, embedded in ``lender`` when named; the
        requests in ``hold`` are refused this step. A planned request in ``shortfalls``
        is cut: once admitted, it counts on that many blocks that running requests free
        as they finish (a planned request the step does not admit promises nothing)."""
        self._plans, self._hold, self._plan_shortfalls = plans, hold, shortfalls or {}

    @property
    def promised_blocks(self) -> int:
        return sum(self.shortfalls.values())

    def resize(self, request_id: str, blocks: int) -> None:
        """A running request's allocation becomes ``blocks``: more (proactive allocation,
        from the free part) or fewer (amortisation took some of its unused part back)."""
        a = self.allocations[request_id]
        self._settle(request_id, blocks - a.allocated)
        self._set(a, blocks, a.held)

    # ----------------------------------------------------------------- KVGate
    def grant(self, seq: Sequence, held: int, need: int) -> bool:
        a = self.allocations.get(seq.request_id)
        if a is None:
            return self._admit(seq, held, need)
        want = held + need
        if want <= a.allocated:
            self._set(a, a.allocated, want)
            return True
        extra = want - a.allocated
        free = max(0, self.free_blocks())
        from_reserve = max(0, extra - free)
        if from_reserve > self.reserve_blocks - self.reserve_used:
            return False
        if from_reserve:
            self.reserve_used += from_reserve
            a.from_reserve += from_reserve
            self.num_reserve_grants += 1
        self._settle(seq.request_id, extra)
        self._set(a, want, want)
        return True

    def release(self, seq: Sequence) -> None:
        a = self.allocations.pop(seq.request_id, None)
        if a is None:
            return
        self.shortfalls.pop(seq.request_id, None)
        self._unheld -= a.unheld
        self.reserve_used -= a.from_reserve
        lender = self.allocations.get(a.lender) if a.lender is not None else None
        if lender is not None:
            lender.borrowers.remove(seq.request_id)
            self._set(lender, lender.allocated + a.lent, lender.held)
        for rid in a.borrowers:
            self.allocations[rid].lender = None  # the host left: its guest keeps what it has

    # --------------------------------------------------------------- internals
    def _admit(self, seq: Sequence, held: int, need: int) -> bool:
        request_id = seq.request_id
        if request_id in self._hold:
            return False
        planned = self._plans.pop(request_id, None)
        blocks, lender_id = planned if planned is not None else (self._basic(seq), None)
        want = max(blocks, held + need)
        lender = self.allocations.get(lender_id) if lender_id is not None else None
        if lender is not None and lender.unheld >= want - held:
            lent = want - held
            self._set(lender, lender.allocated - lent, lender.held)
            lender.borrowers.append(request_id)
            self.num_embedded += 1
        else:
            lender, lent = None, 0
            if self.free_blocks() < want - held:
                return False
        a = Allocation(want, held + need, lender=lender_id if lender is not None else None, lent=lent)
        self.allocations[request_id] = a
        shortfall = self._plan_shortfalls.pop(request_id, 0) if planned is not None else 0
        if shortfall > 0:
            self.shortfalls[request_id] = shortfall
        self._unheld += a.unheld
        return True

    def _settle(self, request_id: str, grown: int) -> None:
        """A cut request's allocation grew by ``grown`` blocks: that much of its
        shortfall is paid."""
        owed = self.shortfalls.get(request_id)
        if owed is None or grown <= 0:
            return
        if owed > grown:
            self.shortfalls[request_id] = owed - grown
        else:
            del self.shortfalls[request_id]

    def _set(self, a: Allocation, allocated: int, held: int) -> None:
        self._unheld -= a.unheld
        a.allocated, a.held = allocated, held
        self._unheld += a.unheld
