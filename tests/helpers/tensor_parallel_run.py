"""Greedy generation on one engine of a tensor-parallel size, in a process of its own
(a process joins one ``torch.distributed`` group): ``python tests/helpers/tensor_parallel_run.py
SPEC_JSON`` prints the results as JSON on its last line.

SPEC: folder, tp, prompts, new_tokens and options (EngineConfig fields). The engine
generates the prompts cold (``cold``), again from its prefix cache (``hit``), and once more
after every cached block moved to the host tier (``host``), with the numbers of blocks
swapped in and free at the end. With ``long_prefill_token_threshold`` among the options
the prefills run in chunks beside other requests' decodes; with ``speculative_config``
the n-gram drafts proposed and accepted are counted (``drafted``, ``accepted``)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from memserve.workers.cpu_threads import pin_compute_threads, rank_threads

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run(spec: dict) -> dict:
    pin_compute_threads(None, rank_threads(None, None, spec["tp"]))  # as a worker does, before torch loads
    from helpers.engine_generate import generate

    from memserve.config import EngineConfig
    from memserve.workers.real_engine import build_engine

    folder = Path(spec["folder"])
    options = {"dtype": "float32", "num_blocks": 64, "max_num_seqs": 8, "num_host_blocks": 64, **spec.get("options", {})}
    engine = build_engine(EngineConfig(model=str(folder), tensor_parallel_size=spec["tp"], **options), folder, 0)
    prompts, n = spec["prompts"], spec["new_tokens"]
    out = {"cold": generate(engine, prompts, n), "hit": generate(engine, prompts, n, tag="hit")}
    mempool = engine.mempool
    mempool.flush_saves()
    mempool.swap_out(mempool.stats()["device"]["total"])
    out["host"] = generate(engine, prompts, n, tag="host")
    mempool.flush_saves()
    stats = engine.stats()
    result = {**out, "swapped_in": stats["num_swapped_in"], "free": mempool.stats()["device"]["free"],
              "total": mempool.stats()["device"]["total"], "drafted": stats["spec_draft_tokens_total"],
              "accepted": stats["spec_accepted_tokens_total"]}
    engine.close()  # as a worker stops: its threads finish before the interpreter exits
    return result


if __name__ == "__main__":
    print(json.dumps(run(json.loads(sys.argv[1]))), flush=True)
    # The results are out. Skip the interpreter's teardown: destroying torch.distributed's
    # groups there has aborted this process once in about thirty runs ("terminate called
    # without an active exception"), which is not what the tests check.
    os._exit(0)
