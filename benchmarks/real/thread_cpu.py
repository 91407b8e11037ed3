"""CPU time of each thread of a running process over a window, by Python thread name:
where a serving worker's cores go under load (the step's OpenMP threads, the main
thread, the tiers' saver and loader threads) without a sampling profiler's cost.

Reads every thread's user + system time from ``/proc/PID/task/*/stat`` each ``--every``
seconds (threads that start in the window count from zero, threads that end keep their
last reading) and names them by ``py-spy dump --json --nonblocking`` (its ``os_thread_id``
and ``thread_name``) when py-spy is installed; threads no Python frame runs on (torch's
OpenMP pool) are "native", the thread whose id is the process's "MainThread". Prints each
name's CPU seconds and share of the window.

    python benchmarks/real/thread_cpu.py --match "memserve.workers" --seconds 300
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import time
from collections import defaultdict
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


def find_pid(match: str) -> int:
    """The oldest process whose command line holds ``match`` (not this one)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            started = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[19])
        except OSError:
            continue
        if match in cmdline:
            found.append((started, int(entry.name)))
    if not found:
        raise SystemExit(f"no process matches {match!r}")
    return min(found)[1]


def thread_seconds(pid: int) -> dict[int, float]:
    """Each thread's user + system CPU seconds so far."""
    times = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended between the listing and the read
        times[int(task.name)] = (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime
    return times


def python_thread_names(pid: int) -> dict[int, str]:
    """OS thread id -> Python thread name, from py-spy (empty without it)."""
    if shutil.which("py-spy") is None:
        return {}
    result = subprocess.run(["py-spy", "dump", "--pid", str(pid), "--json", "--nonblocking"],
                            capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        return {}
    return {t["os_thread_id"]: t["thread_name"] for t in json.loads(result.stdout)
            if t.get("os_thread_id") and t.get("thread_name")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--pid", type=int)
    target.add_argument("--match", help="a string of the process's command line")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--every", type=float, default=5.0)
    args = parser.parse_args()
    pid = args.pid or find_pid(args.match)
    first = thread_seconds(pid)
    last = dict(first)
    names = python_thread_names(pid)
    start = time.monotonic()
    while time.monotonic() - start < args.seconds:
        time.sleep(min(args.every, max(0.0, args.seconds - (time.monotonic() - start))))
        try:
            last.update(thread_seconds(pid))
            names.update(python_thread_names(pid))
        except FileNotFoundError:
            break  # the process ended: report what was read
    elapsed = time.monotonic() - start
    by_name: dict[str, float] = defaultdict(float)
    for tid, seconds in last.items():
        # py-spy leaves the main thread (its id is the process's) unnamed in some processes.
        name = names.get(tid) or ("MainThread" if tid == pid else "native")
        by_name[name] += seconds - first.get(tid, 0.0)
    print(f"pid {pid}, {elapsed:.0f} s: {sum(by_name.values()):.1f} CPU s "
          f"({sum(by_name.values()) / elapsed:.2f} cores)")
    for name, seconds in sorted(by_name.items(), key=lambda item: -item[1]):
        print(f"{name:40s} {seconds:8.1f} s  {seconds / elapsed:6.1%} of a core")


if __name__ == "__main__":
    main()
