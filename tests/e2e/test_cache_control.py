"""``cache_control`` on chat messages against a real `memserve up`: the marked prefix (up
to and including the marked message, not the rest) is pinned, as ``/metrics`` shows per
tier; a request whose pin would pass ``--max-pinned-fraction`` is served unpinned, with a
header naming the cap; a malformed marker gets 400 naming its place."""

from __future__ import annotations

import time
import urllib.request
import uuid

import openai
import pytest
from helpers.live_server import SERVER_NUM_BLOCKS
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

BLOCK_SIZE = 16
CAP_BLOCKS = int(0.25 * SERVER_NUM_BLOCKS)  # the default --max-pinned-fraction of the device tier
SYSTEM = "You answer questions about rivers, bridges and the towns along them, briefly. " * 6


def pinned_device_blocks(base_url: str) -> int:
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return int(sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "memserve_kv_pinned_blocks" and s.labels["tier"] == "device"))


def wait_pinned(base_url: str, at_least: int, timeout_s: float = 10.0) -> int:
    """The pinned count once the worker's heartbeat reports ``at_least`` (it lags a second)."""
    deadline = time.monotonic() + timeout_s
    while True:
        n = pinned_device_blocks(base_url)
        if n >= at_least or time.monotonic() > deadline:
            return n
        time.sleep(0.2)


def tokens_of(client: OpenAI, base_url: str, messages: list[dict]) -> int:
    r = client.post(base_url + "/tokenize", cast_to=object,
                    body={"messages": messages, "add_generation_prompt": False})
    return r["count"]


def test_the_marked_prefix_is_pinned_and_the_rest_is_not(memserve_server):
    base = memserve_server.base_url
    client = OpenAI(base_url=base + "/v1", api_key="-", max_retries=0)
    system = f"[{uuid.uuid4().hex}] {SYSTEM}"
    question = "Which bridges were built first, and why there? " * 12
    marked = [{"role": "system", "content": system, "cache_control": {"type": "ephemeral", "ttl": "5m"}},
              {"role": "user", "content": question}]
    before = pinned_device_blocks(base)
    client.chat.completions.create(model=memserve_server.model, messages=marked, max_tokens=2, temperature=0)
    head_blocks = tokens_of(client, base, marked[:1]) // BLOCK_SIZE
    whole_blocks = tokens_of(client, base, marked) // BLOCK_SIZE
    assert 0 < head_blocks < whole_blocks - 2
    pinned = wait_pinned(base, before + head_blocks)
    assert pinned - before == head_blocks  # the system message's blocks, not the question's


def test_a_pin_past_the_cap_is_served_unpinned_with_a_header_naming_the_cap(memserve_server):
    base = memserve_server.base_url
    client = OpenAI(base_url=base + "/v1", api_key="-", max_retries=0)
    huge = f"[{uuid.uuid4().hex}] " + "Every town kept a ledger of its bridge tolls, year by year. " * 180
    messages = [{"role": "user", "content": [{"type": "text", "text": huge, "cache_control": {"type": "ephemeral"}}]}]
    assert tokens_of(client, base, messages) > CAP_BLOCKS * BLOCK_SIZE
    before = pinned_device_blocks(base)
    for stream in (False, True):
        raw = client.chat.completions.with_raw_response.create(model=memserve_server.model, messages=messages,
                                                               max_tokens=2, temperature=0, stream=stream)
        refused = raw.headers.get("x-memserve-cache-pin", "")
        assert refused.startswith("refused; ") and "--max-pinned-fraction" in refused, refused
        assert f"cap of {CAP_BLOCKS}" in refused
        answer = raw.parse()
        if stream:
            assert [c for c in answer if c.choices and c.choices[0].finish_reason == "length"]
        else:
            assert answer.choices[0].finish_reason == "length"
    assert pinned_device_blocks(base) == before  # nothing of it was pinned
    plain = [{"role": "user", "content": huge}]
    raw = client.chat.completions.with_raw_response.create(model=memserve_server.model, messages=plain,
                                                           max_tokens=2, temperature=0)
    assert "x-memserve-cache-pin" not in raw.headers


@pytest.mark.parametrize("marker, param", [
    ({"type": "persistent"}, "messages[0].cache_control"),
    ({"type": "ephemeral", "ttl": "2d"}, "messages[0].cache_control"),
    ("yes", "messages[0].cache_control"),
])
def test_a_malformed_marker_gets_400(memserve_server, marker, param):
    client = OpenAI(base_url=memserve_server.base_url + "/v1", api_key="-", max_retries=0)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=memserve_server.model, max_tokens=2,
                                       messages=[{"role": "user", "content": "hi", "cache_control": marker}])
    assert bad.value.body["param"] == param
