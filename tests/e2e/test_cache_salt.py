"""cache_salt (vLLM's request field) on a real `memserve up`: a salted prompt shares no
cached KV with another salt or with unsalted requests (``cached_tokens`` tells nothing
across salts), the same salt hits, greedy output does not depend on the salt; the
prompt-tree router follows a salt's blocks and does not count another salt's as a hit;
and salted blocks keep apart in the disk tier across a restart."""

from __future__ import annotations

import re
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from helpers.paths import REPO
from openai import OpenAI

from memserve.bench.server_process import start_server, stop_server

# About 10 blocks of 16 tokens; a fresh nonce in front keeps other tests' cache out of it.
BODY = ("The history of the river valley begins with small farming villages along its banks, "
        "then market towns, bridges, mills and finally the railway that joined them to the coast. ") * 3


def long_prompt() -> str:
    return f"[{uuid.uuid4().hex}] {BODY}"


def complete(client: OpenAI, model: str, prompt: str, salt: str | None) -> tuple[str, int]:
    extra = {"cache_salt": salt} if salt is not None else {}
    r = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, extra_body=extra)
    details = r.usage.prompt_tokens_details
    return r.choices[0].text, (details.cached_tokens or 0) if details else 0


def test_salts_never_share_cached_blocks(memserve_server):
    client = OpenAI(base_url=memserve_server.base_url + "/v1", api_key="-")
    model, prompt = memserve_server.model, long_prompt()
    text_a, cached = complete(client, model, prompt, "tenant-a")
    assert cached == 0
    text_b, cached = complete(client, model, prompt, "tenant-b")
    assert cached == 0  # the same tokens under another salt: nothing shared
    again_a, cached = complete(client, model, prompt, "tenant-a")
    assert cached > 0
    plain, cached = complete(client, model, prompt, None)
    assert cached == 0  # unsalted after salted: nothing shared either
    plain_again, cached = complete(client, model, prompt, None)
    assert cached > 0
    assert text_a == text_b == again_a == plain == plain_again  # greedy: the salt changes no output


def test_chat_requests_take_a_salt_too(memserve_server):
    client = OpenAI(base_url=memserve_server.base_url + "/v1", api_key="-")
    messages = [{"role": "user", "content": long_prompt()}]

    def chat(salt: str) -> int:
        r = client.chat.completions.create(model=memserve_server.model, messages=messages, max_tokens=2,
                                           temperature=0, extra_body={"cache_salt": salt})
        return r.usage.prompt_tokens_details.cached_tokens or 0

    assert chat("x") == 0
    assert chat("y") == 0
    assert chat("x") > 0


# ------------------------------------------------------------- prompt-tree router

def _router_metrics(server) -> dict[str, float]:
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {m[0]: float(m[1]) for m in re.findall(r"^(memserve_router_\S+) (\S+)$", text, re.MULTILINE)}


def _routed(server) -> dict[int, float]:
    metrics = _router_metrics(server)
    return {i: metrics.get(f'memserve_router_routed_requests_total{{instance="{i}"}}', 0.0) for i in range(2)}


def _cache_hits(server) -> float:
    return sum(v for k, v in _router_metrics(server).items()
               if k.startswith("memserve_router_decisions_total") and 'reason="cache_hit"' in k)


def _served_by(server, before: dict[int, float]) -> int:
    after = _routed(server)
    moved = [i for i in after if after[i] > before[i]]
    assert len(moved) == 1, (before, after)
    return moved[0]


@pytest.fixture(scope="module")
def tree_server(tmp_path_factory):
    handle = start_server(["--cpu-workers", "2", "--router", "prompt-tree", "--num-blocks", "128",
                           "--max-num-seqs", "4"], tmp_path_factory.mktemp("salt-tree") / "memserve.log",
                          threads=1, cwd=REPO)
    yield handle
    stop_server(handle)


def test_prompt_tree_follows_a_salts_blocks_only(tree_server):
    client = OpenAI(base_url=tree_server.base_url + "/v1", api_key="-")
    model, prompt = tree_server.model, long_prompt()
    before = _routed(tree_server)
    first, cached = complete(client, model, prompt, "a")
    assert cached == 0
    holder = _served_by(tree_server, before)
    time.sleep(0.5)  # the worker's KV events reach the gateway's mirror
    for _ in range(2):  # the salt's repeat goes where its blocks are, whichever worker is less loaded
        hits, before = _cache_hits(tree_server), _routed(tree_server)
        again, cached = complete(client, model, prompt, "a")
        assert _served_by(tree_server, before) == holder
        assert _cache_hits(tree_server) == hits + 1
        assert cached > 0 and again == first
    hits, before = _cache_hits(tree_server), _routed(tree_server)
    other, cached = complete(client, model, prompt, "b")
    assert _cache_hits(tree_server) == hits  # salt a's blocks are no hit for salt b
    assert cached == 0 and other == first
    _served_by(tree_server, before)


# ------------------------------------------------------------------- disk tier

@pytest.mark.slow
def test_salted_blocks_stay_apart_on_disk_across_a_restart(tmp_path: Path):
    disk = tmp_path / "kv"
    args = ("--num-blocks", "64", "--num-host-blocks", "16", "--disk-cache-dir", str(disk), "--disk-cache-gb", "0.2")
    prompt = long_prompt()
    first = start_server(args, tmp_path / "first.log", cwd=REPO)
    try:
        client = OpenAI(base_url=first.base_url + "/v1", api_key="-")
        answer, cached = complete(client, first.model, prompt, "a")
        assert cached == 0
    finally:
        assert stop_server(first) == 0
    assert list(disk.rglob("*.kv"))  # salt a's blocks were written as files named by their hashes
    second = start_server(args, tmp_path / "second.log", cwd=REPO)
    try:
        deadline = time.monotonic() + 10  # the adopted blocks' KV events follow the worker's ready message
        while second.get_json("/health")["workers"][0]["mirror_blocks"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        client = OpenAI(base_url=second.base_url + "/v1", api_key="-")
        other, cached = complete(client, second.model, prompt, "b")
        assert cached == 0
        plain, cached = complete(client, second.model, prompt, None)
        assert cached == 0
        again, cached = complete(client, second.model, prompt, "a")
        assert cached > 0
        assert answer == other == plain == again
    finally:
        stop_server(second)
