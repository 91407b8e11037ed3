"""``--schedule-policy cacheopt``: SLO-aware batching, KV allocation and preemption
(CacheOpt §3.3-3.5) on the shared scheduler's hooks.

Per step (``begin_step``), with T_max the longest recent step:

- Request selection: waiting requests are admitted by ascending remaining time to
  their SLO (RT: to the TTFT deadline, or for a preempted request to its next-token
  deadline under the TBT SLO), earliest deadline first; running requests whose RT minus
  T_max is below epsilon (critical) are served first, then the decodes, then prefills.
- Step size (``cacheopt_budget``): the step's prompt tokens are bounded so that its
  predicted time keeps the tightest attainable next-token deadline, but never below a
  minimum chunk nor below what the prompts need to meet their TTFT deadlines.
- KV allocation (``cacheopt_ledger.KVLedger``): the requests expected to be admitted
  this step are first embedded in running requests' unused allocations where they fit,
  the rest allocated their predicted demand, amortised when the free KV is short
  (``cacheopt_alloc``); running requests about to exhaust an unfulfilled allocation
  within m iterations join that allocation (proactive allocation); a global reserve
  catches requests that run out with nothing free.
- Preemption: victims in CacheOpt's band order (``cacheopt_preempt``), an embedded
  request first when its host needs its space back; swapped when longer than the
  sweet spot of the cost model and the host tier has room, else recomputed
  (``cacheopt_sweetspot``). Running requests are preempted when a running one needs
  KV that is not there, and (``make_room``, before the step) for critical waiting
  requests whose basic need the unallocated KV cannot hold.

No starvation. A waiting request's key is a fixed deadline d = arrival + TTFT SLO +
priority x slack (a preempted one: its last token + TBT SLO + priority x slack), and
it is overtaken only by requests with an earlier deadline. A request arriving at t has
deadline >= t + S_min (S_min: the smallest SLO plus priority slack in the workload), so
nothing arriving after d - S_min overtakes it: it is admitted no later than once the
requests that arrived by d - S_min are admitted (tests/engine/test_cacheopt_policy.py checks
this under a continuous stream of tighter-SLO requests). A preempted request waits under
the same rule, keyed by its next-token deadline; a running request gives up its place
to waiting ones (``make_room``) at most once.

Components switch off by name for the ablation (``cacheopt_options``)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

from memserve.costmodel.model import CostModel
from memserve.workers.engine.kv_manager import KVCacheManager, KVGate
from memserve.workers.engine.policies.base import PreemptKind
from memserve.workers.engine.policies.cacheopt.alloc import (
    Host,
    amortise,
    blocks_for,
    demand_tokens,
    embedding_host,
)
from memserve.workers.engine.policies.cacheopt.budget import step_prefill_tokens
from memserve.workers.engine.policies.cacheopt.ledger import KVLedger
from memserve.workers.engine.policies.cacheopt.options import CacheOptOptions
from memserve.workers.engine.policies.cacheopt.preempt import (
    pick_victim,
    preemption_order,
    remaining_tokens,
)
from memserve.workers.engine.policies.cacheopt.sweetspot import sweet_spot
from memserve.workers.engine.sequence import Sequence

SWEET_SPOT_SEARCH_TOKENS = 1 << 17


class CacheOpt:
    name = "cacheopt"

    def __init__(self, options: CacheOptOptions, cost: CostModel | None = None) -> None:
        self.opt = options
        self.cost = cost
        self._waiting: list[Sequence] = []  # admission order reversed: the next one is last
        self._sorted = True
        self._preempted: set[str] = set()  # waiting ids put back by push_preempted (fcfs order puts them first)
        self._yielded: set[str] = set()  # ids preempted once to make room for waiting requests
        self._yielding: set[str] = set()  # of those, the ones preempted this step: admitted after the rest
        self.now = 0.0
        self._steps: deque[float] = deque(maxlen=max(1, options.step_window))
        self._last_begin: float | None = None
        self.max_step_s = 0.0  # T_max: the longest of the recent steps
        self._last_token: dict[str, float] = {}  # request id -> when its latest token was out
        self._num_outputs: dict[str, int] = {}  # request id -> output tokens seen at that time
        self.kv: KVCacheManager | None = None
        self.ledger: KVLedger | None = None
        self.sweet_spot: int | None = None
        self.num_top_ups = 0
        self.num_cuts = 0  # running requests' allocations cut to make room
        self.num_room_preemptions = 0  # running requests preempted for critical waiting ones

    # ------------------------------------------------------------- SLO clock

    def deadline(self, seq: Sequence) -> float:
        """When the request's next token is due: the TTFT deadline until its first token,
        then the TBT deadline of the next one; a priority level moves it by the slack."""
        slack = seq.priority * self.opt.priority_slack_ms / 1000
        last = self._last_token.get(seq.request_id)
        if last is None:
            return seq.arrival_time + self._ttft_ms(seq) / 1000 + slack
        return last + self._tbt_ms(seq) / 1000 + slack

    def remaining_s(self, seq: Sequence) -> float:
        """RT: time left until the request's deadline (negative once missed)."""
        return self.deadline(seq) - self.now

    def critical(self, seq: Sequence) -> bool:
        return self.remaining_s(seq) - self.max_step_s < self.opt.epsilon_ms / 1000

    def _ttft_ms(self, seq: Sequence) -> float:
        return seq.slo_ttft_ms if seq.slo_ttft_ms is not None else self.opt.default_ttft_ms

    def _tbt_ms(self, seq: Sequence) -> float:
        return seq.slo_tbt_ms if seq.slo_tbt_ms is not None else self.opt.default_tbt_ms

    # ------------------------------------------------------------- waiting queue
    def push(self, seq: Sequence) -> None:
        self._waiting.append(seq)
        self._sorted = False

    def push_preempted(self, seq: Sequence) -> None:
        self._preempted.add(seq.request_id)
        self.push(seq)

    def _order(self) -> list[Sequence]:
        if not self._sorted:
            if self.opt.on("RSA"):
                yielding = self._yielding
                self._waiting.sort(key=lambda s: (s.request_id in yielding, self.deadline(s)), reverse=True)
            else:  # fcfs: preempted requests first, then by arrival
                self._waiting.sort(key=lambda s: (s.request_id not in self._preempted, s.arrival_time), reverse=True)
            self._sorted = True
        return self._waiting

    def peek(self) -> Sequence | None:
        return self._order()[-1] if self._waiting else None

    def pop(self) -> Sequence:
        seq = self._order().pop()
        self._preempted.discard(seq.request_id)
        return seq

    def remove(self, seq: Sequence) -> None:
        self._waiting.remove(seq)
        self._preempted.discard(seq.request_id)

    def __len__(self) -> int:
        return len(self._waiting)

    def __iter__(self) -> Iterator[Sequence]:
        return reversed(self._order())

    # ------------------------------------------------------------- per step
    def make_room(self, running: list[Sequence], now: float, budget: int) -> list[Sequence]:
        """§3.3.2: the waiting requests that must run this step to meet their SLO
        (critical, at the head of the queue, within the step's token budget) need their
        basic KV, D = sum(s^p + B); when the unallocated KV A' (free, plus running
        requests' reclaimable unused allocations) is short of it, running requests are
        preempted in §3.4's order until it is not (swap or recompute as ``preempt_kind``
        says). Only for a head that holds a request which has no token yet and can
        still meet its TTFT deadline: preempting for a deadline already missed saves
        no SLO. A victim is neither critical itself nor embedded, and is preempted this
        way at most once (so the starvation bound stands: a request loses its place to
        waiting ones at most once, and then waits under the same deadline rule); this
        step it is readmitted after the requests it made room for."""
        if self._yielding:
            self._yielding.clear()
            self._sorted = False
        if not self._waiting or not running or self.ledger is None or not self.opt.on("RSA"):
            return []
        self.now = now
        ledger, allocations = self.ledger, self.ledger.allocations
        head = self._order()[-1]
        if self.remaining_s(head) - self.max_step_s >= self.opt.epsilon_ms / 1000:
            return []  # EDF order: nothing waiting is critical
        need = 0
        rescues: list[int] = []  # D up to each request that can still make its TTFT
        for seq in reversed(self._order()):
            if budget <= 0 or not self.critical(seq):
                break
            need += self._basic_blocks(seq)
            budget -= seq.num_tokens
            if seq.request_id not in self._last_token and self.remaining_s(seq) > 0:
                rescues.append(need)
        if not rescues:
            return []
        reclaimable = sum(a.unheld for r in running if (a := allocations.get(r.request_id)) is not None
                          and a.unheld > 0 and not a.borrowers)
        free = max(0, ledger.free_blocks()) + reclaimable
        if rescues[-1] <= free:
            return []
        eligible = [r for r in running if r.request_id not in self._yielded and not self.critical(r)
                    and (a := allocations.get(r.request_id)) is not None and a.lender is None]
        if not eligible:
            return []
        order = (preemption_order(eligible, [self._tbt_ms(r) for r in eligible],
                                  [r.num_computed_tokens for r in eligible])
                 if self.opt.on("PP") else eligible[::-1])
        can_free = sum(allocations[r.request_id].held for r in order)
        covered = [d for d in rescues if d - free <= can_free]
        if not covered or covered[-1] <= free:
            return []
        shortage = covered[-1] - free
        victims: list[Sequence] = []
        for r in order:
            if shortage <= 0:
                break
            victims.append(r)
            shortage -= allocations[r.request_id].held
        self._yielded.update(r.request_id for r in victims)
        self._yielding.update(r.request_id for r in victims)
        self.num_room_preemptions += len(victims)
        return victims

    def attach(self, kv: KVCacheManager) -> KVGate:
        self.kv = kv
        self.ledger = KVLedger(kv.available_blocks, self.opt.reserve_blocks if self.opt.on("GR") else 0,
                               self._basic_blocks)
        if self.cost is not None and self.opt.on("PSS"):
            self.sweet_spot = sweet_spot(self.cost, SWEET_SPOT_SEARCH_TOKENS)
        return self

    def begin_step(self, running: list[Sequence], now: float, budget: int) -> int:
        if self._last_begin is not None and running:  # they ran in the step that just ended
            self._steps.append(now - self._last_begin)
            self.max_step_s = max(self._steps)
        self._last_begin = self.now = now
        for seq in running:
            n = len(seq.output_token_ids)
            if n and self._num_outputs.get(seq.request_id) != n:
                self._num_outputs[seq.request_id] = n
                self._last_token[seq.request_id] = now
        self._sorted = False  # deadlines moved with the tokens just produced
        if self.opt.on("RSA"):
            deadline, late, eps = self.deadline, self.max_step_s, self.opt.epsilon_ms / 1000
            # Critical first, then decodes, then prefills, otherwise oldest first: a prefill
            # chunk never takes the token a decode needs to keep its TBT deadline.
            rank = [0 if deadline(s) - now - late < eps else 1 if _decoding(s) else 2 for s in running]
            if rank != sorted(rank):
                running[:] = [running[i] for i in sorted(range(len(running)), key=rank.__getitem__)]
            budget = self._tbt_budget(running, budget)
        self._plan(running, budget)
        return budget

    def _tbt_budget(self, running: list[Sequence], budget: int) -> int:
        """The step's tokens: the decodes, plus the prompt tokens ``cacheopt_budget``
        allows beside them: bounded by the tightest next-token deadline that a chunk of
        ``min_prefill_tokens`` can meet, but never below what the prompts (running, then
        waiting in admission order) need to meet their TTFT deadlines."""
        if self.cost is None:
            return budget
        decoding = [s for s in running if _decoding(s)]
        if not decoding:
            return budget
        prefills = [(self.remaining_s(s), s.num_tokens - s.num_computed_tokens)
                    for s in [*(s for s in running if not _decoding(s)), *reversed(self._order())]
                    if not s.output_token_ids]  # TTFT-bound: a preempted request's next token is a TBT one
        prefill = step_prefill_tokens(self.cost, [self.remaining_s(s) for s in decoding],
                                      [s.num_tokens for s in decoding], prefills,
                                      max(0, budget - len(decoding)), self.opt.min_prefill_tokens)
        return min(budget, len(decoding) + prefill)

    def _basic_blocks(self, seq: Sequence) -> int:
        """A request's basic need (§3.3.2): its tokens so far and B more, but never more
        than the pool outside the reserve (the scheduler already refused longer ones)."""
        kv = self.kv
        assert kv is not None and self.ledger is not None
        basic = blocks_for(seq.num_tokens + self.opt.block_tokens, kv.block_size)
        return min(basic, kv.num_device_blocks - self.ledger.reserve_blocks)

    def _plan(self, running: list[Sequence], budget: int) -> None:
        """This step's allocations (§3.3.2-3.3.3): the waiting requests the token budget
        can take are embedded where they fit; the others, the running requests about to
        exhaust an unfulfilled allocation (proactive top-ups) and the running requests'
        allocated-but-unused KV share out the free KV, amortised when short."""
        assert self.ledger is not None and self.kv is not None
        bs, b = self.kv.block_size, self.opt.block_tokens
        ledger = self.ledger
        # Running participants: (seq, blocks wanted beyond ``base``, floor, base).
        budget -= sum(s.num_tokens - s.num_computed_tokens for s in running)
        candidates = []
        for seq in reversed(self._order()):
            if budget <= 0:
                break
            candidates.append(seq)
            budget -= seq.num_tokens
        head: list[tuple[Sequence, int, int, int]] = []
        reclaimable = top_ups = 0
        proactive, lookahead, reclaim = self.opt.on("PA"), self.opt.lookahead, self.opt.on("RSA")
        allocations = ledger.allocations
        for seq in running:
            a = allocations.get(seq.request_id)
            if a is None:
                continue
            if (proactive and a.allocated * bs - seq.num_tokens < lookahead
                    and (missing := blocks_for(demand_tokens(seq, b), bs) - a.allocated) > 0):
                head.append((seq, missing, 0, a.allocated))
                top_ups += 1
            elif reclaim and a.unheld > 0 and not a.borrowers:
                head.append((seq, a.unheld, 1, a.held))  # keeps a block, may give up the rest
                reclaimable += a.unheld
        if not candidates and not top_ups:  # the reclaimable KV would go back where it is
            ledger.plan({}, set())
            return
        plans: dict[str, tuple[int, str | None]] = {}
        rest = list(candidates)
        if self.opt.on("RSA"):
            rest = self._embed(candidates, running, plans)
        else:  # RLP: the whole predicted demand, or wait
            for seq in rest:
                plans[seq.request_id] = (blocks_for(demand_tokens(seq, b), bs), None)
            rest = []
        demands = [h[1] for h in head] + [blocks_for(demand_tokens(s, b), bs) for s in rest]
        floors = [h[2] for h in head] + [self._basic_blocks(s) for s in rest]
        free = max(0, ledger.free_blocks()) + reclaimable
        while rest and sum(floors) > free:  # the basic needs must fit: the last in order waits
            rest.pop()
            demands.pop()
            floors.pop()
        while True:  # cut requests need a release to count on: else the last in order waits
            seqs = [h[0] for h in head] + rest
            # RT: a waiting request's time to its TTFT deadline; a running one's unused
            # allocation is needed only as it runs on, so its predicted time to finish
            # (its next-token deadline, which the cut does not touch, would make every
            # running request look urgent and leave its unused KV unreclaimable).
            alloc = amortise(demands, floors, free,
                             [remaining_tokens(h[0]) * self.max_step_s for h in head]
                             + [self.remaining_s(s) for s in rest],
                             [remaining_tokens(s) for s in seqs])
            promises = self._back_with_releases(rest, alloc[len(head):], demands[len(head):], running)
            if promises is not None:
                break
            rest.pop()
            demands.pop()
            floors.pop()
        for (seq, _, _, base), blocks in zip(head, alloc):
            before = ledger.allocations[seq.request_id].allocated
            ledger.resize(seq.request_id, base + blocks)
            self.num_top_ups += base + blocks > before
            self.num_cuts += base + blocks < before
        for seq, blocks in zip(rest, alloc[len(head):]):
            plans[seq.request_id] = (blocks, None)
        admitted = set(plans)
        ledger.plan(plans, {s.request_id for s in candidates if s.request_id not in admitted}, promises)

    def _back_with_releases(self, seqs: list[Sequence], alloc: list[int], demands: list[int],
                            running: list[Sequence]) -> dict[str, int] | None:
        """§3.3.2: a request allocated less than its demand is admitted only if the
        running requests that will finish before it runs out (its allocation after its
        prompt, in steps) free at least its shortfall, beyond what earlier cut requests
        count on. Returns cut request -> shortfall, or None when one is not covered.
        A critical request needs no such backing: it must run now to meet its SLO, and
        §3.3.2 gives it its basic need (and its share) outright. With nothing running,
        no KV will be freed for anyone: cut requests then go as they are rather than
        never."""
        assert self.ledger is not None and self.kv is not None
        promises: dict[str, int] = {}
        if not running:
            return promises
        allocations = self.ledger.allocations
        finishing: list[tuple[int, int]] | None = None
        promised = self.ledger.promised_blocks
        for seq, blocks, demand in zip(seqs, alloc, demands):
            if blocks >= demand or self.critical(seq):
                continue
            if finishing is None:
                finishing = [(remaining_tokens(r), allocations[r.request_id].allocated) for r in running
                             if r.request_id in allocations]
            steps = blocks * self.kv.block_size - seq.num_tokens
            freed = sum(a for left, a in finishing if left <= steps)
            if freed - promised < demand - blocks:
                return None
            promised += demand - blocks
            promises[seq.request_id] = demand - blocks
        return promises

    def _embed(self, candidates: list[Sequence], running: list[Sequence],
               plans: dict[str, tuple[int, str | None]]) -> list[Sequence]:
        """Plan embedding of the candidates with a predicted length; returns the others."""
        assert self.ledger is not None and self.kv is not None
        bs = self.kv.block_size
        hosts = {s.request_id: Host(s.request_id, a.allocated * bs, s.num_tokens) for s in running
                 if (a := self.ledger.allocations.get(s.request_id)) is not None and a.unheld > 0}
        rest = []
        for seq in candidates:
            host = None
            if seq.predicted_output_tokens is not None and hosts:
                out = remaining_tokens(seq)
                host = embedding_host(seq.num_tokens, out, list(hosts.values()), self.opt.block_tokens)
            if host is None:
                rest.append(seq)
                continue
            blocks = blocks_for(seq.num_tokens + out, bs)
            plans[seq.request_id] = (blocks, host.request_id)
            hosts[host.request_id] = Host(host.request_id, host.allocated_tokens - blocks * bs, host.used_tokens)
        return rest

    # ------------------------------------------------------------- KV gate
    def grant(self, seq: Sequence, held: int, need: int) -> bool:
        assert self.ledger is not None  # the gate is consulted only once attach() made it
        return self.ledger.grant(seq, held, need)

    def release(self, seq: Sequence) -> None:
        assert self.ledger is not None
        self.ledger.release(seq)
        if seq.is_finished:
            self._last_token.pop(seq.request_id, None)
            self._num_outputs.pop(seq.request_id, None)
            self._yielded.discard(seq.request_id)

    # ------------------------------------------------------------- preemption
    def victim(self, running: list[Sequence], needy: Sequence) -> Sequence:
        a = self.ledger.allocations.get(needy.request_id) if self.ledger is not None else None
        if a is not None and a.borrowers:  # the host needs its space back: its newest guest goes
            guests = set(a.borrowers)
            embedded = [s for s in running if s.request_id in guests]
            if embedded:
                return max(embedded, key=lambda s: s.arrival_time)
        if not self.opt.on("PP"):
            return running[-1]
        return pick_victim(running, [self._tbt_ms(s) for s in running], [s.num_computed_tokens for s in running])

    def preempt_kind(self, victim: Sequence) -> PreemptKind:
        if (self.sweet_spot is not None and victim.num_computed_tokens >= self.sweet_spot
                and self.kv is not None and self.kv.can_swap_out(victim)):
            return PreemptKind.SWAP
        return PreemptKind.RECOMPUTE

    def stats(self) -> dict[str, Any]:
        ledger = self.ledger
        if ledger is None:
            return {}
        return {"kv_allocation": {
            "reserve_blocks": ledger.reserve_blocks,
            "reserve_in_use_blocks": ledger.reserve_used,
            "unheld_blocks": ledger.unheld_blocks,
            "embedded_total": ledger.num_embedded,
            "reserve_grants_total": ledger.num_reserve_grants,
            "proactive_top_ups_total": self.num_top_ups,
            "allocation_cuts_total": self.num_cuts,
            "room_preemptions_total": self.num_room_preemptions,
        }, "max_step_ms": self.max_step_s * 1000, "sweet_spot_tokens": self.sweet_spot}


def _decoding(seq: Sequence) -> bool:
    """The request has its prompt computed and generates one token a step."""
    return bool(seq.output_token_ids) and seq.num_computed_tokens == seq.num_tokens - 1
