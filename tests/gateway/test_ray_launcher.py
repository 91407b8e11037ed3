"""The Ray launcher on real Ray, with a worker-like process in place of the model worker.

On a local instance (``ray.init(num_cpus=2)``, some 8 s): an actor in the worker's
bundle starts it on its node, the gateway learns its pid, node and node ID, the CurveZMQ
keys reach it through the actor call (and nothing else of the gateway's environment
does), its sockets are set to listen on the node's IP; a worker whose actor is killed,
or that is terminated or killed through the launcher, polls as exited, a new actor takes
its bundle, and no process is left behind, Ray's own included. On a cluster of several Ray nodes on this machine
(``ray.cluster_utils.Cluster``; slow: two nodes' processes, 12-15 s): spread placement
puts the workers on different nodes, a worker whose node leaves polls as exited, and its
new actor starts on the node that Ray places its bundle on next. Each test shuts its Ray
down, so no Ray process outlives it. Skipped where Ray is not installed."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest
from helpers.ray_processes import assert_gone, ray_processes

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'memserve[ray]')")

from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group_table

from memserve.config import EngineConfig
from memserve.gateway.cluster import plan_workers
from memserve.gateway.ray_launcher import RayLauncher, actor_config, bundle
from memserve.ipc.curve import ENV_VAR, CurveKeys


@pytest.fixture
def ray_node():
    """A fresh local Ray instance of 2 CPUs (never someone's running cluster); after the
    tests, Ray is shut down and none of its processes is left."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    started = ray_processes()
    assert started, "ray.init started no raylet/gcs_server under this process"
    yield ray.util.get_node_ip_address()
    ray.shutdown()
    assert_gone(started)


def _until(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value is not None and value is not False:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_tensor_parallel_workers_bundle_holds_every_rank_on_one_node() -> None:
    """One bundle per worker, never split across nodes: a GPU per rank, or its CPUs per rank."""
    assert bundle(EngineConfig(device="cuda:0,1", tensor_parallel_size=2)) == {"GPU": 2}
    assert bundle(EngineConfig(cpu_threads=2, tensor_parallel_size=3)) == {"CPU": 6}
    assert bundle(EngineConfig()) == {"CPU": 1}


def test_an_actor_numbers_its_gpus_from_zero() -> None:
    """Ray shows an actor only its own GPUs: a worker planned on the box's GPUs 4 and 5
    runs its ranks on cuda:0 and cuda:1 there; a CPU worker is left as it is."""
    gpu, cpu = plan_workers(EngineConfig(tensor_parallel_size=2), "tcp://x", 0, [4, 5])[0], \
        plan_workers(EngineConfig(), "tcp://x", 1, None)[0]
    assert gpu.engine.device == "cuda:4,5"
    assert actor_config(gpu).engine.device == "cuda:0,1"
    assert actor_config(cpu) == cpu


def test_an_actor_starts_watches_and_ends_a_worker(ray_node: str, tmp_path: Path) -> None:
    report = tmp_path / "worker-{id}.json"
    # Writes what it was started with (whole, by a rename), then waits like a worker.
    script = ("import json, os, sys, time; cfg = json.loads(sys.argv[1]); "
              f"path = {str(report)!r}.format(id=cfg['instance_id']); "
              "open(path + '.tmp', 'w').write(json.dumps("
              "[cfg, os.environ.get('MEMSERVE_CURVE_KEYS'), os.environ.get('NOT_FORWARDED'), os.getppid()])); "
              "os.rename(path + '.tmp', path); time.sleep(600)")
    configs = plan_workers(EngineConfig(), "tcp://127.0.0.1:5555", cpu_workers=2, gpus=None)
    keys = CurveKeys.generate().to_env()
    env = {**os.environ, ENV_VAR: keys, "NOT_FORWARDED": "gateway-only"}
    launcher = RayLauncher(configs, "spread", worker_args=["-c", script])
    assert launcher.bundles == [{"CPU": 1}, {"CPU": 1}]
    started: list[int] = []
    try:
        worker = launcher(configs[0], env)
        pid = _until(lambda: worker.pid, 60, "the actor to start worker 0")
        started.append(pid)
        assert worker.node == ray_node and worker.poll() is None
        assert worker.node_id == ray.get_runtime_context().get_node_id()
        path = Path(str(report).format(id=0))
        config, seen_keys, not_forwarded, actor_pid = _until(
            lambda: path.exists() and json.loads(path.read_text()), 30, "worker 0's report")
        assert seen_keys == keys and not_forwarded is None
        assert config["internal_host"] == ray_node and config["gateway_addr"] == "tcp://127.0.0.1:5555"

        os.kill(actor_pid, signal.SIGKILL)  # the actor dies: the worker counts as exited, and goes
        assert _until(worker.poll, 30, "worker 0 to poll as exited") == -signal.SIGKILL
        _until(lambda: _gone(pid), 30, "worker 0's process to end with its actor")

        restarted = launcher(configs[0], env)  # a new actor takes the dead one's bundle
        started.append(_until(lambda: restarted.pid, 60, "a new actor to start worker 0 again"))
        assert restarted.pid != pid and restarted.poll() is None

        other = launcher(configs[1], env)
        started.append(_until(lambda: other.pid, 60, "the actor to start worker 1"))
        other.terminate()
        assert other.wait(30) == -signal.SIGTERM
        restarted.kill()
        assert restarted.poll() == -signal.SIGKILL
        for pid in started:
            _until(lambda pid=pid: _gone(pid), 30, f"worker pid {pid} to end")
    finally:
        launcher.close()  # gives the bundles back and leaves Ray
    for pid in started:
        assert _gone(pid)


@pytest.mark.slow
def test_a_worker_whose_node_leaves_is_exited_and_starts_on_another(tmp_path: Path) -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    pids: list[int] = []
    try:
        leaving = cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, log_to_driver=False)
        configs = plan_workers(EngineConfig(), "tcp://127.0.0.1:5555", cpu_workers=2, gpus=None)
        launcher = RayLauncher(configs, "spread", worker_args=["-c", "import time; time.sleep(600)"])
        nodes = placement_group_table(launcher.group)["bundles_to_node_id"]
        assert len(set(nodes.values())) == 2  # spread: a node each
        workers = [launcher(config, {}) for config in configs]
        pids += [_until(lambda w=w: w.pid, 60, "the actors to start the workers") for w in workers]
        lost = next(i for i, node in nodes.items() if node == leaving.node_id)

        cluster.remove_node(leaving)
        assert _until(workers[lost].poll, 60, "the worker of the node that left to poll as exited") \
            == -signal.SIGKILL
        assert workers[1 - lost].poll() is None
        _until(lambda: _gone(pids[lost]), 30, "the worker of the node that left to end")

        joining = cluster.add_node(num_cpus=1)
        restarted = launcher(configs[lost], {})
        pids.append(_until(lambda: restarted.pid, 60, "the worker to start on the node that joined"))
        assert placement_group_table(launcher.group)["bundles_to_node_id"][lost] == joining.node_id
        assert restarted.poll() is None
        started = ray_processes()
        launcher.close()
    finally:
        ray.shutdown()
        cluster.shutdown()
    for pid in pids:
        _until(lambda pid=pid: _gone(pid), 30, f"worker pid {pid} to end")
    assert_gone(started)
