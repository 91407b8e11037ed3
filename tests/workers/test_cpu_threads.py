"""--cpu-threads-bind: CPU lists per worker, and a worker's compute threads pinned to them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from memserve.workers.cpu_threads import (
    bound_cpus,
    gateway_cpus,
    parse_cpu_list,
    rank_cpus,
    rank_threads,
    worker_cpu_lists,
)


def test_parse_cpu_list():
    assert parse_cpu_list("0-2,5") == [0, 1, 2, 5]
    assert parse_cpu_list("3,1,1") == [1, 3]
    for bad in ("", "2-1", "a", "1,,2", "-1"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)


def test_each_worker_gets_its_list_and_a_spare_all_of_them():
    assert bound_cpus("0|1", 0) == [0]
    assert bound_cpus("0|1", 1) == [1]
    assert bound_cpus("0|1", None) == [0, 1]
    assert bound_cpus(None, 0) is None


def test_tensor_parallel_ranks_take_a_list_each(monkeypatch):
    assert rank_cpus("0|1|2|3", 1, 0, 2) == [2] and rank_cpus("0|1|2|3", 1, 1, 2) == [3]
    assert rank_cpus("0|1", None, 1, 2) == [0, 1]  # a spare's ranks share every CPU
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert rank_threads(None, None, 2) == max(1, len(os.sched_getaffinity(0)) // 2)
    assert rank_threads(3, None, 2) == 3 and rank_threads(None, [0], 2) is None and rank_threads(None, None, 1) is None
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the gateway shared the cores out already
    assert rank_threads(None, None, 2) is None


def test_lists_must_match_workers_and_machine():
    cpus = sorted(os.sched_getaffinity(0))
    assert worker_cpu_lists(str(cpus[0]), 1) == [[cpus[0]]]
    with pytest.raises(ValueError, match="2 CPU workers"):
        worker_cpu_lists(str(cpus[0]), 2)
    with pytest.raises(ValueError, match="not available"):
        worker_cpu_lists("4096", 1)
    assert gateway_cpus([cpus]) == set()
    if len(cpus) > 1:
        assert gateway_cpus([[cpus[-1]]]) == set(cpus[:-1])


def test_worker_threads_are_pinned_before_torch_loads():
    cpu = max(os.sched_getaffinity(0))
    code = ("import os; from memserve.workers.cpu_threads import pin_compute_threads; "
            f"pin_compute_threads([{cpu}], None); import torch; "
            "torch.ones(1 << 16).exp().sum(); print(torch.get_num_threads(), sorted(os.sched_getaffinity(0)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split(maxsplit=1)
    assert out == ["1", f"[{cpu}]\n"]
