"""Where a CPU worker's compute threads run, like vLLM's ``VLLM_CPU_OMP_THREADS_BIND``.

An OpenMP parallel region waits for its slowest thread, so a compute thread that the
gateway (or any other process) preempts stalls every kernel of the step for a time slice;
on a loaded 2-core machine two unpinned threads made a decode step several times slower
than one. A bind list gives each worker its own cores, one compute thread pinned to each
(``GOMP_CPU_AFFINITY``), and the gateway moves off them when cores are left over.

libgomp reads its environment once, when torch loads it, so the worker applies this
before it imports torch. Spec: a CPU list per worker (``"0-1,4"``), workers separated by
``|`` (``"0|1"``: worker 0 on CPU 0, worker 1 on CPU 1); with tensor parallelism, a list
per rank."""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger(__name__)


def parse_cpu_list(spec: str) -> list[int]:
    """``"0-2,5"`` -> [0, 1, 2, 5] (sorted, distinct)."""
    cpus: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        if not part:
            raise ValueError(f"empty entry in CPU list {spec!r}")
        first, _, last = part.partition("-")
        lo, hi = int(first), int(last or first)
        if lo < 0 or hi < lo:
            raise ValueError(f"bad CPU range {part!r} in {spec!r}")
        cpus.update(range(lo, hi + 1))
    return sorted(cpus)


def worker_cpu_lists(spec: str, num_workers: int) -> list[list[int]]:
    """One CPU list per worker (per rank, with tensor parallelism: ``num_workers`` counts
    the ranks) from a ``|``-separated spec, checked against this machine."""
    lists = [parse_cpu_list(part) for part in spec.split("|")]
    if len(lists) != num_workers:
        raise ValueError(f"--cpu-threads-bind {spec!r} names {len(lists)} CPU lists for {num_workers} CPU workers "
                         "(with --tensor-parallel-size, one list per rank)")
    available = os.sched_getaffinity(0)
    for cpus in lists:
        if not set(cpus) <= available:
            raise ValueError(f"--cpu-threads-bind {spec!r}: CPUs {sorted(set(cpus) - available)} are not available")
    return lists


def bound_cpus(spec: str | None, instance_id: int | None) -> list[int] | None:
    """Worker ``instance_id``'s CPUs; a spare (``None``), which may replace any worker,
    gets all of them. ``None`` when nothing is bound."""
    if not spec:
        return None
    lists = [parse_cpu_list(part) for part in spec.split("|")]
    if instance_id is None:
        return sorted({cpu for cpus in lists for cpu in cpus})
    return lists[instance_id % len(lists)]


def rank_cpus(spec: str | None, instance: int | None, rank: int, ranks: int) -> list[int] | None:
    """The CPUs of tensor-parallel ``rank`` of worker ``instance``: with ``ranks`` per worker
    the bind list names one CPU list per rank, each worker's ranks in turn (``"0|1"`` with
    two ranks: rank 0 on CPU 0, rank 1 on CPU 1); a spare's ranks share all of them."""
    return bound_cpus(spec, None if instance is None else instance * ranks + rank)


def rank_threads(threads: int | None, cpus: list[int] | None, ranks: int) -> int | None:
    """A rank's compute threads: as asked, else one per bound CPU, else as the environment
    says (the gateway shares the cores among every worker's ranks), else (unbound, several
    ranks) an equal share of this process's CPUs, so that the ranks' OpenMP threads do not
    outnumber the cores and wait on each other's time slices at every barrier."""
    if threads or cpus or ranks == 1 or "OMP_NUM_THREADS" in os.environ:
        return threads
    return max(1, len(os.sched_getaffinity(0)) // ranks)


def gateway_cpus(worker_lists: list[list[int]]) -> set[int]:
    """The CPUs no worker computes on (empty when the workers take them all)."""
    return os.sched_getaffinity(0) - {cpu for cpus in worker_lists for cpu in cpus}


def pin_compute_threads(cpus: list[int] | None, threads: int | None) -> None:
    """Set the worker's compute threads before torch loads: ``threads`` (default: one per
    bound CPU) OpenMP threads, thread i pinned to the i-th CPU of ``cpus``; the process's
    other threads stay on those CPUs too. ``None`` for both leaves torch's defaults."""
    count = threads or (len(cpus) if cpus else None)
    if cpus:
        os.environ["GOMP_CPU_AFFINITY"] = ",".join(map(str, cpus))
        os.sched_setaffinity(0, cpus)
    if count:
        os.environ["OMP_NUM_THREADS"] = str(count)
    if "torch" in sys.modules:  # too late for libgomp's environment: threads unpinned, count still set
        log.warning("torch was loaded before the compute threads were configured; they are not pinned")
        if count:
            sys.modules["torch"].set_num_threads(count)
