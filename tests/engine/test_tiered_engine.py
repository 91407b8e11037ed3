"""The tiered KV store in the real engine (real model, real files): multi-turn ShareGPT
replays under capacity pressure (a device pool far smaller than the conversations, a
small host tier, a disk tier) give the same greedy tokens as no caching at all, also
when disk files are corrupted, truncated or deleted; a new process on the same disk
directory reports the previous run's blocks as cached and serves them identically."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest
from helpers.engine_replay import replay
from helpers.tiered_engine import (
    MAX_MODEL_LEN,
    TURNS,
    short_conversations,
    tiered_config,
    tokens_of,
)

from memserve.config import EngineConfig
from memserve.kvcache.address import Tier
from memserve.kvcache.events import REMOVED, STORED
from memserve.model_files.gguf_convert import ensure_model_dir
from memserve.text.tokenizer import Tokenizer
from memserve.workers.engine.engine import Engine
from memserve.workers.real_engine import build_engine

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer.from_folder(model_dir)


@pytest.fixture(scope="module")
def convs(tokenizer):
    return short_conversations(tokenizer, 3)


@pytest.fixture(scope="module")
def baseline(model_dir, tokenizer, convs):
    """Greedy tokens of every turn without any caching."""
    cfg = EngineConfig(dtype="float32", num_blocks=64, enable_prefix_caching=False, max_num_batched_tokens=512,
                       max_model_len=MAX_MODEL_LEN)
    return tokens_of(replay(build_engine(cfg, model_dir), tokenizer, convs, TURNS, "base"))


@pytest.fixture(scope="module")
def tiered(model_dir, tmp_path_factory):
    """The tiered engine the tests below share, in order (the last one closes it)."""
    disk_dir = tmp_path_factory.mktemp("kv-disk")
    return build_engine(tiered_config(disk_dir), model_dir), disk_dir


def assert_nothing_held(engine: Engine) -> None:
    engine.mempool.flush_saves()
    stats = engine.mempool.stats()
    for tier in ("device", "host", "disk"):
        assert stats[tier]["used"] == 0 and stats[tier]["free"] + stats[tier]["cached"] == stats[tier]["total"]


def test_tiers_give_the_same_tokens_as_no_cache_under_pressure(tiered, tokenizer, convs, baseline):
    engine, _ = tiered
    got = replay(engine, tokenizer, convs, TURNS, "tier")
    assert tokens_of(got) == baseline
    io = engine.mempool.stats()["tier_io"]
    assert io["disk"]["write_bytes"] > 0 and io["disk"]["hits"] > 0  # the cascade reached the disk and back
    assert any(cached for turn in got[1:] for _, cached in turn.values())
    assert engine.stats()["num_swapped_in"] > 0
    assert_nothing_held(engine)


def test_layer_major_pools_go_to_disk_and_back_block_by_block(model_dir, tokenizer, convs, baseline, tmp_path):
    """In the layer-major layout a run of blocks is not one stretch of bytes: each block's
    bytes are gathered whole before the disk tier cuts the run into one file per block,
    and put back where they belong (the same tokens as without a cache)."""
    engine = build_engine(replace(tiered_config(tmp_path), kv_layout="layer-major"), model_dir)
    got = replay(engine, tokenizer, convs, TURNS, "layer-major")
    assert tokens_of(got) == baseline
    assert engine.mempool.stats()["tier_io"]["disk"]["hits"] > 0
    assert_nothing_held(engine)
    engine.close()


def test_damaged_disk_files_are_misses_with_the_same_tokens(tiered, tokenizer, convs, baseline):
    engine, _ = tiered
    engine.mempool.persist()  # everything cached is now on disk: every hit reads a file
    engine.drain_kv_events()
    files = sorted((engine.mempool.disk.dir).glob("*.kv"))
    assert files
    for i, path in enumerate(files):
        if i % 3 == 0:
            path.unlink()
        elif i % 3 == 1:
            os.truncate(path, path.stat().st_size // 3)
        else:
            data = bytearray(path.read_bytes())
            data[-7] ^= 0x01
            path.write_bytes(bytes(data))
    got = replay(engine, tokenizer, convs, TURNS, "damaged")
    assert tokens_of(got) == baseline
    removed = {h for e in engine.drain_kv_events() if e.type == REMOVED for h in e.hashes}
    assert removed  # the bad blocks were forgotten, and the gateway told
    assert_nothing_held(engine)


def test_a_new_process_on_the_same_directory_serves_from_the_previous_runs_cache(tiered, convs, baseline):
    engine, disk_dir = tiered
    engine.close()  # a graceful shutdown: what the faster tiers cache goes to disk
    report = subprocess.run([sys.executable, __file__, str(disk_dir), json.dumps(convs)],
                            check=False, capture_output=True, text=True, cwd=REPO / "tests", timeout=300,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(  # tests/ for helpers.*
                                [str(REPO / "tests"), *filter(None, [os.environ.get("PYTHONPATH")])])})
    assert report.returncode == 0, report.stderr[-3000:]
    out = json.loads(report.stdout.splitlines()[-1])
    assert out["adopted_blocks"] > 0
    assert [{int(s): t for s, t in turn.items()} for turn in out["tokens"]] == baseline
    assert all(cached > 0 for cached in out["first_turn_cached"])  # no turn computed from scratch


@pytest.mark.slow
def test_a_restarted_server_publishes_and_serves_its_disk_cache(tmp_path):
    """Over the real stack: after ``memserve up`` restarts on the same --disk-cache-dir,
    the gateway's mirror knows the previous run's blocks before any request, and the same
    chat is answered identically from them; /health and /metrics show the tiers."""
    from openai import OpenAI

    from memserve.bench.server_process import start_server, stop_server

    args = ("--num-blocks", "64", "--num-host-blocks", "16", "--disk-cache-dir", str(tmp_path / "kv"),
            "--disk-cache-gb", "0.2")
    messages = [{"role": "user", "content": "Name three rivers of Europe and one fact about each of them."}]

    def ask(server) -> tuple[str, int]:
        reply = OpenAI(base_url=server.base_url + "/v1", api_key="-").chat.completions.create(
            model=server.model, messages=messages, max_tokens=16, temperature=0)
        return reply.choices[0].message.content, reply.usage.prompt_tokens_details.cached_tokens

    first = start_server(args, tmp_path / "first.log", cwd=REPO)
    try:
        answer, cached = ask(first)
        assert cached == 0
    finally:
        assert stop_server(first) == 0
    second = start_server(args, tmp_path / "second.log", cwd=REPO)
    try:
        deadline = time.monotonic() + 10  # the adopted blocks' KV events follow the worker's ready message
        while (worker := second.get_json("/health")["workers"][0])["mirror_blocks"] == 0:
            assert time.monotonic() < deadline, worker
            time.sleep(0.2)
        assert worker["kv_tiers"]["disk"]["bytes_used"] > 0
        again, cached = ask(second)
        assert again == answer and cached > 0
        assert second.get_json("/health")["workers"][0]["kv_tiers"]["disk"]["read_bytes"] > 0
        with urllib.request.urlopen(second.base_url + "/metrics", timeout=10) as r:
            assert 'memserve_kv_tier_read_bytes_total{instance="0",tier="disk"}' in r.read().decode()
    finally:
        stop_server(second)


def _restarted_run(disk_dir: str, convs: list) -> dict:
    model_dir = ensure_model_dir(None)
    engine = build_engine(tiered_config(Path(disk_dir)), model_dir)
    adopted = [h for e in engine.drain_kv_events() if e.type == STORED and set(e.tiers) == {Tier.DISK}
               for h in e.hashes]
    got = replay(engine, Tokenizer.from_folder(model_dir), convs, TURNS, "again")
    engine.close()
    return {"adopted_blocks": len(adopted), "tokens": tokens_of(got),
            "first_turn_cached": [cached for _, cached in got[0].values()]}


if __name__ == "__main__":
    result = _restarted_run(sys.argv[1], json.loads(sys.argv[2]))
    print(json.dumps({**result, "tokens": [{str(k): v for k, v in t.items()} for t in result["tokens"]]}))
