"""Worker-to-worker KV transfer time on one machine, on both same-host paths, one run.

Two ``TransferProbe``s (``memserve/workers/transfer_probe.py``), each a receiver process
and a sender endpoint over real KV pools of the model's shape: one sends the blocks as
ZeroMQ frames over ipc:// (zmq), the other has the receiver copy them out of the
sender's pool, mapped once (shm: shared memory on the CPU, CUDA IPC on a GPU). Each timed
transfer is a full ``MemPool.transfer`` (allocation round trip, data, the receiver's
write, its answer); the two paths alternate, repetition by repetition. Prints per size
the median milliseconds and milliseconds per MiB of each path, and a summary line.

    python benchmarks/micro/kv_transfer_paths.py [--blocks 1,16,64,256] [--reps 5]
        [--model DIR] [--device cuda] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
from contextlib import ExitStack

import torch

from memserve.config import EngineConfig
from memserve.model_files.gguf_convert import ensure_model_dir
from memserve.workers.transfer_probe import TransferProbe

TRANSPORTS = ("zmq", "shm")
MIB = 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", default="1,16,64,256", help="transfer sizes, in blocks")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--model", default=None, help="its shape sizes the blocks (default: the embedded SmolLM2)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    sizes = [int(n) for n in args.blocks.split(",")]
    model_dir = ensure_model_dir(args.model)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    with ExitStack() as stack:
        probes = {}
        for transport in TRANSPORTS:
            cfg = EngineConfig(model=str(model_dir), dtype=args.dtype, device=args.device,
                               kv_same_host_transport=transport)
            probes[transport] = probe = stack.enter_context(TransferProbe(model_dir, cfg, max(sizes), sync))
            probe.measure(max(sizes))  # the receiver's pages, the sockets
        for transport, probe in probes.items():
            assert probe.in_place == (transport == "shm"), f"{transport}: the receiver did not map as expected"
        block_mib = probes["shm"].block_nbytes / MIB
        print(f"{args.device}, {args.dtype}, {block_mib * 1024:.0f} KiB per block; median of {args.reps} "
              f"(paths alternating)")
        print(f"{'blocks':>7} {'MiB':>8} " + " ".join(f"{t + ' ms':>9} {t + ' ms/MiB':>11}" for t in TRANSPORTS))
        per_mib = {}
        for n in sizes:
            runs: dict[str, list[float]] = {t: [] for t in TRANSPORTS}
            for _ in range(args.reps):
                for transport, probe in probes.items():
                    runs[transport].append(probe.measure(n))
            mib = n * block_mib
            ms = {t: statistics.median(r) * 1e3 for t, r in runs.items()}
            per_mib = {t: ms[t] / mib for t in TRANSPORTS}
            print(f"{n:>7} {mib:>8.2f} " + " ".join(f"{ms[t]:>9.3f} {per_mib[t]:>11.4f}" for t in TRANSPORTS))
        print(f"summary: {sizes[-1]} blocks: " + ", ".join(f"{t} {per_mib[t]:.4f} ms/MiB" for t in TRANSPORTS))


if __name__ == "__main__":
    main()
