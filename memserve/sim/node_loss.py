"""Hosts lost during a simulation: every instance of the host dies at once, and the
gateway finds out as it does for a worker that goes silent, then moves its requests.

One host is lost every ``every_s`` simulated seconds, the first halfway through the
first period, and then while sessions still start: the live host with the most requests
in flight (the lowest-numbered of equals; never the last live host), so that a loss
costs what it can. A router that fills instances in order of their ids leaves the last
hosts idle at light load, and losing one of them would show nothing. From the loss on,
the host's instances run nothing and send nothing: their step events are dropped, a
request or prefix pull sent to one is lost. Their heartbeats stop, so the gateway sees
them as a silent worker (``gateway/cluster.py``): ``ok`` until
``DEGRADED_AFTER_HEARTBEATS`` heartbeats are missed, then ``degraded`` (routed to only
when no worker is ``ok``), and at the heartbeat timeout ``dead``: the gateway's
``_fail_worker`` then runs, as in ``engine_client.ZmqEngineClient``: each request in
flight there moves to a live worker by ``request_retry`` (sent again when its client has
no token yet, resumed after the tokens it has otherwise; the bench's client streams and
decodes greedily), the instance's mirror is reset and the router forgets its links. A
lost host is not restarted (its node is gone)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from memserve.gateway.cluster import DEGRADED_AFTER_HEARTBEATS
from memserve.gateway.request_retry import Move, RequestProgress
from memserve.gateway.routing.router import Router, RouteRequest
from memserve.ipc.messages import AddRequest
from memserve.sim.instance import InFlight, SimInstance
from memserve.sim.topology import Topology


class LossHost(Protocol):
    """What node loss needs of the simulation that runs it (``Simulation``)."""

    instances: list[SimInstance]
    in_flight: dict[str, InFlight]
    router: Router
    now: float

    def schedule(self, at: float, fn: Callable[[], None]) -> None: ...

    def silence(self, i: int) -> None: ...

    def send(self, add: AddRequest, request: RouteRequest, turn: InFlight) -> None: ...

    def leave(self, rid: str, turn: InFlight) -> None: ...

    def finish(self, rid: str, turn: InFlight, at: float, error: str | None) -> None: ...


@dataclass
class NodeLoss:
    topology: Topology
    every_s: float
    heartbeat_s: float = 1.0  # a worker's heartbeat period (WorkerConfig.heartbeat_s)
    timeout_s: float = 5.0  # the gateway's heartbeat timeout (--heartbeat-timeout)
    lost: list[tuple[float, int]] = field(default_factory=list)  # (when, host)
    moves: Counter[str] = field(default_factory=Counter)  # requests moved, by request_retry.Move
    moved: set[str] = field(default_factory=set)  # the ids of the requests moved

    def start(self, sim: LossHost, until: float) -> None:
        """Schedule the losses before ``until`` (the last session start)."""
        self._sim = sim
        at = self.every_s / 2
        while at <= until:
            sim.schedule(at, self._lose)
            at += self.every_s

    def _lose(self) -> None:
        sim = self._sim
        gone = {host for _, host in self.lost}
        live = [h for h in range(self.topology.num_hosts) if h not in gone]
        if len(live) > 1:
            busy = Counter(self.topology.host(turn.instance) for turn in sim.in_flight.values())
            host = max(live, key=lambda h: (busy[h], -h))
            self.lost.append((sim.now, host))
            instances = self.topology.instances(host)
            for i in instances:
                sim.silence(i)
            sim.schedule(sim.now + DEGRADED_AFTER_HEARTBEATS * self.heartbeat_s,
                         lambda: self._mark(instances, "degraded"))
            sim.schedule(sim.now + self.timeout_s, lambda: self._fail(instances))

    def _mark(self, instances: list[int], state: str) -> None:
        for i in instances:
            self._sim.instances[i].state = state

    def _fail(self, instances: list[int]) -> None:
        """The gateway declares the instances dead: their requests move, their mirrors and
        links are forgotten."""
        sim = self._sim
        self._mark(instances, "dead")
        dead = set(instances)
        for rid, turn in [(rid, turn) for rid, turn in sim.in_flight.items() if turn.instance in dead]:
            self.move(rid, turn)
        for i in instances:
            sim.instances[i].mirror.reset()
            sim.router.forget_links(i)

    def move(self, rid: str, turn: InFlight) -> None:
        """``request_retry``'s move of a request whose worker died, for a streaming client."""
        sim = self._sim
        progress = RequestProgress(rid, turn.add.params, streaming=True, pinned=False)
        progress.tokens[0] = list(turn.output)
        progress.moves = turn.moves
        move = progress.choose()
        if move is Move.FAIL:
            sim.finish(rid, turn, sim.now, f"worker {turn.instance} died")
            return
        add, request = progress.move(move, turn.add, turn.route)
        turn.moves = progress.moves
        if progress.produced and turn.cached_told is None:
            turn.cached_told = turn.record.cached_tokens  # what the client was told stays
        self.moves[move.value] += 1
        self.moved.add(rid)
        sim.leave(rid, turn)
        sim.send(add, request, turn)

    def stats(self) -> dict:
        return {"every_s": self.every_s, "heartbeat_timeout_s": self.timeout_s,
                "lost": [{"at_s": round(at, 3), "host": host, "instances": self.topology.instances(host)}
                         for at, host in self.lost],
                "moves": dict(self.moves), "moved_requests": len(self.moved)}
