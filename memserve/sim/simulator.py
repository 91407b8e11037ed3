"""Discrete-event simulation of N instances running the real engine on a virtual clock.

Each instance is a real ``Engine`` (scheduler, KV cache manager, MemPool, policies) over
a ``SimulatedRunner``; requests are routed by the real gateway ``Router`` over mirrors
fed by the engines' own KV events. Nothing here re-implements a policy: it only decides
*when* things happen. The gateway's admission control (``gateway/routing/admission.py``) judges
each request with a TTFT SLO on arrival, as ``memserve up`` does: a refused request is
recorded with status 429 (it meets no SLO), and ``queue`` mode holds requests and judges
them again whenever a request gets its first token or finishes. With prefill and decode
roles, ``sim/pd_flow.py`` hands each request from its prefill instance to a decode
instance. The instances run on hosts (``sim/topology.py``), which price the KV moved
between two instances by their link; hosts may be lost (``sim/node_loss.py``). Sessions
replay as ``memserve bench`` replays them (Poisson session starts from the same seeded
generator, turn k+1 sent when turn k's answer is complete, exponential think times), and
the records are the bench's, so ``results.json`` has the same shape and ``memserve bench
compare`` works across real and simulated runs.

Output lengths are the workload's recorded answer lengths (capped by ``max_tokens``): a
simulation cannot know when a model would stop. The history of the next turn carries
the recorded answer with ``fixed_output_len`` (as the bench does) and otherwise the
tokens the engine produced.

Deterministic: no wall clock, no randomised hashing; the same inputs give the same
results.

Events. An instance's steps and their deliveries are *instance events*; arrivals,
admissions and scheduled calls (transfers, handoffs, admission re-judging) are *gateway
events*. Both kinds share one order (time, then push order), kept in two heaps so that the
next gateway event is known at once. A step's delivery and the step after it are one
event (the delivery first), as they fall at the same time one after the other.

Plain decodes run ahead. When an instance's next steps are plain decodes (every running
request decodes a token, none finishes, nothing waits: ``sim/plain_decodes.py``) and
nothing but a gateway event can reach it, the instance runs them back to back, in the
event of the first, up to the last one that starts before the next gateway event. Each
runs on its own clock, after the KV events of the one before reached the mirror: through
``Engine.step`` when it needs a KV block, else recorded on the engine's requests
(``PlainDecodes.take``; those that touch no block together). Nothing but a gateway event
can reach an instance when no handoff flow runs, admission holds nothing (a finished
request would re-judge held ones) and no request in flight has a next turn (its end
would send one): then another instance's step only changes that instance and the
router's view of it. The deliveries of all but the last of these steps fall before that
gateway event and are made in the same event: the tokens go to the records and the
router's ledger. They finish nothing and start no answer, so no other event depends on
their order. The stats the router reads are taken as of the last of them, and the last
step's delivery is an event as usual (pushed when the run is made rather than when its
step starts: only another instance's event at that very time could come in between,
and the two touch nothing in common). A step of the run that turns out not to be plain
(the pool is short of a block: a request is preempted), or that waited for the saver
or started a save (``sim/saver.py``: its duration is not the run's, and a save in flight
ends before some later step of the run), ends the run there, with its own events. So the
gateway, the records and the engines see what one event per step would have shown them."""

from __future__ import annotations

import gc
import heapq
import itertools
import math
import random
from collections import Counter
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
from memserve.kvcache.hashing import adapter_salt
from memserve.kvcache.mirror import PromptTreeMirror
from memserve.sim.adapters import AdapterReads
from memserve.sim.instance import InFlight, SimInstance
from memserve.sim.node_loss import NodeLoss
from memserve.sim.pd_flow import SimPDFlow
from memserve.sim.runner import SimulatedRunner
from memserve.sim.tokens import TextTokenizer, chat_tokens
from memserve.sim.topology import Topology
from memserve.workers.engine.engine import Engine
from memserve.workload.records import RequestRecord
from memserve.workload.replay import ReplayOptions, arrival_offsets
from memserve.workload.workloads import Session

# A step that computed nothing while work remains (only loads in flight) polls again after this.
IDLE_POLL_S = 1e-3


