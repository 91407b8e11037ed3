"""The worker's heartbeat, sent from its own thread.

The engine loop polls the gateway only between steps, and a long prefill step on a CPU
takes seconds, so heartbeats sent from that loop would make a busy worker look dead. This
thread sends them on time from a socket of its own (ZeroMQ sockets are not shared across
threads) while the model runs, since torch releases the GIL in its kernels. A frozen
process (SIGSTOP, a deadlock in native code) stops this thread too, which is exactly what
the gateway must notice. Each heartbeat carries the latest stats snapshot the loop
published and how long ago the loop last went round, so a stuck step shows up as well."""

from __future__ import annotations

import dataclasses
import threading
import time

import zmq

from memserve.ipc.channel import heartbeat_identity
from memserve.ipc.curve import protect
from memserve.ipc.messages import Heartbeat, WorkerStats, encode


class HeartbeatThread(threading.Thread):
    def __init__(self, address: str, instance_id: int, interval_s: float) -> None:
        super().__init__(name=f"heartbeat-{instance_id}", daemon=True)
        self._instance_id = instance_id
        self._interval_s = interval_s
        self._stop_event = threading.Event()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, heartbeat_identity(instance_id))
        self._sock.setsockopt(zmq.LINGER, 0)
        protect(self._sock, address, server=False)
        self._sock.connect(address)
        self._stats = WorkerStats()
        self._loop_at = time.monotonic()

    def tick(self) -> None:
        """Called by the engine loop once per round."""
        self._loop_at = time.monotonic()

    def publish(self, stats: WorkerStats) -> None:
        """The stats the next heartbeats carry (replacing a reference is atomic)."""
        self._stats = stats

    def run(self) -> None:
        while not self._stop_event.wait(self._interval_s):
            now = time.monotonic()
            stats = dataclasses.replace(self._stats, loop_age_s=now - self._loop_at)
            self._sock.send(encode(Heartbeat(self._instance_id, now, stats)))

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=2 * self._interval_s)
        self._sock.close(0)
        self._ctx.term()
