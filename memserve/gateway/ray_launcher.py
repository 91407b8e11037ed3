"""Workers placed and supervised by Ray (``memserve up --ray``), as vLLM places its
workers across nodes.

Only where a worker runs changes, not how it serves: each worker is the usual
``python -m memserve.workers.worker`` process, started on its node by a Ray actor
(``ray_actor.py``) and talking to the gateway and its peers over ZeroMQ on TCP with
CurveZMQ, its endpoints announced in its ``WorkerReady`` as without Ray.

- Placement: one placement group with a bundle per worker, ``{"GPU": ranks}`` or
  ``{"CPU": threads x ranks}`` (``--tensor-parallel-size``), spread over the nodes or packed onto few; worker i's actor
  always goes in bundle i, so a restarted worker gets its bundle back (Ray places again
  the bundles of a node that left).
- Supervision: ``RayLauncher`` is the Cluster's ``launch`` callable and
  ``RayWorkerProcess`` answers what Cluster asks of a ``subprocess.Popen``, so liveness,
  restarts and shutdown stay Cluster's one code path. A worker whose actor died or whose
  node left polls as exited: Cluster's dead-worker path then fails its requests over and
  starts a new actor. ``poll`` never blocks the gateway's event loop, and ``kill``
  blocks it for at most twice ``KILL_TIMEOUT_S``, even when the node is gone.
- Secrets: the CurveZMQ keys travel in the arguments of the actor's ``start`` call (to
  the node's raylet and the actor, never through a file); only the variables in
  ``FORWARDED_ENV`` go, the rest of a worker's environment is its node's.

This module imports ray, so only ``memserve up --ray`` imports it.
"""

from __future__ import annotations

import logging
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import replace

import ray
from ray.exceptions import GetTimeoutError, RayError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from memserve.config import EngineConfig, WorkerConfig
from memserve.gateway.engine_client import WorkerStartError
from memserve.gateway.ray_actor import WorkerActor
from memserve.ipc.curve import ENV_VAR as CURVE_ENV_VAR

log = logging.getLogger("memserve.cluster")

# --ray-placement -> Ray's placement-group strategy (both best effort: a single node
# serves all workers when it must).
PLACEMENT_STRATEGIES = {"spread": "SPREAD", "pack": "PACK"}
# What a node's worker is started with: `python WORKER_ARGS CONFIG_JSON`.
WORKER_ARGS = ("-m", "memserve.workers.worker")
# The gateway's variables a worker gets; the rest of its environment is its node's.
FORWARDED_ENV = (CURVE_ENV_VAR, "MEMSERVE_LOG_LEVEL", "MEMSERVE_CACHE")
# How long start-up waits for Ray to reserve every worker's bundle.
PLACEMENT_TIMEOUT_S = 120.0
# How long a kill waits for the actor to confirm; an unreachable node's worker counts as
# killed after it (the node's raylet ends the actor, and so the worker, when it leaves).
KILL_TIMEOUT_S = 2.0

_RemoteWorkerActor = ray.remote(WorkerActor)


def connect(address: str) -> str:
    """Join the Ray cluster at ``address`` (``""``: ray.init's own choice: $RAY_ADDRESS,
    else the cluster last started on this machine, else a new local one; ``auto``: this
    machine's cluster; ``HOST:PORT`` or ``ray://HOST:PORT``). Returns the IP Ray knows
    this (the gateway's) node by."""
    try:
        ray.init(address=address or None)
    except ConnectionError as exc:
        raise WorkerStartError(f"cannot join the Ray cluster at {address or 'its default address'}: {exc}") from None
    return ray.util.get_node_ip_address()


def actor_config(config: WorkerConfig) -> WorkerConfig:
    """The worker's config as its actor runs it: Ray shows an actor only the GPUs it was
    given, from cuda:0, so a GPU worker's ranks are cuda:0, cuda:1, ... there."""
    if not config.engine.device.startswith("cuda"):
        return config
    ranks = ",".join(map(str, range(config.engine.tensor_parallel_size)))
    return replace(config, engine=replace(config.engine, device=f"cuda:{ranks}"))


def bundle(engine: EngineConfig) -> dict[str, float]:
    """A worker's share of its node: a GPU, or ``--cpu-threads`` CPUs (one by default), for
    each of its tensor-parallel ranks. One bundle never spans nodes, so a worker's ranks
    share a node (what a STRICT_PACK group of one bundle per rank would ask)."""
    ranks = engine.tensor_parallel_size
    return {"GPU": ranks} if engine.device.startswith("cuda") else {"CPU": (engine.cpu_threads or 1) * ranks}


