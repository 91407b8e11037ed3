"""A receiving worker's KV transfer endpoint served on a thread of its own, as in a
worker's loop, while a test drives the sender from its main thread."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from memserve.ipc.kv_transfer import KVTransferEndpoint


@contextmanager
def served(endpoint: KVTransferEndpoint, timeout_ms: int = 2) -> Iterator[None]:
    """Serve ``endpoint`` on a thread until the block exits (then the thread is joined)."""
    serving = threading.Event()
    serving.set()

    def serve() -> None:
        while serving.is_set():
            endpoint.serve(timeout_ms=timeout_ms)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield
    finally:
        serving.clear()
        thread.join(10)
