"""Cluster manager: spawns one worker process per GPU (or per CPU worker), tracks their
liveness from heartbeats and exit codes, restarts a worker that died, and stops them all
on shutdown so that no orphan is left behind. With ``spare_workers``, CPU workers
that died are replaced by spares that loaded the model and warmed up ahead of time.

Where a worker runs is the ``launch`` callable's business: ``launch_local`` starts it on
this machine with ``subprocess`` (not ``fork``, so the gateway never imports torch and a
worker never inherits the gateway's event loop); ``ray_launcher.RayLauncher`` has a Ray
actor start it on a node of a Ray cluster. Either returns a ``WorkerProcess``, the part
of ``subprocess.Popen`` that Cluster uses, so liveness, restarts and shutdown are one code
path whatever starts the workers."""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import select
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

from memserve.config import EngineConfig, WorkerConfig
from memserve.ipc.messages import WorkerStats

log = logging.getLogger("memserve.cluster")

# Missed heartbeats after which a worker is reported degraded (and avoided by routing);
# it is declared dead, failed and restarted after the heartbeat timeout.
DEGRADED_AFTER_HEARTBEATS = 2.5
# Seconds between two spare-worker starts.
SPARE_RESPAWN_S = 10.0
WORKER_MODULE = "memserve.workers.worker"


class WorkerProcess(Protocol):
    """A started worker as Cluster sees it: ``subprocess.Popen``'s liveness and stop
    calls, and the node it runs on: ``node`` for people (a host name or IP), ``node_id``
    to tell nodes apart (a Ray node ID: nodes may share an IP)."""

    @property
    def pid(self) -> int | None: ...

    @property
    def node(self) -> str: ...

    @property
    def node_id(self) -> str: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...

    def wait(self, timeout: float | None = None) -> int: ...


# Starts the worker of a config with an environment (the gateway's, adjusted per worker).
Launch = Callable[[WorkerConfig, dict[str, str]], WorkerProcess]


class LocalProcess(subprocess.Popen[bytes]):
    """A worker process on this machine, whose node is this machine's hostname."""

    node = node_id = platform.node() or "local"


def launch_local(config: WorkerConfig, env: dict[str, str]) -> LocalProcess:
    return LocalProcess([sys.executable, "-m", WORKER_MODULE, json.dumps(config.to_dict())], env=env)


@dataclass
class WorkerHandle:
    config: WorkerConfig
    process: WorkerProcess | None = None
    ready: bool = False
    last_heartbeat: float = 0.0
    stats: WorkerStats = field(default_factory=WorkerStats)  # its latest heartbeat's
    num_blocks: int = 0
    max_model_len: int = 0
    transfer_addr: str = ""
    restarts: int = 0

    @property
    def instance_id(self) -> int:
        return self.config.instance_id

    @property
    def alive(self) -> bool:
        return self.ready and self.process is not None and self.process.poll() is None

    @property
    def node(self) -> str:
        """Where the worker runs (empty while its launcher does not know yet)."""
        return self.process.node if self.process is not None else ""

    @property
    def node_id(self) -> str:
        """Which node the worker runs on, as the launcher names nodes apart (empty while
        it does not know yet)."""
        return self.process.node_id if self.process is not None else ""

    def state(self, now: float, heartbeat_timeout_s: float, busy_s: float = 0.0) -> str:
        """``starting``, ``dead``, ``degraded`` (heartbeats late, or one engine step
        running longer than the heartbeat timeout beyond ``busy_s``, the work the gateway
        predicts is queued there) or ``ok``. Without ``busy_s`` a long but sound step (a
        cold prefill of a long document takes seconds on a CPU) would hide the worker from
        routing exactly while it computes a prefix the next requests want."""
        if not self.alive:
            return "starting" if self.process is not None and self.process.poll() is None else "dead"
        late = now - self.last_heartbeat > DEGRADED_AFTER_HEARTBEATS * self.config.heartbeat_s
        stuck = self.stats.loop_age_s > heartbeat_timeout_s + busy_s
        return "degraded" if late or stuck else "ok"