@dataclass(eq=False)
class _PlainRun:
    """The plain decode steps an instance's run-ahead left when it stopped at a gateway
    event, kept for its next one while no gateway event acts on the instance (``_touch``)."""

    rids: list[str]  # the running requests' ids their outputs go out under
    cached: list[int]  # their prompt tokens found cached
    lasts: list[int]  # their latest tokens
    positions: list[int]  # their computed tokens
    steps: int  # plain steps left (``PlainDecodes.steps``)


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
                 pd_mode: str = "pd-caching-3", admission: Admission | None = None,
                 topology: Topology | None = None, node_loss: NodeLoss | None = None,
                 async_saves: bool = False, save_bytes_s: float | None = None,
                 lora_slots: tuple[int, float] | None = None) -> None:
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
        if lora_slots is not None:  # the scheduler admits at most the slots' adapters, as a worker's does
            engine_cfg = replace(engine_cfg, enable_lora=True, max_loras=lora_slots[0])
        if engine_cfg.num_blocks is None:
            raise ValueError("the simulator needs the KV blocks of an instance (num_blocks)")
        self.topology = topology or Topology(num_instances, num_instances, cost.transfer, cost.transfer)
        router.use_links(self.topology.links())
        self.pulls: Counter[str] = Counter()  # prefix pulls by link (same_host, cross_host) and their blocks
        for i, role in enumerate(roles):
            runner = SimulatedRunner(cost, engine_cfg.num_blocks, engine_cfg.block_size,
                                     engine_cfg.max_model_len or 1 << 30, self.clock, num_disk_blocks,
                                     async_saves, save_bytes_s,
                                     AdapterReads(*lora_slots) if lora_slots is not None else None)
            caching = engine_cfg.enable_prefix_caching and role_caches(role, pd_mode)
            engine = Engine(replace(engine_cfg, enable_prefix_caching=caching), runner, set(), i, self.clock)
            self.instances.append(SimInstance(engine, runner, PromptTreeMirror(i, engine_cfg.block_size), role))
        self._instance_events: list[tuple[float, int, str, tuple]] = []  # steps and deliveries
        self._gateway_events: list[tuple[float, int, str, tuple]] = []  # arrivals, admissions, calls
        self._seq = itertools.count()
        self._continuing = 0  # requests in flight whose session has a next turn
        self._plain_runs: dict[int, _PlainRun] = {}  # by instance: what its latest run-ahead left
        self.in_flight: dict[str, InFlight] = {}
        self.records: list[RequestRecord] = []
        self.num_steps = 0
        self.pd = SimPDFlow(self, pd_mode) if is_disaggregated(roles) else None
        if node_loss is not None and self.pd is not None:
            raise ValueError("node loss is simulated for colocated instances only")
        self.node_loss = node_loss

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
        if self.node_loss is not None:
            self.node_loss.start(self, min(max(offsets, default=0.0), self.deadline))
        # Without a disaggregated flow (whose transfer futures and their callbacks refer to
        # each other) the events make no reference cycles, so the cyclic garbage collector
        # is off while they run: its full passes over the records and KV indexes, which
        # grow with the run, took a quarter of an hour-long run.
        collecting = gc.isenabled()
        if self.pd is None:
            gc.disable()
        try:
            self._run_events()
        finally:
            if collecting:
                gc.enable()
        return self.now

    def _run_events(self) -> None:
        instance, gateway, pop = self._instance_events, self._gateway_events, heapq.heappop
        while instance or gateway:
            if gateway and (not instance or gateway[0] < instance[0]):
                self.now, _, kind, data = pop(gateway)
            else:
                self.now, _, kind, data = pop(instance)
            if kind == "plain":
                self._deliver_plain(*data)
                self._step(data[0], None)
            elif kind == "step":
                self._step(*data)
            elif kind == "deliver":
                self._deliver(*data)
            elif kind == "arrive":
                self._arrive(*data)
            elif kind == "admit":
                self._admit(*data)
            else:
                data[0]()

    def _push(self, at: float, kind: str, data: tuple) -> None:
        """A gateway event."""
        heapq.heappush(self._gateway_events, (at, next(self._seq), kind, data))

    def _push_instance(self, at: float, kind: str, data: tuple) -> None:
        heapq.heappush(self._instance_events, (at, next(self._seq), kind, data))

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
        adapter = self.options.adapter_of(session.session_id)
        arrival = _Arrival(RouteRequest(rid, prompt, session.session_id, slo, max_tokens,
                                        cache_salt=adapter_salt(None, adapter), lora_name=adapter),
                           record, s, k, messages)
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
        request = arrival.request
        rid, prompt, slo, max_tokens = request.request_id, request.prompt_token_ids, request.slo, request.max_tokens
        assert max_tokens is not None  # every simulated request has its output length
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, lora_name=request.lora_name)
        add = AddRequest(rid, prompt, params, request.session_id, 0.0, 0, slo.get("ttft_ms"), slo.get("tbt_ms"),
                         predicted_output_tokens=self.predict(rid, max_tokens) if self.predict else None)
        self.send(add, request, InFlight(arrival.record, arrival.session, arrival.turn, -1, arrival.messages, add,
                                         request))

    def send(self, add: AddRequest, request: RouteRequest, turn: InFlight) -> None:
        """Route ``request`` and send ``add`` to the worker chosen, after the prefix pull
        the router chose, as the gateway's ``_send``."""
        decision = self.router.route(request, self.views())
        turn.instance = decision.instance
        if decision.pull_from is None:
            self._admit(add, turn)
        else:
            delay = self._pull(decision.pull_from, decision.instance, request.prompt_token_ids)
            self._push(self.now + delay, "admit", (add, turn))

    def _admit(self, add: AddRequest, turn: InFlight) -> None:
        if self.instances[turn.instance].lost:  # sent to a host that is gone: it moves once found dead
            self.in_flight[add.request_id] = turn
            self._continuing += self._continues(turn)
            if self.instances[turn.instance].state == "dead" and self.node_loss is not None:
                self.node_loss.move(add.request_id, turn)  # found dead while its prefix pull ran
            return
        self._touch(turn.instance)
        refused = (self.pd.admit(add, turn.instance) if self.pd is not None
                   else self.instances[turn.instance].engine.add_request(add, self.now))
        if refused is not None:
            self.router.release(add.request_id)
            turn.record.end, turn.record.status, turn.record.error = self.now, "400", refused.error
            self.records.append(turn.record)
            return
        self.in_flight[add.request_id] = turn
        self._continuing += self._continues(turn)
        self.wake(turn.instance, self.now)

    def _pull(self, src: int, dst: int, prompt: list[int]) -> float:
        """MemServe eq. 2 on the cost-model clock, as the gateway's prefix pull: ``src``'s
        cached prefix is inserted into ``dst``'s MemPool now and the request reaches
        ``dst`` once ``src`` ended its current step (workers serve pushes between steps)
        and every block was sent, over the link between their hosts. Returns that delay (0
        when the pull fails: the prefix was evicted meanwhile, ``dst`` has no room, or
        either end's host is gone)."""
        if self.instances[src].lost or self.instances[dst].lost:
            self.router.pull_done(False)
            return 0.0
        self._touch(dst)
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
        seconds = self.topology.transfer_s(src, dst, n * target.block_size * self.cost.kv_bytes_per_token)
        link = "same_host" if self.topology.host(src) == self.topology.host(dst) else "cross_host"
        self.pulls[link] += 1
        self.pulls[link + "_blocks"] += n
        return wait + seconds

    def views(self) -> list[WorkerView]:
        in_flight = [0] * len(self.instances)
        for t in self.in_flight.values():
            in_flight[t.instance] += 1
        return [WorkerView(i, inst.state, in_flight[i], inst.stats, inst.mirror, inst.role)
                for i, inst in enumerate(self.instances)]

    def silence(self, i: int) -> None:
        """Instance ``i``'s host is gone: it steps no more and what it was about to
        deliver never arrives."""
        self.instances[i].lost = True
        self._plain_runs.pop(i, None)
        events = self._instance_events
        events[:] = [e for e in events if e[3][0] != i]
        heapq.heapify(events)

    def wake(self, i: int, at: float) -> None:
        if not self.instances[i].busy and not self.instances[i].lost:
            self.instances[i].busy = True
            self._push_instance(at, "step", (i, None))

    # ---------------------------------------------------------------- steps
    def _step(self, i: int, delivered: list[RequestOutput] | None) -> None:
        """Deliver the previous step's ``delivered`` outputs (when this event also ends
        it), then run instance ``i``'s next step, or its plain decodes ahead."""
        if delivered is not None:
            self._deliver(i, delivered)
        inst = self.instances[i]
        inst.busy = False
        if self._run_ahead(i):
            return
        inst.runner.last_step_s = 0.0
        self._stepped(i, inst.engine.step())

    def _stepped(self, i: int, outputs: list[RequestOutput]) -> None:
        """The events that follow instance ``i``'s engine step, run now: its delivery when
        it ends, together with the next step while work remains."""
        inst = self.instances[i]
        runner = inst.runner
        step_s = runner.last_step_s
        done_at = inst.step_end = self.now + step_s
        if step_s > 0:
            self.num_steps += 1
            if inst.engine.has_work:
                inst.busy = True
                self._push_instance(done_at, "step", (i, outputs))
                return
        self._push_instance(done_at, "deliver", (i, outputs))
        if inst.engine.has_work:
            load_done = runner.next_done()
            self.wake(i, load_done if load_done is not None and load_done > self.now else self.now + IDLE_POLL_S)

    def _run_ahead(self, i: int) -> bool:
        """Run instance ``i``'s plain decode steps from now back to back, up to the last
        one that starts before the next gateway event (module docstring); False, having
        done nothing, when the next step is not plain or the instance may not run ahead.
        The runner computes the steps' tokens and durations first (``_take_steps``). What
        is left of the steps is kept for the next run-ahead, unless a gateway event acts
        on the instance before (``_touch``)."""
        run = self._plain_runs.pop(i, None)
        if self.pd is not None or self._held or self._continuing:
            return False
        inst = self.instances[i]
        if run is None:
            steps = inst.plain.steps()
            if not steps:
                return False
            seqs = inst.engine.scheduler.running
            run = _PlainRun([seq.choice_of or seq.request_id for seq in seqs], [seq.num_cached_tokens for seq in seqs],
                            [(seq.output_token_ids or seq.prompt_token_ids)[-1] for seq in seqs],
                            [seq.num_computed_tokens for seq in seqs], steps)
        horizon = self._gateway_events[0][0] if self._gateway_events else math.inf
        start = self.now
        ends, answers = inst.runner.decode_run(run.lasts, run.positions, run.steps, start, horizon)
        if not ends:
            return False  # a step that takes no time polls like an idle one (``_step``)
        done, plain_run = self._take_steps(i, ends, answers, horizon)
        self.now = start
        # The deliveries before the last plain step's: tokens to the router's ledger and the records.
        self._deliver_ahead(run.rids, run.cached, answers, ends[:done - 1 if plain_run else done])
        self.num_steps += done
        if not plain_run:
            return True
        end = inst.step_end = ends[done - 1]
        inst.busy = True
        lasts = [answer[done - 1] for answer in answers]
        self._push_instance(end, "plain", (i, run.rids, run.cached, lasts))
        if done < run.steps:
            run.lasts, run.positions, run.steps = lasts, [p + done for p in run.positions], run.steps - done
            self._plain_runs[i] = run
        return True

    def _touch(self, i: int) -> None:
        """A gateway event is about to act on instance ``i``'s engine: what its latest
        run-ahead left no longer holds."""
        self._plain_runs.pop(i, None)

    def _take_steps(self, i: int, ends: list[float], answers: list[list[int]], horizon: float) -> tuple[int, bool]:
        """Instance ``i``'s engine takes the plain decode steps that end at ``ends``, in
        which its running request k samples ``answers[k]``: those that need no block
        recorded (``PlainDecodes.take``), the others through ``Engine.step``, each on the
        clock of its start and after the KV events of the one before reached the mirror.
        Returns how many plain steps were taken, and whether they all were: False when
        the last ``Engine.step`` turned out not to be plain (it gave a request no token:
        the pool was short of a block), which then has its own events (``_stepped``)."""
        inst = self.instances[i]
        plain, engine, runner = inst.plain, inst.engine, inst.runner
        start, num_steps, num_running = self.now, len(ends), len(answers)
        done = 0
        while done < num_steps:
            if done:
                self.publish(i)
            span = min(plain.room(), num_steps - done)
            last = done + max(span, 1) - 1
            # The router reads the stats of the latest delivery: those before the last step
            # when its own delivery falls after the horizon, and those before a step that
            # needs a block (it may preempt instead, and end the run with events of its own).
            if ends[last] >= horizon or (done and not span):
                self.instances[i].take_stats()
            self.now = ends[last - 1] if last else start
            if span:
                plain.take([answer[done:done + span] for answer in answers])
                done += span
                continue
            runner.last_step_s = 0.0
            outputs = engine.step()
            # Within ``PlainDecodes.steps`` no request finishes and nothing waits: a step
            # that gives one no token preempted it. A step that waited for the saver took
            # longer than ``ends`` says; one that started a save would see it end.
            if len(outputs) != num_running or runner.last_stall_s or engine.mempool.saver.pending():
                self._stepped(i, outputs)
                return done, False
            done += 1
        return done, True

    def _deliver_ahead(self, rids: list[str], cached: list[int], answers: list[list[int]],
                       ends: list[float]) -> None:
        """The deliveries of plain decode steps made ahead of their time: step k ended at
        ``ends[k]`` and gave request ``rids[j]`` (``cached[j]`` prompt tokens cached) the
        token ``answers[j][k]``."""
        if not ends:
            return
        n, observe_each = len(ends), self.router.observe_each
        for rid, cached_tokens, answer in zip(rids, cached, answers):
            turn = self.in_flight.get(rid)
            if turn is None:
                continue
            observe_each(rid, ends)
            turn.record.cached_tokens = cached_tokens
            turn.record.chunk_times += ends
            turn.record.chunk_tokens += [1] * n
            turn.output += answer[:n]

    def _deliver_plain(self, i: int, rids: list[str], cached: list[int], tokens: list[int]) -> None:
        """``_deliver`` of a plain decode step: the request ``rids[k]`` (``cached[k]`` prompt
        tokens cached) produced ``tokens[k]``; none finished or got its first token."""
        self.publish(i)
        self.instances[i].take_stats()
        now, observe = self.now, self.router.observe
        for rid, cached_tokens, token in zip(rids, cached, tokens):
            turn = self.in_flight.get(rid)
            if turn is not None:
                turn.record.cached_tokens = cached_tokens
                observe(rid, 1, now)
                turn.record.chunk_times.append(now)
                turn.record.chunk_tokens.append(1)
                turn.output.append(token)

    def _deliver(self, i: int, outputs: list[RequestOutput]) -> None:
        """A step's results leave the worker when the step ends, not when it starts: its
        KV events reach the mirror, its tokens the client and the router's ledger then (the
        engine ran the step at its start; a router told early would see a prefill done and
        its instance idle while it still computes). Its free KV blocks go with them, as a
        worker's stats report (sent about as often as steps end while it is busy)."""
        self.publish(i)
        self.instances[i].take_stats()
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

    def _continues(self, turn: InFlight) -> bool:
        """Whether the turn's session has a next one (sent when this one ends)."""
        return turn.turn + 1 < len(self.sessions[turn.session].turns)

    def leave(self, rid: str, turn: InFlight) -> None:
        """The request is no longer in flight on its worker (it ended, or moves on)."""
        del self.in_flight[rid]
        self._continuing -= self._continues(turn)

    def finish(self, rid: str, turn: InFlight, at: float, error: str | None) -> None:
        self.leave(rid, turn)
        self.router.release(rid)
        if self.pd is not None:
            self.pd.finished(rid, turn.output, at, error is None)
        rec = turn.record
        rec.end = at
        rec.completion_tokens = len(turn.output)
        if turn.cached_told is not None:
            rec.cached_tokens = turn.cached_told
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
