"""By-layer KV transfer (MemServe §4.3): the prefill step of a request bound for a decode
instance sends each layer's KV as soon as the layer is computed, so the transfer
overlaps the layers still to compute instead of starting once the step is over.

``HandoffSender`` arms a request with its open ``LayerStream`` (the decode instance was
named before the prefill, so the receiver allocates meanwhile). The runner asks
``hooks_for(plan)`` for each step's layer hooks; in the step that completes an armed
request's prompt (its chunk samples the first token), ``after_layer(i)`` copies layer i
of the blocks the receiver lacks and hands the copy to the endpoint's sender thread,
which sends it while layer i+1 computes. A copy, not a view of the pool: the blocks may
be freed and reused before the send ends, and the copy of one layer is small next to
computing it; reading layer i while layer i+1 writes would be safe (disjoint memory),
freeing the blocks under a send would not. Except in place (a same-host receiver that
maps this worker's pool): the receiver reads layer i out of the blocks themselves, which
the sender then holds until the transfer ends (``pd_sender.py``).

Only that final step sends, the earlier chunks of a chunked prompt included (their KV is
complete by then): one message per layer whatever the chunking, each block written once
per layer at the receiver. Sending each chunk's layers during its own step would overlap
more of a long prompt's transfer, for a message per layer per step."""

from __future__ import annotations

from collections.abc import Callable

from memserve.ipc.kv_transfer import LayerStream
from memserve.workers.engine.step_plan import StepPlan

# Copies layer i of some device blocks out of the pool: the KV connector's worker side.
ReadLayer = Callable[[list[int], int], memoryview]


class _StepSends:
    """The layer hooks of one step: send each layer of every stream's blocks."""

    def __init__(self, read_layer: ReadLayer, sends: list[tuple[LayerStream, list[int]]]) -> None:
        self.read_layer = read_layer
        self.sends = sends

    def before_layer(self, layer: int) -> None:
        pass

    def after_layer(self, layer: int) -> None:
        for stream, blocks in self.sends:
            if stream.in_place:
                stream.send_blocks(layer, blocks)
            else:
                stream.send(layer, self.read_layer(blocks, layer))


class LayerSender:
    def __init__(self, read_layer: ReadLayer) -> None:
        self.read_layer = read_layer
        self._armed: dict[str, tuple[LayerStream, int]] = {}  # request -> (stream, first block to send)

    def arm(self, request_id: str, stream: LayerStream, first_block: int) -> None:
        self._armed[request_id] = (stream, first_block)

    def disarm(self, request_id: str) -> None:
        self._armed.pop(request_id, None)

    def hooks_for(self, plan: StepPlan) -> _StepSends | None:
        """Hooks for the armed requests whose prompt this step completes (each is sent
        once: a step re-run after a failure does not send again); the blocks they copy
        out layer by layer join ``plan.layer_reads``."""
        sends = []
        for chunk in plan.chunks:
            if chunk.sample and chunk.request_id in self._armed:
                stream, first_block = self._armed.pop(chunk.request_id)
                blocks = chunk.block_ids[first_block : first_block + stream.num_blocks]
                sends.append((stream, blocks))
                if not stream.in_place:
                    plan.layer_reads.append(blocks)
        return _StepSends(self.read_layer, sends) if sends else None
