"""The ShareGPT replay through the server with four LoRA adapters mixed evenly, against the
base model alone: throughput, TBT and TTFT, and the ratios adapters / base.

One `memserve up` serves the embedded SmolLM2 (float32) with ``--adapters`` rank-``--rank``
adapters (every projection targeted, random weights made with ``peft``) in as many slots.
Each round replays (``memserve bench``, the round's seed: the same conversations and
arrival times) twice: every conversation on the base model, then each conversation on
one of the adapters (``--lora-modules``: spread evenly by session, all its turns on one;
its KV is the adapter's, so it finds nothing the base run cached). Prints each round,
the medians and the ratios.

    python benchmarks/real/lora_serving.py [--sessions 16] [--rate 2] [--rounds 2] [-- extra memserve up flags]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from memserve.bench.server_process import start_server, stop_server
from memserve.model_files.gguf_convert import ensure_model_dir
from memserve.testing.random_adapters import make_adapters

FIGURES = {"output_tokens_per_s": ("throughput", "output_tokens_per_s"), "tbt_ms": ("tbt_ms", "mean"),
           "ttft_ms": ("ttft_ms", "mean")}


def figure(results: dict, path: tuple[str, str]) -> float:
    """A figure of ``memserve bench``'s results file (one run)."""
    return float(results[path[0]][path[1]])


def replay(base_url: str, args: argparse.Namespace, out: Path, adapters: list[str], seed: int) -> dict:
    cmd = [sys.executable, "-m", "memserve.cli", "bench", "--base-url", base_url, "--num-sessions",
           str(args.sessions), "--max-turns", str(args.turns), "--max-tokens", str(args.max_tokens),
           "--rate", str(args.rate), "--seed", str(seed), "--no-progress", "--output", str(out)]
    if adapters:
        cmd += ["--lora-modules", *adapters]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    results = json.loads(out.read_text())
    return {name: round(figure(results, path), 2) for name, path in FIGURES.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rate", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("up_flags", nargs="*", help="extra `memserve up` flags (after --)")
    args = parser.parse_args()
    model_dir = Path(ensure_model_dir(None))
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        folders = make_adapters(model_dir, tmp, args.adapters, args.rank)
        flags = ["--model", str(model_dir), "--enable-lora", "--max-loras", str(args.adapters),
                 "--max-lora-rank", str(args.rank), "--lora-modules", *(f"{n}={f}" for n, f in folders.items()),
                 *args.up_flags]
        server = start_server(flags, tmp / "memserve.log")
        rounds: dict[str, list[dict]] = {"base": [], "adapters": []}
        try:
            replay(server.base_url, argparse.Namespace(**{**vars(args), "sessions": 2}), tmp / "warm.json",
                   list(folders), 1000)
            for r in range(args.rounds):
                for kind, names in (("base", []), ("adapters", list(folders))):
                    # The same conversations for both kinds within a round (under the
                    # adapters their KV is their own), other ones in each round.
                    rounds[kind].append(replay(server.base_url, args, tmp / f"{kind}-{r}.json", names, r))
                    print(json.dumps({"round": r, "kind": kind, **rounds[kind][-1]}), flush=True)
        finally:
            stop_server(server)
    medians = {kind: {k: statistics.median(r[k] for r in runs) for k in FIGURES} for kind, runs in rounds.items()}
    print(json.dumps(medians))
    print(json.dumps({f"adapters/base {k}": round(medians["adapters"][k] / medians["base"][k], 3) for k in FIGURES}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
