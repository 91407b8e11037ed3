"""Start-up time and first-request latency of `memserve up --ray` against the local spawn.

Starts `memserve up --cpu-workers N` from nothing twice, its workers spawned as local
processes, then placed by Ray (``--ray local``: a Ray instance of its own, whatever runs
on the machine; or ``--ray-address``'s cluster). Each time it measures the seconds until
/health answers 200, then the TTFT and total time of one streamed chat request (the
first one the server serves), and stops the server. Prints both rows and the ratios
--ray / local. One run each: on a shared machine repeat it to see the spread.

    python benchmarks/real/ray_startup.py [--cpu-workers 2] [--ray-address local] [-- extra memserve up flags]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from cold_start import REPO, first_user_messages, timed_chat

from memserve.bench.server_process import start_server, stop_server


def measure(flags: list[str], prompt: str, max_tokens: int) -> tuple[float, float, float]:
    """(seconds to /health 200, first request's TTFT, its total) of a server started with ``flags``."""
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        server = start_server(flags, Path(tmp) / "memserve.log", cwd=REPO)
        healthy = time.perf_counter() - started
        try:
            ttft, total = timed_chat(server.base_url, server.model, prompt, max_tokens)
        finally:
            stop_server(server)
    return healthy, ttft, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-workers", type=int, default=2)
    ap.add_argument("--ray-address", default="local", help="--ray's address (default: a Ray instance of its own)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("extra", nargs="*", help="flags passed to memserve up (after --)")
    args = ap.parse_args()
    prompt = first_user_messages(1)[0]
    flags = ["--cpu-workers", str(args.cpu_workers), *args.extra]
    rows = {"local": measure(flags, prompt, args.max_tokens),
            "--ray": measure(["--ray", args.ray_address, *flags], prompt, args.max_tokens)}
    print(f"{'':8} {'to /health ok':>14} {'first TTFT':>11} {'first total':>12}")
    for name, (healthy, ttft, total) in rows.items():
        print(f"{name:8} {healthy:12.1f} s {ttft * 1000:8.0f} ms {total * 1000:9.0f} ms")
    ratios = [r / l for r, l in zip(rows["--ray"], rows["local"])]
    print(f"{'ratio':8} {ratios[0]:13.2f}x {ratios[1]:10.2f}x {ratios[2]:11.2f}x   (--ray / local)")


if __name__ == "__main__":
    main()
