"""The disk tier of a tensor-parallel worker (two ranks on the CPU, gloo, float32): each
rank keeps its heads' part of every block in a directory of its own. A new process on the
same directory adopts what the last one left and serves it with transformers' greedy
tokens; a block whose file one rank lost (corrupted while serving, or missing at the
start) is recomputed, never read as that rank's garbage, and no block stays held.

Each run is a process of its own (``helpers/tensor_parallel_disk_run.py``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from helpers.hf_greedy import transformers_greedy
from helpers.paths import TESTS

from memserve.testing.random_models import TINY_SIZES, save_tiny_model

NEW_TOKENS = 6
PROMPT_LENGTHS = (40, 70, 23)


def run(folder: Path, disk_dir: Path, prompt_ids: list[list[int]], damage: int | None = None) -> dict:
    spec = {"folder": str(folder), "tp": 2, "disk_dir": str(disk_dir), "prompts": prompt_ids,
            "new_tokens": NEW_TOKENS, "damage": damage}
    result = subprocess.run([sys.executable, str(TESTS / "helpers" / "tensor_parallel_disk_run.py"), json.dumps(spec)],
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-4000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["free"] == out["total"]  # nothing held once every request is done
    return out


def test_two_ranks_keep_their_parts_on_disk_across_restarts(tmp_path):
    folder, disk_dir = tmp_path / "model", tmp_path / "kv"
    hf = save_tiny_model(folder, "llama")
    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, TINY_SIZES["vocab_size"], (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    reference = transformers_greedy(hf, ids, NEW_TOKENS)

    first = run(folder, disk_dir, ids)
    assert first["tokens"] == reference and first["adopted"] == 0
    ranks = sorted(p.name for p in disk_dir.glob("*/i0r*"))
    assert ranks == ["i0r0", "i0r1"]
    files = {r: sorted(p.name for p in disk_dir.glob(f"*/{r}/*.kv")) for r in ranks}
    assert files["i0r0"] and files["i0r0"] == files["i0r1"]  # one file per block on every rank

    again = run(folder, disk_dir, ids)
    assert again["tokens"] == reference
    assert again["adopted"] == len(files["i0r0"]) and all(again["cached"])  # served from the last run's files

    damaged = run(folder, disk_dir, ids, damage=1)  # rank 1's files go bad after they were adopted
    assert damaged["tokens"] == reference
    assert damaged["removed"] > 0  # the blocks rank 1 could not read were dropped on rank 0 too

    lost = sorted(disk_dir.glob("*/i0r1/*.kv"))[::2]
    for path in lost:  # missing at the start: rank 0's files of those blocks are not adopted
        path.unlink()
    after = run(folder, disk_dir, ids)
    assert after["tokens"] == reference
    assert after["adopted"] <= len(files["i0r0"]) - len(lost)
    assert {p.name for p in disk_dir.glob("*/i0r0/*.kv")} == {p.name for p in disk_dir.glob("*/i0r1/*.kv")}