def plan_workers(engine: EngineConfig, gateway_addr: str, cpu_workers: int, gpus: list[int] | None,
                 roles: list[str] | None = None, runtime_dir: str = "",
                 internal_host: str = "127.0.0.1", kv_events_config: dict | None = None) -> list[WorkerConfig]:
    """One WorkerConfig per GPU in ``gpus`` (per ``--tensor-parallel-size`` GPUs in turn:
    ``cuda:0,1`` names a worker's GPUs, one per rank), else ``cpu_workers`` CPU workers;
    their sockets go in ``runtime_dir`` when given, else on TCP at ``internal_host``."""
    ranks = engine.tensor_parallel_size
    if gpus and len(gpus) % ranks:
        raise ValueError(f"--gpus names {len(gpus)} GPUs, not a multiple of --tensor-parallel-size ({ranks})")
    groups = [gpus[i : i + ranks] for i in range(0, len(gpus), ranks)] if gpus else []
    devices = [f"cuda:{','.join(map(str, g))}" for g in groups] if gpus else ["cpu"] * cpu_workers
    roles = roles or ["colocated"] * len(devices)
    if len(roles) != len(devices):
        raise ValueError(f"{len(roles)} roles for {len(devices)} workers")
    return [
        WorkerConfig(instance_id=i, role=role, engine=replace(engine, device=dev), gateway_addr=gateway_addr,
                     runtime_dir=runtime_dir, internal_host=internal_host, kv_events_config=kv_events_config)
        for i, (dev, role) in enumerate(zip(devices, roles))
    ]


