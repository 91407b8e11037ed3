"""The Ray actor that runs one memserve worker process on its node (``memserve up --ray``).

The actor only starts the worker and watches it: the worker is the same
``python -m memserve.workers.worker CONFIG`` process that runs without Ray, started with
the Python of the actor's node, so the worker code knows nothing of Ray. Its TCP sockets
listen on the node's IP as Ray reports it (``internal_host``), where the gateway and the
other workers can reach them.

No worker outlives its actor: the actor is the worker's parent, the worker asks Linux to
end it when its parent dies (``workers/worker.py``), and Ray ends an actor's children
with it. So a killed actor, a node that leaves or a gateway that dies (Ray ends the
actors of a driver that is gone) leaves no worker behind. The methods are coroutines:
Ray runs an async actor's methods on one event-loop thread that lives as long as the
actor, and the parent-death signal follows the thread that started the child.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from dataclasses import replace

import ray

from memserve.config import WorkerConfig

# What ``watch`` answers when ``start`` could not start the worker (as a shell's 127).
NOT_STARTED = 127


class WorkerActor:
    """One worker process on this node: started by ``start``, awaited by ``watch``."""

    def __init__(self) -> None:
        self._process: subprocess.Popen[bytes] | None = None
        self._started = asyncio.Event()

    async def start(self, args: list[str], config: dict, env: dict[str, str]) -> tuple[int, str, str]:
        """Run ``python ARGS CONFIG_JSON`` here, with ``env`` over this node's environment
        (the CurveZMQ keys come this way, never through a file) and ``config``'s sockets
        on this node's IP. Returns the worker's pid, the node's IP and its Ray node ID."""
        node_ip = ray.util.get_node_ip_address()
        worker = replace(WorkerConfig.from_dict(config), internal_host=node_ip)
        try:
            self._process = subprocess.Popen([sys.executable, *args, json.dumps(worker.to_dict())],
                                             env={**os.environ, **env})
        finally:
            self._started.set()
        return self._process.pid, node_ip, ray.get_runtime_context().get_node_id()

    async def watch(self) -> int:
        """The worker's exit code, once it has exited."""
        await self._started.wait()
        if self._process is None:
            return NOT_STARTED
        return await asyncio.to_thread(self._process.wait)

    async def send_signal(self, sig: int) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(sig)
