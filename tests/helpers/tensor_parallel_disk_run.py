"""One run of a tensor-parallel engine with a disk tier, in a process of its own:
``python tests/helpers/tensor_parallel_disk_run.py SPEC_JSON`` prints the results as JSON
on its last line.

SPEC: folder, tp, disk_dir, prompts, new_tokens, and ``damage`` (a rank whose block
files are corrupted once the engine has adopted them, or null). The engine adopts what an
earlier run left in ``disk_dir``, generates the prompts, and closes (a graceful shutdown:
what it caches goes to disk)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from memserve.workers.cpu_threads import pin_compute_threads, rank_threads

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def corrupt(files: list[Path]) -> None:
    for path in files:
        data = bytearray(path.read_bytes())
        data[-5] ^= 0x01
        path.write_bytes(bytes(data))


def run(spec: dict) -> dict:
    pin_compute_threads(None, rank_threads(None, None, spec["tp"]))  # as a worker does, before torch loads
    from helpers.engine_generate import generate

    from memserve.config import EngineConfig
    from memserve.kvcache.events import REMOVED
    from memserve.workers.real_engine import build_engine

    folder, disk_dir = Path(spec["folder"]), Path(spec["disk_dir"])
    cfg = EngineConfig(model=str(folder), tensor_parallel_size=spec["tp"], dtype="float32", num_blocks=64,
                       num_host_blocks=16, max_num_seqs=8, disk_cache_dir=str(disk_dir), disk_cache_gb=0.02)
    engine = build_engine(cfg, folder, 0)
    adopted = engine.mempool.stats()["disk"]["cached"]
    if spec.get("damage") is not None:
        corrupt(sorted(disk_dir.glob(f"*/i0r{spec['damage']}/*.kv")))
    engine.drain_kv_events()
    out = generate(engine, spec["prompts"], spec["new_tokens"])
    removed = sum(len(e.hashes) for e in engine.drain_kv_events() if e.type == REMOVED)
    engine.mempool.flush_saves()
    free, total = engine.mempool.stats()["device"]["free"], engine.mempool.stats()["device"]["total"]
    engine.close()
    return {"tokens": [t for t, _ in out], "cached": [c for _, c in out], "adopted": adopted, "removed": removed,
            "free": free, "total": total}


if __name__ == "__main__":
    print(json.dumps(run(json.loads(sys.argv[1]))), flush=True)
    # The results are out. Skip the interpreter's teardown: destroying torch.distributed's
    # groups there has aborted this process once in about thirty runs ("terminate called
    # without an active exception"), which is not what the tests check.
    os._exit(0)
