"""The gateway's KV link probe (gateway/link_probe.py) through the real engine client,
its workers played by a channel that answers transfer messages on a scripted clock: a
link is fitted exactly from transfers timed as a pull runs them; only a deployment
that spans nodes is probed, then every pair of workers, one way, priced both ways, with
transfers no larger than a quarter of the smaller pool; a failed probe leaves its pair
to the cost model; a worker that died loses its links, and they are measured again
once it is back."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from memserve.costmodel.model import BandwidthCost
from memserve.gateway import link_probe
from memserve.gateway.engine_client import ZmqEngineClient
from memserve.gateway.link_probe import PROBE_BLOCKS, PROBE_REPEATS
from memserve.ipc.messages import ExpectTransfer, TransferExpected, WorkerReady, WorkerStats
from memserve.ipc.probe import ProbeDone, ProbeTransfer

BLOCK_BYTES = 1000
ROUND_TRIP_S = 0.002  # each message to a worker and its answer
BYTES_PER_S = 1e8
NUM_BLOCKS = 256


class ScriptedWorkers:
    """The workers behind the engine client: each transfer message is answered at once,
    the clock moving by a round trip per message plus the probe's bytes over
    ``BYTES_PER_S``; ``failing`` senders answer a probe with an error."""

    def __init__(self, nodes: list[str], num_blocks: int = NUM_BLOCKS) -> None:
        self.now = 0.0
        self.failing: set[int] = set()
        self.probes: list[tuple[int, int, int]] = []  # (source, destination, blocks)
        self.cluster = SimpleNamespace(workers={
            i: SimpleNamespace(instance_id=i, alive=True, node_id=node, num_blocks=num_blocks, process=None,
                               stats=WorkerStats(), config=SimpleNamespace(role="colocated"))
            for i, node in enumerate(nodes)},
            restart=lambda handle: None, mark_ready=lambda *ready: None, transfer_addrs=dict)
        self.client = ZmqEngineClient(SimpleNamespace(send=self._send), self.cluster, 16)

    def clock(self) -> float:
        return self.now

    async def _send(self, instance: int, msg: object, bulk=()) -> None:
        self.now += ROUND_TRIP_S
        if isinstance(msg, ExpectTransfer):
            self.client._dispatch(instance, TransferExpected(msg.transfer_id))
        elif isinstance(msg, ProbeTransfer):
            self.probes.append((instance, msg.dst_instance, msg.num_blocks))
            if instance in self.failing:
                self.client._dispatch(instance, ProbeDone(msg.transfer_id, 0, "no room"))
                return
            self.now += msg.num_blocks * BLOCK_BYTES / BYTES_PER_S
            self.client._dispatch(instance, ProbeDone(msg.transfer_id, msg.num_blocks * BLOCK_BYTES))

    def pairs(self) -> set[tuple[int, int]]:
        return {(src, dst) for src, dst, _ in self.probes}


@pytest.fixture
def workers_on(monkeypatch):
    """``workers_on(nodes)``: scripted workers on those nodes, whose clock the probe reads."""
    def make(nodes: list[str], **kwargs) -> ScriptedWorkers:
        workers = ScriptedWorkers(nodes, **kwargs)
        monkeypatch.setattr(link_probe, "time", SimpleNamespace(perf_counter=workers.clock))
        return workers

    return make


def measured(link: BandwidthCost) -> bool:
    """The scripted link, fitted back: two round trips a transfer (the receiver told to
    expect it, the sender asked to send it) and the bytes at ``BYTES_PER_S``."""
    return link.latency_s == pytest.approx(2 * ROUND_TRIP_S) and link.bytes_per_s == pytest.approx(BYTES_PER_S)


def test_workers_on_one_node_are_not_probed(workers_on) -> None:
    w = workers_on(["a", "a", "a"])
    asyncio.run(w.client.measure_links([0, 1, 2]))
    assert w.probes == [] and w.client.router.links == {}


def test_every_pair_across_nodes_is_measured_once_and_priced_both_ways(workers_on) -> None:
    """A warm-up at the largest size, then each size timed; every link fitted exactly."""
    w = workers_on(["a", "a", "b"])
    asyncio.run(w.client.measure_links([0, 1, 2]))
    assert w.pairs() == {(0, 1), (0, 2), (1, 2)}
    assert [n for src, dst, n in w.probes if (src, dst) == (0, 2)] == \
        [PROBE_BLOCKS[-1]] + [n for n in PROBE_BLOCKS for _ in range(PROBE_REPEATS)]
    links = w.client.router.links
    assert set(links) == {(0, 1), (1, 0), (0, 2), (2, 0), (1, 2), (2, 1)}
    assert all(map(measured, links.values()))


def test_a_probe_takes_at_most_a_quarter_of_the_smaller_pool(workers_on) -> None:
    w = workers_on(["a", "b"], num_blocks=16)
    asyncio.run(w.client.measure_links([0, 1]))
    assert max(n for _, _, n in w.probes) == 4


def test_a_failed_probe_leaves_its_pair_to_the_cost_model(workers_on) -> None:
    w = workers_on(["a", "b", "c"])
    w.failing = {0}
    asyncio.run(w.client.measure_links([0, 1, 2]))
    assert set(w.client.router.links) == {(1, 2), (2, 1)}


def test_a_restarted_worker_loses_its_links_until_they_are_measured_again(workers_on) -> None:
    """Its death forgets them; its WorkerReady (a restart: the client started before)
    has its links measured anew, its pairs only, the restarted worker sending."""
    w = workers_on(["a", "b", "c"])

    async def scenario() -> None:
        client = w.client
        await client.measure_links([0, 1, 2])
        client.max_model_len = 1024  # started
        w.cluster.workers[2].alive = False
        client._fail_worker(w.cluster.workers[2])
        assert set(client.router.links) == {(0, 1), (1, 0)}

        w.probes.clear()
        w.cluster.workers[2].alive = True
        client._dispatch(2, WorkerReady(2, "colocated", NUM_BLOCKS, 16, 1024))
        await asyncio.gather(*client._tasks)
        assert w.pairs() == {(2, 0), (2, 1)}
        assert measured(client.router.links[2, 0])

    asyncio.run(scenario())
