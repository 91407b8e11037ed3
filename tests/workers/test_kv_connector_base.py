"""The KV connector is an abstract base: the engine and its senders see only its
interface, so another store or transport is a subclass. Today's implementation keeps the
KV in the MemPool; a class that leaves part of the interface out cannot be built."""

from __future__ import annotations

import pytest

from memserve.kvcache.address import Tier
from memserve.kvcache.blocks import MemPoolError
from memserve.kvcache.mempool import MemPool
from memserve.workers.engine.kv_connector import KVConnector, MemPoolKVConnector


class Worker:  # the worker side's one attribute these tests reach
    num_layers = 3


def test_a_connector_missing_part_of_the_interface_cannot_be_built():
    class Partial(KVConnector):
        def adopt(self, request_id, addrs, num_tokens):
            pass

    with pytest.raises(TypeError, match="abstract"):
        Partial()  # type: ignore[abstract]


def test_the_mempool_connector_allocates_holds_and_frees_through_the_pool():
    pool = MemPool(0, {Tier.DEVICE: 4}, block_size=2)
    connector: KVConnector = MemPoolKVConnector(pool, Worker())
    held = connector.alloc(3)
    assert len(held) == 3 and connector.num_layers == 3 and connector.block_size == 2
    with pytest.raises(MemPoolError):
        connector.alloc(2)  # one block left
    connector.free(held)
    assert len(connector.alloc(4)) == 4
