"""Which host each simulated instance runs on, and the KV link between two instances.

A cluster spans hosts of ``instances_per_host`` instances each (instance i on host
``i // instances_per_host``). Two instances of one host move KV over the same-host link,
the cost model's ``transfer`` (``memserve profile`` times it between two processes of one
machine; a preset prices its NVLink); instances of two hosts over the cross-host link, a
network figure the cost model does not hold. Prefix pulls (``Simulation._pull``) and
disaggregated handoffs (``sim/transfer.py``) are priced by the link between their two
ends, and the router is given the same figures by pair (``Router.use_links``), as the
gateway gives it the links its probe measured (``gateway/link_probe.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from memserve.costmodel.model import BandwidthCost

# A 200 Gb/s NIC a host, and a one-way message over it: an assumption, not a measurement.
CROSS_HOST_BYTES_S = 25e9
CROSS_HOST_LATENCY_S = 50e-6


@dataclass(frozen=True)
class Topology:
    """``num_instances`` instances on hosts of ``instances_per_host``."""

    num_instances: int
    instances_per_host: int
    same_host: BandwidthCost
    cross_host: BandwidthCost

    def __post_init__(self) -> None:
        if self.instances_per_host < 1:
            raise ValueError("a host runs at least one instance")

    @property
    def num_hosts(self) -> int:
        return -(-self.num_instances // self.instances_per_host)

    def host(self, instance: int) -> int:
        return instance // self.instances_per_host

    def instances(self, host: int) -> list[int]:
        """The instances that run on ``host``."""
        first = host * self.instances_per_host
        return list(range(first, min(first + self.instances_per_host, self.num_instances)))

    def link(self, src: int, dst: int) -> BandwidthCost:
        return self.same_host if self.host(src) == self.host(dst) else self.cross_host

    def transfer_s(self, src: int, dst: int, nbytes: float) -> float:
        """Seconds to move ``nbytes`` of KV from instance ``src`` to ``dst``."""
        return self.link(src, dst)(nbytes) if nbytes > 0 else 0.0

    def links(self) -> dict[tuple[int, int], BandwidthCost]:
        """Every ordered pair's link, as the router takes measured ones; none on one host
        (the router then prices every pull by the cost model's ``transfer``, the same figure)."""
        if self.num_hosts == 1:
            return {}
        n = self.num_instances
        return {(src, dst): self.link(src, dst) for src in range(n) for dst in range(n) if src != dst}