class Cluster:
    def __init__(self, configs: list[WorkerConfig], heartbeat_timeout_s: float = 5.0, spare_workers: int = 0,
                 launch: Launch = launch_local) -> None:
        self.workers = {c.instance_id: WorkerHandle(c) for c in configs}
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.launch = launch
        # Spares replace CPU workers only: on a GPU a spare would hold a second copy of
        # the model and its KV pool in the memory the serving worker needs.
        cpu = bool(configs) and all(c.engine.device == "cpu" for c in configs)
        if spare_workers and not cpu:
            log.warning("--spare-workers applies to CPU workers only; starting none")
        self.num_spares = spare_workers if cpu else 0
        self.spares: list[LocalProcess] = []
        self._ready_spares: set[LocalProcess] = set()
        self._spare_spawned_at = -math.inf

    def _env(self, device: str) -> dict[str, str]:
        # A GPU worker sees every GPU the gateway sees and binds to its own (its device,
        # EngineConfig.rank_device): a peer's KV pool opens on the peer's GPU over CUDA IPC.
        env = dict(os.environ)
        processes = sum(w.config.engine.tensor_parallel_size for w in self.workers.values())
        if device == "cpu" and processes > 1 and "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // processes))
        return env

    def spawn(self, instance_id: int) -> None:
        """Start worker ``instance_id``: a spare takes over when one is there, else a new process."""
        handle = self.workers[instance_id]
        device = handle.config.engine.device
        handle.ready = False
        handle.process = self._take_spare(instance_id) if device == "cpu" else None
        if handle.process is not None:
            log.info("spare worker (pid %d) takes over as worker %d", handle.process.pid, instance_id)
            return
        handle.process = self.launch(handle.config, self._env(device))
        log.info("spawned worker %d (pid %s, %s, role %s)", instance_id, handle.process.pid or "not known yet",
                 device, handle.config.role)

    def spare_states(self) -> list[dict]:
        """Each spare's pid and state: ``ready`` (prepared, waiting on its stdin) or ``starting``."""
        for spare in self.spares:
            out = spare.stdout
            assert out is not None  # spares start with stdin and stdout piped
            if (spare not in self._ready_spares and select.select([out], [], [], 0)[0]
                    and out.readline().strip() == b"ready"):
                self._ready_spares.add(spare)
        return [{"pid": spare.pid, "state": "ready" if spare in self._ready_spares else "starting"}
                for spare in self.spares]

    def _take_spare(self, instance_id: int) -> LocalProcess | None:
        self.spare_states()
        self.spares.sort(key=lambda spare: spare not in self._ready_spares)
        while self.spares:
            spare = self.spares.pop(0)
            self._ready_spares.discard(spare)
            stdin = spare.stdin
            assert stdin is not None  # spares start with stdin and stdout piped
            try:
                stdin.write(f"{instance_id}\n".encode())
                stdin.close()
                return spare
            except OSError:  # it died meanwhile
                spare.wait()
        return None

    def refill_spares(self) -> None:
        """Keep ``num_spares`` spare workers preparing or ready, once every worker is ready
        (spares must not slow the first start), and at most one new spare per
        ``SPARE_RESPAWN_S`` (a spare that cannot start must not loop)."""
        alive = []
        for spare in self.spares:
            if spare.poll() is None:
                alive.append(spare)
            else:
                log.warning("spare worker (pid %d) exited with code %s", spare.pid, spare.returncode)
                self._ready_spares.discard(spare)
        self.spares = alive
        now = time.monotonic()
        if (len(self.spares) >= self.num_spares or now - self._spare_spawned_at < SPARE_RESPAWN_S
                or not all(h.ready for h in self.workers.values())):
            return
        template = next(iter(self.workers.values())).config
        spare = LocalProcess([sys.executable, "-m", WORKER_MODULE, "--spare", json.dumps(template.to_dict())],
                             env=self._env("cpu"), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.spares.append(spare)
        self._spare_spawned_at = now
        log.info("started a spare worker (pid %d)", spare.pid)

    def spawn_all(self) -> None:
        for i in self.workers:
            self.spawn(i)

    def mark_ready(self, instance_id: int, num_blocks: int, max_model_len: int, stats: WorkerStats,
                   transfer_addr: str) -> None:
        h = self.workers[instance_id]
        h.ready, h.num_blocks, h.max_model_len, h.stats = True, num_blocks, max_model_len, stats
        h.transfer_addr = transfer_addr
        h.last_heartbeat = time.monotonic()

    def transfer_addrs(self) -> dict[int, str]:
        return {i: h.transfer_addr for i, h in self.workers.items() if h.ready}

    def heartbeat(self, instance_id: int, stats: WorkerStats) -> None:
        h = self.workers[instance_id]
        h.last_heartbeat, h.stats = time.monotonic(), stats

    def find_dead(self) -> list[WorkerHandle]:
        """Workers that exited or went silent since they became ready."""
        now = time.monotonic()
        dead = []
        for h in self.workers.values():
            if h.process is None or not h.ready:
                continue
            if h.process.poll() is not None or now - h.last_heartbeat > self.heartbeat_timeout_s:
                dead.append(h)
        return dead

    def states(self, busy_s: Callable[[int], float] | None = None) -> dict[int, str]:
        """Each worker's ``state``; ``busy_s(instance)``: the work predicted queued there."""
        now = time.monotonic()
        return {i: h.state(now, self.heartbeat_timeout_s, busy_s(i) if busy_s else 0.0)
                for i, h in self.workers.items()}

    def exited_before_ready(self) -> list[WorkerHandle]:
        return [h for h in self.workers.values() if not h.ready and h.process and h.process.poll() is not None]

    def restart(self, handle: WorkerHandle) -> None:
        self._kill(handle, grace_s=0)
        handle.restarts += 1
        self.spawn(handle.instance_id)

    def stop_all(self, grace_s: float = 5.0) -> None:
        """SIGTERM every worker, wait up to ``grace_s``, then SIGKILL what is left."""
        for spare in self.spares:  # end of file on stdin: not needed
            stdin = spare.stdin
            assert stdin is not None  # spares start with stdin and stdout piped
            try:
                stdin.close()
            except OSError:
                pass
        procs = [h.process for h in self.workers.values() if h.process and h.process.poll() is None]
        procs += [spare for spare in self.spares if spare.poll() is None]
        self.spares, self._ready_spares = [], set()
        for p in procs:
            p.terminate()
        deadline = time.monotonic() + grace_s
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for h in self.workers.values():
            h.ready = False

    @staticmethod
    def _kill(handle: WorkerHandle, grace_s: float) -> None:
        p = handle.process
        if p is None or p.poll() is not None:
            return
        p.terminate()
        try:
            p.wait(grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
