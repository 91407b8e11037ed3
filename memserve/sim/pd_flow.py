"""Disaggregated prefill/decode in the simulator: the gateway's request flow
(``gateway/pd_flow.py``) on the virtual clock, each request in the same ``Handoff`` states
(``gateway/routing/pd_handoff.py``), driving the real prefill and decode sides
(``HandoffSender``, ``KVReceiver``) over simulated links (``sim/transfer.py``).

1. The router picks a prefill instance P (decode instances never take a new prompt). P
   runs the request as a handoff: the prefill and the first token, its KV parked.
2. When P's step ends, a decode instance D is picked by the gateway's rule
   (``pick_decode``: in pd-caching-2/3 the longest cached prefix of the prompt, else the
   least loaded), told to expect the KV (pinning its cached prefix in pd-caching-2/3)
   and P sends the blocks D lacks, inserted into D's index where D caches
   (``transfer_with_insert``).
3. When the link has carried them, D resumes the request with the first token as output
   and the KV as its computed prompt, and decodes the rest.
4. pd-caching-3: when D finishes, the conversation's KV goes back to P, only the blocks
   P lacks, so the next turn's prefill at P reuses the answer too.

A handoff that fails (D has no room) resumes the request on another decode instance
without its KV, which recomputes it, as the gateway does. Gateway-to-worker messages
take no simulated time; the transfers do."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from memserve.costmodel.model import CostModel
from memserve.gateway.routing.decode_choice import pick_decode
from memserve.gateway.routing.pd_handoff import Handoff, Phase
from memserve.gateway.routing.pd_topology import role_caches
from memserve.gateway.routing.route_types import WorkerView
from memserve.ipc.messages import (
    AddRequest,
    ExpectTransfer,
    HandoffDone,
    HandoffStart,
    RequestOutput,
)
from memserve.kvcache.mempool import KVFlags
from memserve.sim.instance import InFlight, SimInstance
from memserve.sim.topology import Topology
from memserve.sim.transfer import SimNetwork
from memserve.workers.engine.pd_receiver import KVReceiver
from memserve.workers.engine.pd_sender import HandoffSender


class SimHost(Protocol):
    """What the disaggregated flow needs of the simulation that runs it (``Simulation``)."""

    cost: CostModel
    topology: Topology
    instances: list[SimInstance]
    in_flight: dict[str, InFlight]
    now: float

    def clock(self) -> float: ...

    def schedule(self, at: float, fn: Callable[[], None]) -> None: ...

    def publish(self, i: int) -> None: ...

    def views(self) -> list[WorkerView]: ...

    def wake(self, i: int, at: float) -> None: ...

    def finish(self, rid: str, turn: InFlight, at: float, error: str | None) -> None: ...


@dataclass
class _SimRequest:
    """A disaggregated request in the simulator: the gateway's ``Handoff`` state and the
    decode instance named for it."""

    state: Handoff
    decode: int | None = None


class SimPDFlow:
    def __init__(self, sim: SimHost, pd_mode: str) -> None:
        self.sim = sim
        self.pd_mode = pd_mode
        self.decode_caches = role_caches("decode", pd_mode)
        self.block_size = sim.instances[0].engine.cfg.block_size
        self.network = SimNetwork(sim.topology, sim.clock, sim.schedule, self._arrived)
        self.senders: list[HandoffSender] = []
        self.receivers: list[KVReceiver] = []
        for inst in sim.instances:
            endpoint = self.network.endpoint(inst.engine.mempool)
            self.senders.append(HandoffSender(inst.engine, endpoint, sim.clock))
            self.receivers.append(KVReceiver(inst.engine, endpoint, clock=sim.clock))
        self._handoffs: dict[str, _SimRequest] = {}
        self._ids = itertools.count()
        self.counts: Counter[str] = Counter()

    def admit(self, add: AddRequest, instance: int) -> RequestOutput | None:
        """Queue a request on the prefill instance it was routed to: as a handoff when it
        decodes past its first token (the gateway's ``PDFlow.applies``), else wholly there."""
        engine = self.sim.instances[instance].engine
        if add.params.max_tokens <= 1 or len(add.prompt_token_ids) + 1 >= engine.max_model_len:
            return engine.add_request(add, self.sim.now)
        self._handoffs[add.request_id] = _SimRequest(Handoff(add, instance))
        return self.senders[instance].add(dataclasses.replace(add, handoff=True))

    def filter(self, instance: int, outputs: list[RequestOutput], done_at: float) -> list[RequestOutput]:
        """A step's outputs as the client sees them: a prefill's first token goes on
        unfinished (its handoff starts when the step ends); decode outputs carry the
        cached tokens the prefill found."""
        for out in self.senders[instance].filter(outputs):
            h = self._handoffs.get(out.request_id)
            if h is not None and h.state.output(out):
                self.sim.schedule(done_at, functools.partial(self._start, out.request_id))
        return outputs

    def _start(self, rid: str) -> None:
        """Name the decode instance, let it pin what it caches, and start P's send."""
        h = self._handoffs[rid]
        prompt = h.state.add.prompt_token_ids
        h.decode = self._pick_decode(prompt)
        self.sim.in_flight[rid].instance = h.decode
        ticket = f"handoff-{next(self._ids)}"
        num_blocks = math.ceil(len(prompt) / self.block_size)
        # At least the last block is sent: it holds the prompt's tail (a partial block).
        pin = prompt[: (num_blocks - 1) * self.block_size] if self.decode_caches else None
        reply = self.receivers[h.decode].expect(ExpectTransfer(0, ticket, h.state.prefill, num_blocks, pin, rid))
        done = self.senders[h.state.prefill].start(HandoffStart(rid, h.decode, ticket, reply.cached_blocks,
                                                          self.decode_caches))
        if done is not None:
            self._handoff_done(done)

    def _pick_decode(self, prompt: list[int], exclude: int | None = None) -> int:
        """The gateway's ``pick_decode`` over the simulated instances."""
        return pick_decode(self.sim.views(), exclude, prompt if self.decode_caches else None)

    def _arrived(self, src: int, dst: int) -> None:
        """A transfer src -> dst ended: D takes what arrived, P reports its sends."""
        self.receivers[dst].on_received(self.network.endpoints[dst].drain_received())
        self.sim.publish(dst)
        for done in self.senders[src].poll():
            self._handoff_done(done)

    def _handoff_done(self, done: HandoffDone) -> None:
        """Resume the request on D with its KV, or (the handoff failed) on another decode
        instance without it."""
        h = self._handoffs[done.request_id]
        assert h.decode is not None
        decode, ticket = h.decode, done.ticket
        if done.error is not None:
            self.counts["handoff_failed"] += 1
            self.receivers[decode].abort(done.request_id)  # frees what D pinned for it
            decode, ticket = self._pick_decode(h.state.add.prompt_token_ids, exclude=decode), ""
            h.decode = decode
            self.sim.in_flight[done.request_id].instance = decode
        h.state.resume()  # once at most here: a simulated decode instance does not die
        resume = dataclasses.replace(h.state.add, handoff=False, output_token_ids=list(h.state.tokens),
                                     kv_ticket=ticket)
        refused = self.receivers[decode].resume(resume)
        if refused is not None:
            rid = done.request_id
            self.sim.finish(rid, self.sim.in_flight[rid], self.sim.now, refused.error or "refused")
            return
        self.sim.wake(decode, self.sim.now)

    def finished(self, rid: str, output: list[int], at: float, ok: bool) -> None:
        """The request ended; pd-caching-3 returns a whole answer's KV to its prefill
        instance once D's last step is over."""
        h = self._handoffs.pop(rid, None)
        if h is None or not ok or h.state.phase is not Phase.DECODE or self.pd_mode != "pd-caching-3":
            return
        tokens = h.state.add.prompt_token_ids + output
        decode, prefill = h.decode, h.state.prefill
        assert decode is not None
        self.sim.schedule(at, lambda: self._return_kv(decode, prefill, tokens))

    def _return_kv(self, decode: int, prefill: int, tokens: list[int]) -> None:
        """D pushes its cached prefix of ``tokens`` to P, incrementally: P pins what it
        holds and only the rest moves (the gateway's ``transfer_prefix(incremental=True)``
        and the worker's prefix push)."""
        name = ticket = f"return-{next(self._ids)}"
        expected = self.receivers[prefill].expect(ExpectTransfer(0, ticket, decode, len(tokens) // self.block_size,
                                                                 tokens, name))
        pool = self.sim.instances[decode].engine.mempool
        addrs = pool.match(tokens, take_ref=True)
        skip = min(expected.cached_blocks, len(addrs))
        if skip:
            pool.free_mem(addrs[:skip])  # P holds these already
            addrs = addrs[skip:]
        if not addrs:
            self.receivers[prefill].abort(name)
            return
        sent = self.network.endpoints[decode].send_async(prefill, addrs, None, KVFlags.RELEASE, None, ticket,
                                                         tokens[: (skip + len(addrs)) * self.block_size], skip)

        def done(future) -> None:
            pool.free_mem(addrs)
            self.receivers[prefill].abort(name)  # frees P's pins if nothing arrived
            if future.exception() is None:
                self.counts["returned_blocks"] += len(addrs)
            else:
                self.counts["return_failed"] += 1

        sent.add_done_callback(done)

    def stats(self) -> dict:
        """Handoffs and returns, summed over the instances (what moved over the links)."""
        sent: Counter[str] = Counter()
        for s in self.senders:
            sent.update({k: v for k, v in s.counts.items() if k != "transfer_s"})
        mover = self.sim.instances[0].engine.mempool.mover
        assert mover is not None  # a simulated pool has a NullMover
        block_nbytes = mover.block_nbytes
        link = self.network.stats
        return {"mode": self.pd_mode, **sent, **self.counts,
                "returned_bytes": self.counts["returned_blocks"] * block_nbytes,
                "link": {"transfers": link.transfers, "blocks": link.blocks, "bytes": link.bytes,
                         "seconds": round(link.seconds, 6)}}
