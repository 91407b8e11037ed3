"""The gateway's ZeroMQ channel names a worker whose socket is not connected: one that
never connected, and one that was there and went away (its process died)."""

from __future__ import annotations

import asyncio
import time

import pytest

from memserve.ipc.channel import GatewayChannel, WorkerChannel, WorkerUnreachable
from memserve.ipc.messages import Heartbeat


def test_a_message_for_a_worker_without_a_socket_raises_worker_unreachable() -> None:
    async def main() -> None:
        channel = GatewayChannel()
        worker = WorkerChannel(channel.address, 3)
        try:
            with pytest.raises(WorkerUnreachable, match="worker 4 is not connected"):
                await channel.send(4, Heartbeat(-1, 0.0))
            worker.send(Heartbeat(3, 0.0))  # the gateway learns the worker's identity
            assert (await asyncio.wait_for(channel.recv(), 5))[0] == 3
            await channel.send(3, Heartbeat(-1, 1.0))
            assert [msg for msg, _ in worker.poll(5000)] == [Heartbeat(-1, 1.0)]
            worker.close()
            deadline = time.monotonic() + 5
            with pytest.raises(WorkerUnreachable, match="worker 3 is not connected"):
                while time.monotonic() < deadline:  # until the gateway sees the disconnection
                    await channel.send(3, Heartbeat(-1, 2.0))
                    await asyncio.sleep(0.01)
        finally:
            channel.close()

    asyncio.run(main())
