"""The profile's guard against pauses: a real child process measures three points of
~0.4 s each under ``ResumeGuard``; paused (SIGSTOP) and continued (SIGCONT) from outside
during one of them, as the gateway pauses its background profile, that run is made
again, and only that one; left alone, no run is made twice."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from helpers.paths import REPO

RUN_S = 0.4
CHILD = f"""
import time
from memserve.workers.resume_guard import ResumeGuard

def measure(point):
    print("start", point, flush=True)
    time.sleep({RUN_S})

with ResumeGuard() as guard:
    for point in range(3):
        guard.run(lambda: measure(point))
print("repeats", guard.repeats, flush=True)
"""


def run_child(pause_during: int | None) -> list[str]:
    """The child's output lines; paused for 0.3 s as soon as it starts ``pause_during``."""
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True, cwd=REPO)
    lines = []
    assert child.stdout is not None
    for line in child.stdout:
        lines.append(line.strip())
        if line.strip() == f"start {pause_during}" and lines.count(line.strip()) == 1:
            os.kill(child.pid, signal.SIGSTOP)
            time.sleep(0.3)
            os.kill(child.pid, signal.SIGCONT)
    assert child.wait(30) == 0
    return lines


def test_a_run_paused_from_outside_is_made_again():
    assert run_child(pause_during=1) == ["start 0", "start 1", "start 1", "start 2", "repeats 1"]


def test_without_a_pause_each_run_is_made_once():
    assert run_child(pause_during=None) == ["start 0", "start 1", "start 2", "repeats 0"]
