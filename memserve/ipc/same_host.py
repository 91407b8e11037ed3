"""Same-host KV transfers: how a transfer endpoint tells that a peer shares its machine,
and what it needs of the KV pools it maps (implemented over the worker's tensors by
``workers/kv_share.py``).

Two workers share a host when they report the same host identity (hostname and boot id)
and each sees the other's process under the pid and start time it reported (one pid
namespace). A sender then describes its pools to the receiver once per connection; the
receiver maps them, and a transfer's blocks are copied by the receiver straight out of
the sender's pool instead of travelling as frames (``kv_transfer.py`` says when).

Invariants:
- One monotonic clock ticks for every process of a host (the boot id pins the boot), so a
  deadline one process sets means the same instant to the other.
- A ``ProcessRef`` names one process for its whole life: a pid reused by another process
  has another start time.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from functools import cache
from typing import Any, Protocol

BOOT_ID = "/proc/sys/kernel/random/boot_id"
# ``--kv-same-host-transport``: shm maps the pools of same-host peers; zmq sends frames to every peer.
KV_SAME_HOST_TRANSPORTS = ("shm", "zmq")


@cache
def host_identity() -> str:
    """This machine's name and boot: equal for two processes only on one running host."""
    try:
        with open(BOOT_ID) as f:
            boot = f.read().strip()
    except OSError:
        boot = ""  # no boot id: a host identity nobody can match (see ``same_host``)
    return f"{socket.gethostname()}/{boot}"


def same_host(identity: str) -> bool:
    """Whether ``identity`` (a peer's ``host_identity``) is this host's."""
    return not identity.endswith("/") and identity == host_identity()


@dataclass(frozen=True)
class ProcessRef:
    """One process: its pid and its start time (clock ticks after boot, /proc's field 22)."""

    pid: int
    started: int

    @classmethod
    def of(cls, pid: int) -> ProcessRef:
        """The process that runs as ``pid`` now; raises OSError when none does."""
        return cls(pid, _stat(pid)[1])

    @classmethod
    def current(cls) -> ProcessRef:
        return cls.of(os.getpid())

    def alive(self) -> bool:
        """Whether the process runs (a zombie does not), seen from this pid namespace."""
        try:
            state, started = _stat(self.pid)
        except (OSError, ValueError, IndexError):
            return False
        return started == self.started and state not in "ZX"


def _stat(pid: int) -> tuple[str, int]:
    """(state, start time) of ``pid`` from /proc; the command name may hold spaces and ')'."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return fields[0], int(fields[19])


class MappedPeer(Protocol):
    """A peer's KV pools mapped into this process."""

    tiers: frozenset[int]  # the peer's tiers mapped here: only their blocks can be read

    def copy_in(self, src: list[int], dst: list[int], layer: int | None = None) -> None:
        """Copy the peer's blocks ``src`` (its addresses) into this worker's held blocks
        ``dst`` (every layer, or only ``layer``'s K and V); complete on return."""
        ...

    def close(self) -> None:
        """Unmap the peer's pools."""
        ...


class SharedPools(Protocol):
    """This worker's KV pools, as peers on the host map them."""

    def describe(self) -> dict[str, Any]:
        """How a peer maps these pools (msgpack-able); raises where none can be."""
        ...

    def open(self, description: dict[str, Any]) -> MappedPeer:
        """Map a peer's pools from its ``describe()``; raises where they cannot be mapped
        or their blocks are laid out otherwise than here."""
        ...

    def publish(self) -> None:
        """Make what this thread's compute wrote so far readable by peers (on CUDA: wait
        for its stream), before a peer is told to read it."""
        ...
