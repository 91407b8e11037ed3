"""The MemPool's transfer API (MemServe Table 1: ``transfer``, ``transfer_with_insert``)
and the byte access transfers need. A mixin of ``MemPool``; the bytes travel through an
attached ``TransferEndpoint`` (``ipc/kv_transfer.py``), never through the MemPool."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from memserve.kvcache.blocks import MemPoolError, contiguous_runs
from memserve.kvcache.mover import Buffer, TransferEndpoint, recut
from memserve.kvcache.pool_state import PoolState


class TransferAPI(PoolState):
    def attach_transfer(self, endpoint: TransferEndpoint) -> None:
        """Called by the endpoint that carries this instance's transfers."""
        if self._transfer is not None and self._transfer is not endpoint:
            raise MemPoolError("a transfer endpoint is already attached")
        self._transfer = endpoint

    def transfer(
        self, instance: int, src: Sequence[int], dst: Sequence[int] | None = None, flags: int = 0,
        private: Any = None, ticket: str = "",
    ) -> list[int]:
        """Copy the held blocks ``src`` to ``instance`` and return their addresses there.
        Without ``dst`` the receiver allocates them (device, or host with ``KVFlags.HOST``);
        ``private`` (msgpack-able) reaches the receiving engine with the addresses. The
        receiver accepts only a transfer it expects under ``ticket``."""
        return self._endpoint().send(instance, list(src), dst, flags, private, ticket)

    def transfer_with_insert(
        self,
        instance: int,
        tokens: Sequence[int],
        src: Sequence[int],
        dst: Sequence[int] | None = None,
        flags: int = 0,
        private: Any = None,
        first_block: int = 0,
        ticket: str = "",
    ) -> list[int]:
        """``transfer`` plus an ``insert(tokens, ...)`` at the receiver, saving a round
        trip. ``src`` holds blocks ``first_block..`` of ``tokens``; the receiver must have
        the blocks before ``first_block`` cached (incremental transfer)."""
        return self._endpoint().send(instance, list(src), dst, flags, private, ticket, list(tokens), first_block)

    def check_held(self, addrs: Sequence[int], op: str) -> None:
        """Raise unless every address is a local block someone holds."""
        self._held(addrs, op)

    def read_blocks(self, addrs: Sequence[int]) -> list[Buffer]:
        """The bytes of held blocks, in order, as the mover's per-run buffers."""
        mover = self._need_mover("read_blocks")
        buffers: list[Buffer] = []
        for tier, blocks in self._runs_by_tier(addrs, "read_blocks"):
            buffers.extend(mover.read_blocks(tier, blocks))
        return buffers

    def write_blocks(self, addrs: Sequence[int], buffers: Sequence[Buffer]) -> None:
        """Store blocks given back to back across ``buffers`` (the sender's runs) into
        held blocks ``addrs``, re-cut into this pool's runs for the mover."""
        mover = self._need_mover("write_blocks")
        groups = self._runs_by_tier(addrs, "write_blocks")
        sizes = [n * mover.block_nbytes for _, blocks in groups for _, n in contiguous_runs(blocks)]
        pieces = iter(recut(buffers, sizes))
        for tier, blocks in groups:
            mover.write_blocks(tier, blocks, [next(pieces) for _ in contiguous_runs(blocks)])

    def _endpoint(self) -> TransferEndpoint:
        if self._transfer is None:
            raise MemPoolError("no transfer endpoint attached to this MemPool")
        return self._transfer
