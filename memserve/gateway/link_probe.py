"""The KV links between the workers of a deployment that spans nodes, measured by the
gateway so that the router prices a prefix pull (MemServe eq. 2) between two workers by
their own link. The cost model's transfer() comes from ``memserve profile``, which times
transfers between two processes of one machine (``workers/transfer_probe.py``); between
hosts the network sets the pace, and pricing a cross-host pull at the speed of one
machine makes eq. 2 pull where recomputing is faster.

A pair's transfers are timed as a pull runs them: the gateway tells the receiver to
expect the transfer (``ExpectTransfer``), asks the sender to send that many blocks of
its KV pool (``ProbeTransfer``: whatever they hold; the receiver frees them) and stops
the clock at the sender's answer, so the figure holds the two round trips to the gateway
that a pull pays too. Each of ``PROBE_BLOCKS`` is timed ``PROBE_REPEATS`` times after one
unmeasured transfer (it connects the sockets and faults the pages in), and the medians
are fitted to ``latency + bytes / bandwidth`` as the profile fits transfer(). A pair is
measured one way and priced the same both ways; a pair whose transfer fails is left to
the cost model's figure."""

from __future__ import annotations

import asyncio
import logging
import secrets
import statistics
import time
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

from memserve.costmodel.fit import BandwidthSample, fit_bandwidth
from memserve.costmodel.model import BandwidthCost
from memserve.ipc.messages import ExpectTransfer
from memserve.ipc.probe import ProbeTransfer

log = logging.getLogger("memserve.gateway")

# KV blocks per timed transfer, as the full profile's transfer sizes: the largest moves tens
# of MB of a small model's KV, so that the link's bandwidth, not its latency, sets its time.
PROBE_BLOCKS = (1, 4, 16, 64)
PROBE_REPEATS = 3
PROBE_TIMEOUT_S = 10.0  # per message, as a prefix pull waits
# The largest share of the smaller of a pair's KV pools that one probe transfer takes.
MAX_POOL_SHARE = 0.25


class LinkProbeError(RuntimeError):
    """A probe transfer failed at the sender or the receiver."""


class ProbeClient(Protocol):
    """What the probe needs of the engine client (``engine_client.ZmqEngineClient``):
    fresh transfer ids, and a transfer message answered by its worker."""

    @property
    def transfer_ids(self) -> Iterator[int]: ...

    async def ask(self, worker: int, msg: ExpectTransfer | ProbeTransfer, timeout_s: float) -> Any: ...


async def time_transfer(client: ProbeClient, src: int, dst: int, num_blocks: int) -> BandwidthSample:
    """One probe transfer of ``num_blocks`` blocks from worker ``src`` to ``dst``: its
    bytes and seconds."""
    transfer_id = next(client.transfer_ids)
    ticket = secrets.token_hex(16)
    start = time.perf_counter()
    await client.ask(dst, ExpectTransfer(transfer_id, ticket, src, num_blocks), PROBE_TIMEOUT_S)
    done = await client.ask(src, ProbeTransfer(transfer_id, dst, num_blocks, ticket), PROBE_TIMEOUT_S)
    seconds = time.perf_counter() - start
    if done.error:
        raise LinkProbeError(done.error)
    return BandwidthSample(done.num_bytes, seconds)


async def measure_link(client: ProbeClient, src: int, dst: int, pool_blocks: int) -> BandwidthCost:
    """The link from worker ``src`` to ``dst``, whose smaller KV pool has ``pool_blocks``."""
    largest = max(int(pool_blocks * MAX_POOL_SHARE), 1)
    sizes = [n for n in PROBE_BLOCKS if n <= largest] or [largest]
    await time_transfer(client, src, dst, sizes[-1])
    samples = []
    for n in sizes:
        runs = [await time_transfer(client, src, dst, n) for _ in range(PROBE_REPEATS)]
        samples.append(BandwidthSample(runs[0].nbytes, statistics.median(r.seconds for r in runs)))
    return fit_bandwidth(samples)


async def measure_links(client: ProbeClient,
                        pairs: Iterable[tuple[int, int, int]]) -> dict[tuple[int, int], BandwidthCost]:
    """Each link of ``pairs`` (source, destination, the smaller pool's blocks), one pair
    after the other so that they do not share the network, by (source, destination) both
    ways; the pairs whose probe failed are left out."""
    links: dict[tuple[int, int], BandwidthCost] = {}
    for src, dst, pool_blocks in pairs:
        try:
            link = await measure_link(client, src, dst, pool_blocks)
        except (LinkProbeError, asyncio.TimeoutError) as exc:
            log.warning("KV link %d <-> %d not measured (%s); pulls over it are priced by the cost model",
                        src, dst, str(exc) or type(exc).__name__)
            continue
        log.info("KV link %d <-> %d: %.3g GB/s, %.3g ms a transfer", src, dst, link.bytes_per_s / 1e9,
                 link.latency_s * 1e3)
        links[src, dst] = links[dst, src] = link
    return links
