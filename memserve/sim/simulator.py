"""Discrete-event simulation of N instances running the real engine on a virtual clock.

Each instance is a real ``Engine`` (scheduler, KV cache manager, MemPool, policies) over
a ``SimulatedRunner``; requests are routed by the real gateway ``Router`` over mirrors
fed by the engines' own KV events. Nothing here re-implements a policy: it only decides
*when* things happen. The gateway's admission control (``gateway/routing/admission.py``) judges
each request with a TTFT SLO on arrival, as ``memserve up`` does: a refused request is
recorded with status 429 (it meets no SLO), and ``queue`` mode holds requests and judges
them again whenever a request gets its first token or finishes. With prefill and decode
roles, ``sim/pd_flow.py`` hands each request from its prefill instance to a decode
instance. Sessions replay as ``memserve bench`` replays them (Poisson session
starts from the same seeded generator, turn k+1 sent when turn k's answer is complete,
exponential think times), and the records are the bench's, so ``results.json`` has the
same shape and ``memserve bench compare`` works across real and simulated runs.

Output lengths are the workload's recorded answer lengths (capped by ``max_tokens``): a
simulation cannot know when a model would stop. The history of the next turn carries
the recorded answer with ``fixed_output_len`` (as the bench does) and otherwise the
tokens the engine produced.

Deterministic: no wall clock, no randomised hashing; the same inputs give the same
results."""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, replace

from memserve.config import EngineConfig
from memserve.costmodel.model import CostModel
from memserve.gateway.routing.admission import OFF, Admission, Verdict, predict
from memserve.gateway.routing.pd_topology import is_disaggregated, role_caches
from memserve.gateway.routing.router import Router, RouteRequest, WorkerView
from memserve.ipc.messages import AddRequest, RequestOutput, SamplingParams
from memserve.kvcache.blocks import OutOfBlocks
from memserve.kvcache.events import KVEvents
from memserve.kvcache.mirror import PromptTreeMirror
from memserve.sim.instance import InFlight, SimInstance
from memserve.sim.pd_flow import SimPDFlow
from memserve.sim.runner import SimulatedRunner
from memserve.sim.tokens import TextTokenizer, chat_tokens
from memserve.workers.engine.engine import Engine
from memserve.workload.records import RequestRecord
from memserve.workload.replay import ReplayOptions, arrival_offsets
from memserve.workload.workloads import Session

# A step that computed nothing while work remains (only loads in flight) polls again after this.
IDLE_POLL_S = 1e-3


@dataclass(eq=False)
class _Arrival:
    """A request that reached the gateway and is not routed yet (admission may hold it)."""

    request: RouteRequest
    record: RequestRecord
    session: int
    turn: int
    messages: list[tuple[str, list[int] | str]]


