"""`memserve up --ray ADDRESS` on a Ray cluster of several nodes on this machine
(``ray.cluster_utils.Cluster``, every process on 127.0.0.1): a head that runs no worker
(no CPU), and worker nodes of one CPU each, each with a custom resource that names it,
so that two CPU workers must land on two nodes and /health shows which.

- Two colocated workers are placed on two nodes; the gateway measures the KV link
  between them at start-up; greedy output equals the local-process deployment's; under
  prompt-tree routing a conversation's second turn goes to the worker holding its first.
- A prefill and a decode worker on two nodes hand the KV over and answer with the
  tokens of a server without disaggregation.
- A node is removed (``cluster.remove_node``) while 16 requests are in flight: each one
  completes as in a run without the loss, the node's worker is replaced on the spare node
  within 10 s (a new worker process runs for it; serving again takes its model load and
  warm-up more), and its links are measured again.

Slow: the cluster starts in some 10 s, each server in 30-60 s on 2 cores; at most one
server runs at a time (the nodes have a CPU each). The cluster is shut down at the end
and none of its processes is left."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
from helpers.in_flight import assert_as_without_the_fault, idle_and_whole, run
from helpers.live_server import all_ok, wait_until, workers
from helpers.paths import REPO
from helpers.ray_processes import assert_gone, ray_processes
from helpers.routed_chat import chat, messages, second_turn_after_a_busy_start

from memserve.bench.server_process import serving

pytest.importorskip("ray", reason="Ray is not installed (pip install 'memserve[ray]')")

from ray.cluster_utils import Cluster

pytestmark = pytest.mark.slow

LOOPBACK = "127.0.0.1"
NUM_BLOCKS = 256
REPLACED_WITHIN_S = 10.0
LINK_MEASURED = "KV link 0 <-> 1:"  # the gateway's log line for the link it measured


@dataclass
class RayNodes:
    """The test's Ray cluster, and the name of each worker node by its node ID."""

    cluster: Cluster
    names: dict[str, str]

    def add(self, name: str) -> None:
        node = self.cluster.add_node(num_cpus=1, resources={name: 1}, node_ip_address=LOOPBACK)
        self.names[node.node_id] = name

    def remove(self, node_id: str) -> None:
        node = next(n for n in self.cluster.worker_nodes if n.node_id == node_id)
        self.cluster.remove_node(node)
        del self.names[node_id]

    def flags(self, *flags: str) -> list[str]:
        return ["--ray", self.cluster.address, "--num-blocks", str(NUM_BLOCKS), *flags]


@pytest.fixture(scope="module")
def ray_nodes():
    """The head and two worker nodes. The gateways are told to keep Ray on 127.0.0.1,
    which Ray on Linux otherwise replaces with the host's IP."""
    with pytest.MonkeyPatch.context() as env:
        env.delenv("RAY_ADDRESS", raising=False)
        env.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "node_ip_address": LOOPBACK,
                                                                "include_dashboard": False})
        try:
            nodes = RayNodes(cluster, {})
            nodes.add("node_a")
            nodes.add("node_b")
            yield nodes
        finally:
            started = ray_processes()
            cluster.shutdown()
    assert_gone(started)


def placement(server, ray_nodes: RayNodes) -> dict[int, str]:
    """Each worker's node, by the name of its custom resource."""
    return {i: ray_nodes.names[w["node_id"]] for i, w in workers(server).items()}


@pytest.fixture(scope="class")
def server(ray_nodes, tmp_path_factory):
    """Two colocated workers under prompt-tree routing, stopped when the class ends: the
    tests after it need the nodes' CPUs."""
    with serving(ray_nodes.flags("--cpu-workers", "2", "--router", "prompt-tree"),
                 tmp_path_factory.mktemp("ray-two-nodes") / "memserve.log", cwd=REPO) as handle:
        yield handle


class TestTwoColocatedWorkers:
    """Two colocated workers, one on each node."""

    def test_they_are_placed_on_two_nodes_and_their_link_measured(self, server, ray_nodes):
        assert len(set(placement(server, ray_nodes).values())) == 2
        assert LINK_MEASURED in server.log_path.read_text()

    def test_greedy_output_is_the_local_deployments(self, server, memserve_server):
        # No prefix in common with the next test's conversation, which must start uncached.
        conversation = [{"role": "user", "content": "Name three colours of the rainbow."}]
        assert chat(server, conversation)[0] == chat(memserve_server, conversation)[0]

    def test_the_second_turn_goes_to_the_worker_holding_the_first(self, server):
        turn = asyncio.run(second_turn_after_a_busy_start(server))
        assert (turn.first_on, turn.second_on) == (1, 1)  # worker 0 was busy; then least-load would take it
        assert turn.cache_hits == 1 and turn.cached_tokens > 0


def test_a_prefill_decode_pair_on_two_nodes_hands_the_kv_over(ray_nodes, memserve_server, tmp_path):
    with serving(ray_nodes.flags("--instances", "prefill,decode"), tmp_path / "memserve.log", cwd=REPO) as server:
        roles = {w["role"]: i for i, w in workers(server).items()}
        where = placement(server, ray_nodes)
        assert where[roles["prefill"]] != where[roles["decode"]]
        conversation = messages([], 0)
        assert chat(server, conversation)[0] == chat(memserve_server, conversation)[0]
        wait_until(lambda: workers(server)[roles["prefill"]]["pd"].get("blocks_sent", 0) > 0, 10,
                   "the prefill worker's report of the KV it handed over")


def replaced_after(server, old_pid: int, since: float) -> float:
    """Seconds from ``since`` until worker 0 runs as a new process (restarted, its pid
    known), as /health shows it."""
    wait_until(lambda: (w := workers(server)[0])["restarts"] == 1 and w["pid"] not in (None, old_pid), 60,
               "worker 0's replacement")
    return time.monotonic() - since


def test_a_lost_node_costs_the_clients_nothing_and_its_worker_is_replaced(ray_nodes, tmp_path):
    ray_nodes.add("node_c")  # the spare: two of the three nodes get a worker
    with serving(ray_nodes.flags("--cpu-workers", "2", "--router", "least-load"), tmp_path / "memserve.log",
                 cwd=REPO) as server:
        reference = asyncio.run(run(server.base_url, None))
        wait_until(lambda: all(map(idle_and_whole, workers(server).values())), 30, "the reference run to settle")
        before = workers(server)
        spare = (set(ray_nodes.names) - {w["node_id"] for w in before.values()}).pop()
        with ThreadPoolExecutor(1) as watch:
            replaced = []

            def lose_worker_0s_node() -> None:
                replaced.append(watch.submit(replaced_after, server, before[0]["pid"], time.monotonic()))
                ray_nodes.remove(before[0]["node_id"])

            got = asyncio.run(run(server.base_url, lose_worker_0s_node))
            replaced_s = replaced[0].result()
        assert_as_without_the_fault(got, reference)
        assert replaced_s <= REPLACED_WITHIN_S
        wait_until(lambda: all_ok(server), 180, "worker 0 to serve again")
        assert workers(server)[0]["node_id"] == spare
        log = server.log_path.read_text()
        assert "worker 0 died" in log
        wait_until(lambda: server.log_path.read_text().count(LINK_MEASURED) == 2, 30, "worker 0's link measured again")
