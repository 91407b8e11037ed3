"""Copies on a stream of their own (workers/copy_stream.py) and the preloader's side of
them: on CPU a copy runs in place and there is nothing to wait for; where a layer's copy
is asynchronous (CUDA; faked here), ``before_layer(i)`` makes the compute wait for layer
i's copy alone, and a load is reported finished only after its last copy completed.
tests/cuda runs the real streams."""

from __future__ import annotations

import time

import torch

from memserve.kvcache.address import Tier
from memserve.workers.copy_stream import CopyStream, StreamMover
from memserve.workers.engine.step_plan import KVLoad, ScheduledChunk, StepPlan
from memserve.workers.layer_preload import LayerwisePreloader

LAYERS = 4


def test_on_cpu_a_copy_runs_in_place():
    copies = CopyStream(torch.device("cpu"))
    ran = []
    assert copies.run(lambda: ran.append(1)) is None and ran == [1]
    copies.run_sync(lambda: ran.append(2))
    assert ran == [1, 2]


class RecordingMover:
    block_nbytes = 64

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def copy_blocks(self, src_tier, src_blocks, dst_tier, dst_blocks) -> None:
        self.calls.append(("copy", src_tier, src_blocks, dst_tier, dst_blocks))

    def read_blocks(self, tier, blocks):
        self.calls.append(("read", tier, blocks))
        return []

    def write_blocks(self, tier, blocks, buffers) -> None:
        self.calls.append(("write", tier, blocks))


def test_stream_mover_passes_every_call_through():
    inner = RecordingMover()
    mover = StreamMover(inner, CopyStream(torch.device("cpu")))
    assert mover.block_nbytes == 64
    mover.copy_blocks(Tier.DEVICE, [1], Tier.HOST, [2])
    mover.read_blocks(Tier.HOST, [2])
    mover.write_blocks(Tier.HOST, [3], [])
    assert inner.calls == [("copy", Tier.DEVICE, [1], Tier.HOST, [2]), ("read", Tier.HOST, [2]),
                           ("write", Tier.HOST, [3])]


class FakeEvent:
    """A CUDA event's stand-in: records whether the compute waited on it, and when it was
    synchronised."""

    def __init__(self, layer: int, log: list[tuple[str, int]]) -> None:
        self.layer, self.log = layer, log

    def wait(self) -> None:
        self.log.append(("wait", self.layer))

    def synchronize(self) -> None:
        self.log.append(("synchronize", self.layer))


def test_the_compute_waits_for_each_layers_event_and_finished_means_synchronised():
    log: list[tuple[str, int]] = []
    pre = LayerwisePreloader(LAYERS, lambda tier, src, dst, layer: FakeEvent(layer, log),
                             lambda tier, src, dst: None, lambda slots: False, ahead=LAYERS)
    pre.start(KVLoad("r", [(int(Tier.HOST), [5, 6], [0, 1])], num_new_tokens=3))
    hooks = pre.hooks_for(StepPlan(chunks=[ScheduledChunk("r", [1, 2, 3], 32, [0, 1, 2], True)]))
    assert hooks is pre
    for layer in range(LAYERS):
        hooks.before_layer(layer)
        assert log.count(("wait", layer)) == 1  # this layer's event, waited on by the compute
        assert all(("wait", later) not in log for later in range(layer + 1, LAYERS))  # not the rest's
        hooks.after_layer(layer)
    deadline = time.monotonic() + 5
    while (done := pre.finished()) == ([], {}):
        assert time.monotonic() < deadline, "the load never finished"
        time.sleep(0.002)
    assert done == (["r"], {})
    assert ("synchronize", LAYERS - 1) in log  # the last copy completed before the load was reported
