"""Where the background threads' KV copies run: on CUDA, a stream of their own, so that a
save or a load never queues behind the compute's kernels nor holds them up; on CPU, in
place, as they always did.

Ordering, on CUDA (the compute runs on the default stream):

- A copy starts after the compute enqueued before it (``after_compute``): the blocks it
  reads may have been written, and those it writes may still be read, by a step in flight
  (a step that samples nothing returns before its kernels finish).
- The compute waits for a load's layer through the event recorded after that layer's
  copy (``LayerwisePreloader.before_layer`` waits on it: on the device, not on the host),
  and a load is reported finished only once its copies are complete.
- A save is complete when ``copy_blocks`` returns: its source block is freed next.
- Memory the copy allocates (index tensors, staging) is allocated on its stream, so the
  caching allocator reuses it only there, after the copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Callable

import torch

from memserve.kvcache.address import Tier
from memserve.kvcache.mover import BlockMover, Buffer


class CopyStream:
    """Runs copies on a CUDA stream of their own (on CPU: in place)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def run(self, copy: Callable[[], None], after_compute: bool = True) -> torch.cuda.Event | None:
        """Enqueue ``copy``'s work on the stream (after the compute enqueued so far when
        ``after_compute``); returns the event that marks its end. On CPU: copies, None."""
        if self.stream is None:
            copy()
            return None
        if after_compute:
            self.stream.wait_stream(torch.cuda.default_stream(self.device))
        with torch.cuda.stream(self.stream):
            copy()
        return self.stream.record_event()

    def run_sync(self, copy: Callable[[], None]) -> None:
        """``run``, returning once the copy is complete."""
        done = self.run(copy)
        if done is not None:
            done.synchronize()


class StreamMover:
    """A ``BlockMover`` whose ``copy_blocks`` run on a ``CopyStream``, each complete on
    return (the saver's mover: saves overlap the compute on the device too)."""

    def __init__(self, inner: BlockMover, copies: CopyStream) -> None:
        self.inner = inner
        self.copies = copies
        self.block_nbytes = inner.block_nbytes

    def copy_blocks(self, src_tier: Tier, src_blocks: list[int], dst_tier: Tier, dst_blocks: list[int]) -> None:
        self.copies.run_sync(lambda: self.inner.copy_blocks(src_tier, src_blocks, dst_tier, dst_blocks))

    def read_blocks(self, tier: Tier, blocks: list[int]) -> list[Buffer]:
        return self.inner.read_blocks(tier, blocks)

    def write_blocks(self, tier: Tier, blocks: list[int], buffers: Sequence[Buffer]) -> None:
        self.inner.write_blocks(tier, blocks, buffers)
