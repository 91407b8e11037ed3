"""What ten open `/v1/stats/stream` clients (the dashboard's feed) cost the gateway.

Starts one `memserve up`, then runs the same short ShareGPT replay twice: with no stats
client, and with ten clients reading `/v1/stats/stream`. Prints per run the gateway
process's CPU seconds (utime + stime from /proc/<pid>/stat; the workers are other
processes) and the replay's TTFT and TBT means, then the ratios streams / none.

    python benchmarks/real/stats_stream_overhead.py [--clients 10] [--sessions 8] [-- extra memserve up flags]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from memserve.bench.server_process import start_server, stop_server


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def find(obj: object, key: str) -> dict | None:
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        obj = list(obj.values())
    if isinstance(obj, list):
        for item in obj:
            found = find(item, key)
            if found is not None:
                return found
    return None


def stream_client(url: str, stop: threading.Event, counts: list[int]) -> None:
    with urllib.request.urlopen(url + "/v1/stats/stream", timeout=30) as r:
        while not stop.is_set():
            if r.readline().startswith(b"data: "):
                counts.append(1)


def replay(base_url: str, args: argparse.Namespace, out: Path) -> dict:
    cmd = [sys.executable, "-m", "memserve.cli", "bench", "--base-url", base_url, "--num-sessions",
           str(args.sessions), "--max-turns", "2", "--max-tokens", "32", "--rate", "1", "--seed", "0",
           "--no-progress", "--output", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    results = json.loads(out.read_text())
    return {"ttft_ms": find(results, "ttft_ms")["mean"], "tbt_ms": find(results, "tbt_ms")["mean"]}


def run(server, args: argparse.Namespace, clients: int, tmp: Path) -> dict:
    stop, counts = threading.Event(), []
    threads = [threading.Thread(target=stream_client, args=(server.base_url, stop, counts), daemon=True)
               for _ in range(clients)]
    for t in threads:
        t.start()
    time.sleep(1.5 if clients else 0)
    cpu0, t0 = cpu_seconds(server.process.pid), time.monotonic()
    figures = replay(server.base_url, args, tmp / f"results-{clients}.json")
    cpu, wall = cpu_seconds(server.process.pid) - cpu0, time.monotonic() - t0
    stop.set()
    return {"clients": clients, "gateway_cpu_s": round(cpu, 2), "wall_s": round(wall, 1),
            "gateway_cpu_share": round(cpu / wall, 4), "events": len(counts), **figures}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("up_flags", nargs="*", help="extra `memserve up` flags (after --)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        server = start_server(args.up_flags, tmp / "memserve.log")
        try:
            replay(server.base_url, argparse.Namespace(sessions=2), tmp / "warmup.json")  # warm the caches' code paths
            none = run(server, args, 0, tmp)
            streams = run(server, args, args.clients, tmp)
        finally:
            stop_server(server)
    for r in (none, streams):
        print(json.dumps(r))
    print(json.dumps({"gateway_cpu_ratio": round(streams["gateway_cpu_s"] / max(none["gateway_cpu_s"], 1e-9), 3),
                      "gateway_cpu_share_delta": round(streams["gateway_cpu_share"] - none["gateway_cpu_share"], 4),
                      "ttft_ratio": round(streams["ttft_ms"] / none["ttft_ms"], 3),
                      "tbt_ratio": round(streams["tbt_ms"] / none["tbt_ms"], 3)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