def _ready(ref: ray.ObjectRef) -> bool:
    return bool(ray.wait([ref], timeout=0)[0])


class RayWorkerProcess:
    """A worker that a Ray actor started on its node, seen as Cluster sees a Popen."""

    def __init__(self, actor: ray.actor.ActorHandle, started: ray.ObjectRef) -> None:
        self._actor = actor
        self._started = started
        self._exited = actor.watch.remote()
        self._pid: int | None = None
        self._node = ""
        self._node_id = ""
        self.returncode: int | None = None

    @property
    def pid(self) -> int | None:
        """The worker's pid on its node; None until the actor has started it."""
        self._learn_start()
        return self._pid

    @property
    def node(self) -> str:
        """The IP of the worker's node; empty until the actor has started it."""
        self._learn_start()
        return self._node

    @property
    def node_id(self) -> str:
        """The Ray node ID of the worker's node (several nodes may share an IP); empty
        until the actor has started it."""
        self._learn_start()
        return self._node_id

    def _learn_start(self) -> None:
        if self._pid is None and _ready(self._started):
            try:
                self._pid, self._node, self._node_id = ray.get(self._started)
            except RayError:  # the actor is gone: ``poll`` says so
                pass

    def poll(self) -> int | None:
        if self.returncode is None and _ready(self._exited):
            self._settle()
        return self.returncode

    def terminate(self) -> None:
        if self.poll() is None:
            self._actor.send_signal.remote(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL the worker through its actor, then end the actor; a worker whose node
        does not answer within ``KILL_TIMEOUT_S`` counts as killed."""
        if self.poll() is not None:
            return
        try:
            ray.get(self._actor.send_signal.remote(signal.SIGKILL), timeout=KILL_TIMEOUT_S)
            ray.wait([self._exited], timeout=KILL_TIMEOUT_S)
        except RayError:
            pass
        if _ready(self._exited):
            self._settle()
        else:
            ray.kill(self._actor)
            self.returncode = -signal.SIGKILL

    def wait(self, timeout: float | None = None) -> int:
        if self.poll() is None:
            if not ray.wait([self._exited], timeout=timeout)[0]:
                raise subprocess.TimeoutExpired("memserve worker in a Ray actor", timeout or 0.0)
            self._settle()
        assert self.returncode is not None  # _settle sets it
        return self.returncode

    def _settle(self) -> None:
        """Take the worker's exit code and end its actor, which frees its bundle for the
        next one; an actor that died (killed, or its node left) counts as SIGKILL."""
        try:
            self.returncode = ray.get(self._exited)
        except RayError as exc:
            log.warning("the Ray actor of worker pid %s on %s is gone: %s", self._pid, self._node or "?",
                        str(exc).splitlines()[0])
            self.returncode = -signal.SIGKILL
        ray.kill(self._actor)


class RayLauncher:
    """Cluster's ``launch`` over Ray: reserves a bundle per worker at construction (or
    raises ``WorkerStartError``), then starts each worker in its bundle's actor."""

    def __init__(self, configs: Sequence[WorkerConfig], placement: str = "spread",
                 worker_args: Sequence[str] = WORKER_ARGS, timeout_s: float = PLACEMENT_TIMEOUT_S) -> None:
        self.bundles = [bundle(c.engine) for c in configs]
        self.worker_args = list(worker_args)
        self.group = placement_group(self.bundles, strategy=PLACEMENT_STRATEGIES[placement])
        try:
            ray.get(self.group.ready(), timeout=timeout_s)
        except GetTimeoutError:
            remove_placement_group(self.group)
            raise WorkerStartError(
                f"Ray could not place {len(self.bundles)} worker(s) {self.bundles} in {timeout_s:.0f} s; "
                f"the cluster has {ray.available_resources()} available") from None
        log.info("Ray placed %d worker bundle(s) %s (%s)", len(self.bundles), self.bundles, placement)

    def __call__(self, config: WorkerConfig, env: dict[str, str]) -> RayWorkerProcess:
        """Start worker ``config.instance_id`` in a new actor in its bundle."""
        i = config.instance_id
        actor = _RemoteWorkerActor.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=i),
            num_cpus=self.bundles[i].get("CPU", 0), num_gpus=self.bundles[i].get("GPU", 0),
        ).remote()
        forwarded = {k: env[k] for k in FORWARDED_ENV if k in env}
        return RayWorkerProcess(actor, actor.start.remote(self.worker_args, actor_config(config).to_dict(), forwarded))

    def close(self) -> None:
        """Leave the cluster: Ray removes the placement group of a driver that left (and
        stops a local instance that ``connect`` started)."""
        ray.shutdown()
