"""Reply times in the first minute after `memserve up` is ready: a start that profiles its
cost model in the background against one that finds it.

A start with no cost model for its model runs `memserve profile --quick` in the
background, paused while requests are in flight (`gateway/auto_profile.py`). This starts
the server twice over one fresh `$MEMSERVE_CACHE` (the converted model linked in, no
cost model): first with no profile, so the background profile runs, and then, once that
profile is written, again, finding it. Each time, from ready (`/health` answers) on, it
sends one short chat ("Say hi.", 8 tokens, temperature 0) at each whole second for
`--seconds` seconds, sequentially (after a reply, the next goes at the next whole
second), and prints each second's reply time, the mean and max of each start, their
ratios, and when the background profile first paused and when it was written (from the
first start's log).

    python benchmarks/real/first_minute.py [--seconds 60] [-- extra memserve up flags]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import tempfile
import time
import urllib.request
from datetime import datetime
from pathlib import Path

from memserve.bench.server_process import ServerHandle, start_server, stop_server
from memserve.model_files.gguf_convert import cache_root, ensure_model_dir

REPO = Path(__file__).resolve().parents[2]
PROMPT = "Say hi."
MAX_TOKENS = 8
PROFILE_TIMEOUT_S = 600.0  # for the background profile to be written after the window
PAUSED = "paused while requests are served"
WRITTEN = re.compile(r"cost model of .* profiled in .*")
FAILED = "the background profile of"
PROFILING = "profiling one in the background"
Events = dict[str, tuple[float, str]]  # a log event's name: its seconds after ready, its line


def reply_s(server: ServerHandle) -> float:
    """Seconds of one non-streamed chat request, to its last byte."""
    body = json.dumps({"model": server.model, "messages": [{"role": "user", "content": PROMPT}],
                       "max_tokens": MAX_TOKENS, "temperature": 0}).encode()
    request = urllib.request.Request(server.base_url + "/v1/chat/completions", body,
                                     {"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as r:
        r.read()
    return time.perf_counter() - start


def each_second(server: ServerHandle, seconds: int) -> dict[int, float]:
    """Reply time by the whole second after ready at which its request was sent."""
    ready = time.monotonic()
    replies: dict[int, float] = {}
    second = 0
    while second < seconds:
        time.sleep(max(0.0, ready + second - time.monotonic()))
        replies[second] = reply_s(server)
        second = math.ceil(time.monotonic() - ready)
    return replies


def log_events(log: Path, ready_wall: float) -> Events:
    """The background profile's log lines, each with its seconds after ready."""
    events: Events = {}
    for line in log.read_text(errors="replace").splitlines():
        for name, found in (("profiling", PROFILING in line), ("paused", PAUSED in line),
                            ("written", bool(WRITTEN.search(line))), ("failed", FAILED in line and "failed" in line)):
            if found and name not in events:
                when = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
                events[name] = (when - ready_wall, line[24:])
    return events


def await_profile(log: Path, ready_wall: float) -> Events:
    """The log's events once the background profile was written or failed."""
    deadline = time.monotonic() + PROFILE_TIMEOUT_S
    events = log_events(log, ready_wall)
    if "profiling" in events and not {"written", "failed"} & events.keys():
        print(f"waiting up to {PROFILE_TIMEOUT_S:.0f} s for the background profile")
    while "profiling" in events and not {"written", "failed"} & events.keys():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the background profile was not written within {PROFILE_TIMEOUT_S:.0f} s: {log}")
        time.sleep(1.0)
        events = log_events(log, ready_wall)
    return events


def run_start(name: str, flags: list[str], log: Path, seconds: int) -> tuple[dict[int, float], Events]:
    """One start: its replies by second and its background profile's log events."""
    server = start_server(flags, log, cwd=REPO, auto_profile=True)
    ready_wall = time.time()
    try:
        replies = each_second(server, seconds)
        events = await_profile(log, ready_wall)
    finally:
        stop_server(server)
    print(f"{name}: {len(replies)} replies in {seconds} s")
    return replies, events


def report(first: dict[int, float], profiled: dict[int, float], events: Events, seconds: int) -> None:
    print(f"\n{'second':>6}  {'profiling (s)':>13}  {'profiled (s)':>12}")
    for s in range(seconds):
        cells = [f"{d[s]:.3f}" if s in d else "-" for d in (first, profiled)]
        print(f"{s:>6}  {cells[0]:>13}  {cells[1]:>12}")
    means = [statistics.mean(d.values()) for d in (first, profiled)]
    maxes = [max(d.values()) for d in (first, profiled)]
    print(f"\nmean: profiling {means[0]:.3f} s, profiled {means[1]:.3f} s, ratio {means[0] / means[1]:.2f}")
    print(f"max:  profiling {maxes[0]:.3f} s, profiled {maxes[1]:.3f} s, ratio {maxes[0] / maxes[1]:.2f}")
    print(f"slowest reply while profiling / profiled mean: {maxes[0] / means[1]:.2f}")
    for name in ("profiling", "paused", "written", "failed"):
        if name in events:
            at, line = events[name]
            print(f"background profile {name} at {at:+.1f} s after ready: {line}")
    if "paused" not in events:
        print("background profile: never paused")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=int, default=60, help="how long after ready to send a request each second")
    ap.add_argument("extra", nargs="*", help="flags passed to memserve up (after --)")
    args = ap.parse_args()
    ensure_model_dir(None)  # converted before the link, which would otherwise dangle on a fresh machine
    with tempfile.TemporaryDirectory(prefix="memserve-first-minute-") as tmp:
        cache = Path(tmp) / "cache"
        cache.mkdir()
        (cache / "models").symlink_to(cache_root())  # the same converted model, no cost model
        os.environ["MEMSERVE_CACHE"] = str(cache)
        first, events = run_start("profiling start", args.extra, Path(tmp) / "profiling.log", args.seconds)
        profiles = sorted((cache / "cost-models").glob("*.json"))
        if not profiles:
            raise SystemExit(f"the first start wrote no cost model; its log said: {events}")
        print(f"cost model written: {profiles[0].name}")
        profiled, again = run_start("profiled start", args.extra, Path(tmp) / "profiled.log", args.seconds)
        if "profiling" in again:
            raise SystemExit("the second start did not find the first start's cost model")
    report(first, profiled, events, args.seconds)


if __name__ == "__main__":
    main()