class Simulation:
    def __init__(self, cost: CostModel, engine_cfg: EngineConfig, num_instances: int, router: Router,
                 tokenizer: TextTokenizer, options: ReplayOptions, num_disk_blocks: int = 0,
                 predict: Callable[[str, int], int] | None = None, roles: list[str] | None = None,
                 pd_mode: str = "pd-caching-3", admission: Admission | None = None) -> None:
        self.now = 0.0
        self.admission = admission if admission is not None else Admission(OFF)
        self.admission.clock = self.clock
        self._held: list[_Arrival] = []  # FIFO, as admission's queue mode holds them
        self.predict = predict  # the gateway predictor's part: (request id, true output length) -> predicted
        self.cost = cost
        self.router = router
        self.tokenizer = tokenizer
        self.options = options
        self.block_size = engine_cfg.block_size
        router.ledger.clock = router.pending.clock = self.clock  # queued work, TTFT samples, pending prompts
        roles = roles or ["colocated"] * num_instances
        if len(roles) != num_instances:
            raise ValueError(f"{num_instances} instances but {len(roles)} roles")
        self.instances: list[SimInstance] = []
        if engine_cfg.num_blocks is None:
            raise ValueError("the simulator needs the KV blocks of an instance (num_blocks)")
        for i, role in enumerate(roles):
            runner = SimulatedRunner(cost, engine_cfg.num_blocks, engine_cfg.block_size,
                                     engine_cfg.max_model_len or 1 << 30, self.clock, num_disk_blocks)
            caching = engine_cfg.enable_prefix_caching and role_caches(role, pd_mode)
            engine = Engine(replace(engine_cfg, enable_prefix_caching=caching), runner, set(), i, self.clock)
            self.instances.append(SimInstance(engine, runner, PromptTreeMirror(i, engine_cfg.block_size), role))
        self._events: list[tuple[float, int, str, tuple]] = []
        self._seq = itertools.count()
        self.in_flight: dict[str, InFlight] = {}
        self.records: list[RequestRecord] = []
        self.num_steps = 0
        self.pd = SimPDFlow(self, pd_mode) if is_disaggregated(roles) else None

    def clock(self) -> float:
        return self.now

    # ------------------------------------------------------------------ run
    def run(self, sessions: list[Session]) -> float:
        """Replay ``sessions``; returns the simulated duration (seconds)."""
        self.sessions = sessions
        offsets = arrival_offsets(len(sessions), self.options.rate, random.Random(f"arrivals:{self.options.seed}"))
        self.deadline = self.options.duration_s if self.options.duration_s else math.inf
        for s, start in enumerate(offsets):
            history = [("system", sessions[s].system)] if sessions[s].system else []
            self._push(start, "arrive", (s, 0, history))
        while self._events:
            self.now, _, kind, data = heapq.heappop(self._events)
            if kind == "arrive":
                self._arrive(*data)
            elif kind == "admit":
                self._admit(*data)
            elif kind == "call":
                data[0]()
            else:
                self._step(*data)
        return self.now

    def _push(self, at: float, kind: str, data: tuple) -> None:
        heapq.heappush(self._events, (at, next(self._seq), kind, data))

    def schedule(self, at: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` at virtual time ``at`` (transfers, handoffs)."""
        self._push(at, "call", (fn,))

    # ------------------------------------------------------------- arrivals
    def _arrive(self, s: int, k: int, history: list[tuple[str, list[int] | str]]) -> None:
        if self.now >= self.deadline:
            return
        session, turn = self.sessions[s], self.sessions[s].turns[k]
        messages = history + [("user", turn.user)]
        prompt = chat_tokens(self.tokenizer, messages)
        max_tokens = turn.output_len or self.options.max_tokens or 256
        if self.options.max_tokens:
            max_tokens = min(max_tokens, self.options.max_tokens)
        rid = f"{session.session_id}:{k + 1}"
        slo_ttft_ms, slo_tbt_ms = self.options.slos(session.session_id, k + 1)
        slo = {key: v for key, v in (("ttft_ms", slo_ttft_ms), ("tbt_ms", slo_tbt_ms)) if v is not None}
        record = RequestRecord(session.session_id, k + 1, self.now, prompt_tokens=len(prompt),
                               slo_ttft_ms=slo_ttft_ms, slo_tbt_ms=slo_tbt_ms)
        arrival = _Arrival(RouteRequest(rid, prompt, session.session_id, slo, max_tokens), record, s, k, messages)
        self._judge(arrival, held=False)

    def _judge(self, arrival: _Arrival, held: bool) -> None:
        """Admission control, then routing: the gateway's ``Admission.look`` on the router's
        scores now."""
        slo_ms = arrival.request.slo.get("ttft_ms")
        if self.admission.mode == OFF or slo_ms is None:
            self._route(arrival)
            return
        request = arrival.request
        predictions = predict(self.router.candidates(request, self.views()), self.cost, request, self.block_size,
                              self.router.ledger)
        outcome = self.admission.look(slo_ms / 1000.0, self.now - arrival.record.start, predictions, held)
        if isinstance(outcome, Verdict):
            if held:
                self._held.remove(arrival)
                self.admission.held -= 1
            if outcome.admit:
                self._route(arrival)
            else:
                record = arrival.record
                record.end, record.status, record.error = self.now, "429", str(outcome.rejection(slo_ms / 1000.0))
                self.records.append(record)
            return
        if not held:
            self._held.append(arrival)
            self.admission.held += 1
        # Judged again by then at the latest (when it would become hopeless), sooner on news.
        def judge_again() -> None:
            if arrival in self._held:
                self._judge(arrival, held=True)

        self.schedule(self.now + outcome, judge_again)

    def _notify_admission(self) -> None:
        """Queued work left the ledger: every held request is judged again, oldest first."""
        for arrival in list(self._held):
            if arrival in self._held:
                self._judge(arrival, held=True)

    def _route(self, arrival: _Arrival) -> None:
        request, record = arrival.request, arrival.record
        decision = self.router.route(request, self.views())
        rid, prompt, slo, max_tokens = request.request_id, request.prompt_token_ids, request.slo, request.max_tokens
        assert max_tokens is not None  # every simulated request has its output length
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        add = AddRequest(rid, prompt, params, request.session_id, 0.0, 0, slo.get("ttft_ms"), slo.get("tbt_ms"),
                         predicted_output_tokens=self.predict(rid, max_tokens) if self.predict else None)
        turn = InFlight(record, arrival.session, arrival.turn, decision.instance, arrival.messages)
        if decision.pull_from is None:
            self._admit(add, turn)
        else:
            self._push(self.now + self._pull(decision.pull_from, decision.instance, prompt), "admit", (add, turn))

    def _admit(self, add: AddRequest, turn: InFlight) -> None:
        refused = (self.pd.admit(add, turn.instance) if self.pd is not None
                   else self.instances[turn.instance].engine.add_request(add, self.now))
        if refused is not None:
            self.router.release(add.request_id)
            turn.record.end, turn.record.status, turn.record.error = self.now, "400", refused.error
            self.records.append(turn.record)
            return
        self.in_flight[add.request_id] = turn
        self.wake(turn.instance, self.now)

    def _pull(self, src: int, dst: int, prompt: list[int]) -> float:
        """MemServe eq. 2 on the cost-model clock, as the gateway's prefix pull: ``src``'s
        cached prefix is inserted into ``dst``'s MemPool now and the request reaches
        ``dst`` once ``src`` ended its current step (workers serve pushes between steps)
        and every block was sent. Returns that delay (0 when the pull fails: the prefix
        was evicted meanwhile, or ``dst`` has no room)."""
        source, target = self.instances[src].engine.mempool, self.instances[dst].engine.mempool
        n = len(source.match(prompt, take_ref=False))
        have = target.match(prompt, take_ref=True)  # held: making room must not evict them
        try:
            new = target.alloc_mem(n - len(have)) if n > len(have) else []
        except OutOfBlocks:
            new = None
        if new is not None:
            target.insert(prompt[: n * target.block_size], have + new)
        target.free_mem(have + (new or []))
        self.router.pull_done(new is not None and n > 0)
        if new is None or n == 0:
            return 0.0
        wait = max(0.0, self.instances[src].step_end - self.now)
        return wait + self.cost.transfer_s(n * target.block_size * self.cost.kv_bytes_per_token)

    def views(self) -> list[WorkerView]:
        in_flight = [0] * len(self.instances)
        for t in self.in_flight.values():
            in_flight[t.instance] += 1
        return [WorkerView(i, "ok", in_flight[i], inst.stats, inst.mirror, inst.role)
                for i, inst in enumerate(self.instances)]

    def wake(self, i: int, at: float) -> None:
        if not self.instances[i].busy:
            self.instances[i].busy = True
            self._push(at, "step", (i,))

    # ---------------------------------------------------------------- steps
    def _step(self, i: int) -> None:
        inst = self.instances[i]
        inst.busy = False
        inst.runner.last_step_s = 0.0
        outputs = inst.engine.step()
        done_at = inst.step_end = self.now + inst.runner.last_step_s
        self.num_steps += inst.runner.last_step_s > 0
        self.schedule(done_at, lambda: self._deliver(i, outputs))  # before the next step's event
        if inst.engine.has_work:
            if inst.runner.last_step_s > 0:
                self.wake(i, done_at)
            else:
                load_done = inst.runner.next_load_done()
                self.wake(i, load_done if load_done is not None and load_done > self.now else self.now + IDLE_POLL_S)

    def _deliver(self, i: int, outputs: list[RequestOutput]) -> None:
        """A step's results leave the worker when the step ends, not when it starts: its
        KV events reach the mirror, its tokens the client and the router's ledger then (the
        engine ran the step at its start; a router told early would see a prefill done and
        its instance idle while it still computes). Its free KV blocks go with them, as a
        worker's stats report (sent about as often as steps end while it is busy)."""
        self.publish(i)
        self.instances[i].stats = {"mempool": self.instances[i].engine.mempool.stats()}
        if self.pd is not None:
            outputs = self.pd.filter(i, outputs, self.now)
        news = False  # a request got its first token or finished: queued work left the ledger
        for out in outputs:
            turn = self.in_flight.get(out.request_id)
            if turn is None:
                continue
            rec = turn.record
            news |= out.finished or (bool(out.new_token_ids) and not turn.output)
            rec.cached_tokens = out.num_cached_tokens
            self.router.observe(out.request_id, len(out.new_token_ids), self.now)
            if out.new_token_ids:
                rec.chunk_times.append(self.now)
                rec.chunk_tokens.append(len(out.new_token_ids))
                turn.output += out.new_token_ids
            if out.finished:
                self.finish(out.request_id, turn, self.now, out.error)
        if news and self._held:
            self._notify_admission()

    def publish(self, i: int) -> None:
        """Instance ``i``'s KV events reach the router's mirror of its prompt tree."""
        events = self.instances[i].engine.drain_kv_events()
        if events:
            self.instances[i].mirror.apply(KVEvents(i, events))
            self.router.kv_events_applied(self.instances[i].mirror)

    def finish(self, rid: str, turn: InFlight, at: float, error: str | None) -> None:
        del self.in_flight[rid]
        self.router.release(rid)
        if self.pd is not None:
            self.pd.finished(rid, turn.output, at, error is None)
        rec = turn.record
        rec.end = at
        rec.completion_tokens = len(turn.output)
        if error is not None:
            rec.status, rec.error = "500", error
        self.records.append(rec)
        session = self.sessions[turn.session]
        if error is not None or turn.turn + 1 >= len(session.turns):
            return
        recorded = session.turns[turn.turn].recorded_answer
        answer: list[int] | str = recorded if self.options.fixed_output_len and recorded is not None else turn.output
        history = turn.messages + [("assistant", answer)]
        think = 0.0
        if self.options.think_time_s > 0:
            rng = random.Random(f"think:{self.options.seed}:{session.session_id}:{turn.turn}")
            think = rng.expovariate(1.0 / self.options.think_time_s)
        self._push(at + think, "arrive", (turn.session, turn.turn + 1, history))
