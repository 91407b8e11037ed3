"""First-request latency of a freshly started `memserve up` against its steady state.

Starts the server (default model, float32 unless told otherwise), waits for `/health`,
then sends ``--requests`` sequential streamed chat requests of different ShareGPT prompts
(of similar length) and prints each one's TTFT and total time. The first requests after a start pay any
one-time cost the worker did not pay during warm-up; the ratio of the first request's
TTFT to the median of the last half is the figure to watch (1.0 = no cold start).

    python benchmarks/real/cold_start.py [--requests 8] [--max-tokens 8] [-- extra memserve up flags]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from memserve.bench.server_process import start_server, stop_server

REPO = Path(__file__).resolve().parents[2]
SHARED_DATA = REPO.parent / "shared" / "data"


def first_user_messages(n: int) -> list[str]:
    out = []
    for line in (SHARED_DATA / "sharegpt-sample.jsonl").read_text().splitlines():
        content = json.loads(line)["messages"][0]["content"]
        if 500 <= len(content) <= 700:  # similar lengths: the TTFTs are comparable
            out.append(content)
        if len(out) == n:
            return out
    raise RuntimeError("not enough prompts in the sample")


def timed_chat(base_url: str, model: str, content: str, max_tokens: int) -> tuple[float, float]:
    """(TTFT, total) in seconds of one streamed chat request."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": content}], "stream": True,
                       "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(base_url + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    ttft = None
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            if ttft is None and line.startswith(b"data: ") and b'"content":"' in line and b'"content":""' not in line:
                ttft = time.perf_counter() - start
    total = time.perf_counter() - start
    return (ttft if ttft is not None else total), total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("extra", nargs="*", help="flags passed to memserve up (after --)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        server = start_server(args.extra, Path(tmp) / "memserve.log", cwd=REPO)
        print(f"healthy after {time.perf_counter() - started:.1f} s")
        try:
            rows = [timed_chat(server.base_url, server.model, c, args.max_tokens)
                    for c in first_user_messages(args.requests)]
        finally:
            stop_server(server)
    for i, (ttft, total) in enumerate(rows, 1):
        print(f"request {i}: TTFT {ttft * 1000:7.0f} ms   total {total * 1000:7.0f} ms")
    steady = statistics.median(t for t, _ in rows[len(rows) // 2:])
    print(f"first-request TTFT / steady-state median TTFT: {rows[0][0] / steady:.2f} "
          f"({rows[0][0] * 1000:.0f} ms / {steady * 1000:.0f} ms)")


if __name__ == "__main__":
    main()
