"""``n > 1`` through a real `memserve up`, with the `openai` client: choice i of
``n, seed=S`` is the request ``seed=S+i`` alone (so it is reproducible, and the fork from
the shared prompt KV changes no token), usage counts the prompt once, streams interleave
the choices by ``index``, the prompt's blocks are computed and held once (the worker's
free-block count proves it), and no block leaks when requests finish or are aborted."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import random
import time

import openai
import orjson
import pytest
from helpers.live_server import SERVER_NUM_BLOCKS, free_device_blocks, wait_free_blocks
from helpers.openai_schema import assert_valid, generate, sse_chunks

BLOCK_SIZE = 16
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def client(memserve_server):
    return openai.OpenAI(base_url=memserve_server.base_url + "/v1", api_key="none", max_retries=0)


def test_choice_i_is_the_request_seeded_s_plus_i(client, memserve_server):
    """Also: a stop string ends its own choice only, and usage counts the prompt once."""
    fields = {"prompt": PROMPT, "n": 4, "seed": 11, "max_tokens": 8, "temperature": 1.0, "stop": [" the "]}
    status, _, raw = generate(memserve_server, "/v1/completions", fields)
    assert status == 200, raw
    first = orjson.loads(raw)
    assert_valid(first, "CreateCompletionResponse")
    choices = [(c["index"], c["text"], c["finish_reason"]) for c in first["choices"]]
    assert [c[0] for c in choices] == [0, 1, 2, 3] and len({c[1] for c in choices}) > 1
    again = client.completions.create(model=memserve_server.model, **fields)
    assert [(c.index, c.text, c.finish_reason) for c in again.choices] == choices
    singles = [client.completions.create(model=memserve_server.model, **{**fields, "n": 1, "seed": 11 + i})
               for i in range(4)]
    assert [(i, s.choices[0].text, s.choices[0].finish_reason) for i, s in enumerate(singles)] == choices
    assert {c[2] for c in choices} == {"stop", "length"}
    assert first["usage"]["prompt_tokens"] == singles[0].usage.prompt_tokens
    assert first["usage"]["completion_tokens"] == sum(s.usage.completion_tokens for s in singles)


def test_chat_stream_interleaves_choices_by_index(memserve_server):
    fields = {"messages": [{"role": "user", "content": "Name a colour."}], "n": 2, "seed": 5, "max_tokens": 8,
              "temperature": 1.0}
    status, _, raw = generate(memserve_server, "/v1/chat/completions", fields)
    assert status == 200, raw
    whole = orjson.loads(raw)
    assert_valid(whole, "CreateChatCompletionResponse")
    status, _, raw = generate(memserve_server, "/v1/chat/completions",
                              {**fields, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200, raw
    chunks = sse_chunks(raw)
    texts, finish = ["", ""], {}
    for chunk in chunks:
        assert_valid(chunk, "CreateChatCompletionStreamResponse")
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["delta"].get("content", "")
            if choice["finish_reason"]:
                finish[choice["index"]] = choice["finish_reason"]
    assert texts == [c["message"]["content"] for c in whole["choices"]]
    assert finish == {c["index"]: c["finish_reason"] for c in whole["choices"]}
    for key in ("prompt_tokens", "completion_tokens"):
        assert chunks[-1]["usage"][key] == whole["usage"][key]


def test_choices_share_the_prompt_blocks(client, memserve_server):
    """A prompt of 10 full blocks and one token: with one prefill the 4 choices hold the
    10 shared blocks plus at most 11 blocks each (160 tokens); 4 prefills would hold 84.
    The answers run long enough (seconds) for the heartbeats' block counts to see them."""
    assert wait_free_blocks(memserve_server, lambda f: f == SERVER_NUM_BLOCKS) == SERVER_NUM_BLOCKS
    rng = random.Random(time.time_ns())
    prompt = [rng.randrange(1000, 20000) for _ in range(10 * BLOCK_SIZE + 1)]
    shared = 10
    max_tokens = 160
    bound = shared + 4 * (-(-(len(prompt) + max_tokens) // BLOCK_SIZE) - shared)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        done = pool.submit(client.completions.create, model=memserve_server.model, prompt=prompt, n=4, seed=1,
                           max_tokens=max_tokens, temperature=1.0, extra_body={"ignore_eos": True})
        used = []
        while not done.done():
            used.append(SERVER_NUM_BLOCKS - free_device_blocks(memserve_server))
            time.sleep(0.05)
        out = done.result()
    assert [c.finish_reason for c in out.choices] == ["length"] * 4
    assert max(used) > shared, "the request was never seen holding blocks"
    assert max(used) <= bound, (max(used), bound)
    assert wait_free_blocks(memserve_server, lambda f: f == SERVER_NUM_BLOCKS) == SERVER_NUM_BLOCKS


def test_disconnect_frees_every_choice(memserve_server):
    assert wait_free_blocks(memserve_server, lambda f: f == SERVER_NUM_BLOCKS) == SERVER_NUM_BLOCKS
    host, port = memserve_server.base_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = json.dumps({"model": memserve_server.model, "prompt": "Tell me a very long story. " * 20, "n": 4,
                       "max_tokens": 2000, "stream": True, "ignore_eos": True, "temperature": 1.0})
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    indexes = set()
    while len(indexes) < 4:
        line = resp.fp.readline()
        if line.startswith(b"data: {"):
            indexes.update(c["index"] for c in json.loads(line[6:])["choices"])
    assert wait_free_blocks(memserve_server, lambda f: f < SERVER_NUM_BLOCKS, 10) < SERVER_NUM_BLOCKS
    conn.sock.close()
    conn.close()
    assert wait_free_blocks(memserve_server, lambda f: f == SERVER_NUM_BLOCKS) == SERVER_NUM_BLOCKS
