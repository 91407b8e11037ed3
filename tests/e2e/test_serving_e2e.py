"""End-to-end: a real `memserve up` (gateway + worker processes over ZeroMQ, real model)
answers like Hugging Face transformers, concurrently and sequentially, to the official
`openai` client; bad input gets OpenAI errors and the server keeps serving."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import openai
import pytest
import torch
from helpers.live_server import SERVER_NUM_BLOCKS, wait_free_blocks

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "Name two planets."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "How do I reverse a list in Python?"}],
    [{"role": "user", "content": "Give me three tips for better sleep."}],
]
NEW_TOKENS = 32


def hf_greedy(hf, ids: list[int]) -> tuple[str, int]:
    tok, model = hf
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=NEW_TOKENS, do_sample=False)
    new = out[0, len(ids):].tolist()
    return tok.decode(new, skip_special_tokens=True), len(new)


@pytest.fixture(scope="module")
def client(memserve_server):
    return openai.OpenAI(base_url=memserve_server.base_url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def aclient(memserve_server):
    return openai.AsyncOpenAI(base_url=memserve_server.base_url + "/v1", api_key="none", max_retries=0)


def test_completions_match_transformers(hf, client, memserve_server):
    tok = hf[0]
    for prompt in PROMPTS:
        want_text, want_n = hf_greedy(hf, tok(prompt)["input_ids"])
        got = client.completions.create(model=memserve_server.model, prompt=prompt, max_tokens=NEW_TOKENS,
                                        temperature=0)
        assert got.choices[0].text == want_text, prompt
        assert got.usage.completion_tokens == want_n


def test_chat_matches_transformers(hf, client, memserve_server):
    tok = hf[0]
    for messages in CHATS:
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        want_text, want_n = hf_greedy(hf, list(ids))
        got = client.chat.completions.create(model=memserve_server.model, messages=messages,
                                             max_tokens=NEW_TOKENS, temperature=0)
        assert got.choices[0].message.content == want_text, messages
        assert got.usage.completion_tokens == want_n
        assert got.usage.prompt_tokens == len(ids)


def test_concurrent_equals_sequential(aclient, memserve_server):
    prompts = [f"{p} (variant {i})" for i in range(4) for p in PROMPTS[:4]]
    assert len(prompts) == 16

    async def one(p):
        r = await aclient.completions.create(model=memserve_server.model, prompt=p, max_tokens=24, temperature=0)
        return r.choices[0].text

    async def run():
        sequential = [await one(p) for p in prompts]
        concurrent = await asyncio.gather(*(one(p) for p in prompts))
        return sequential, list(concurrent)

    sequential, concurrent = asyncio.run(run())
    assert concurrent == sequential


def test_openai_client_streams(client, memserve_server):
    full = client.chat.completions.create(model=memserve_server.model, messages=CHATS[0], max_tokens=20,
                                          temperature=0)
    chunks = list(client.chat.completions.create(model=memserve_server.model, messages=CHATS[0], max_tokens=20,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [full.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens

    stream = client.completions.create(model=memserve_server.model, prompt=PROMPTS[0], max_tokens=10,
                                       temperature=0, stream=True)
    text = "".join(c.choices[0].text for c in stream)
    once = client.completions.create(model=memserve_server.model, prompt=PROMPTS[0], max_tokens=10, temperature=0)
    assert text == once.choices[0].text


def test_sampling_with_seed_is_reproducible(client, memserve_server):
    def sample():
        return client.completions.create(model=memserve_server.model, prompt=PROMPTS[2], max_tokens=16,
                                         temperature=0.9, top_p=0.95, seed=1234).choices[0].text

    assert sample() == sample()


def test_stop_string_and_max_tokens(client, memserve_server):
    r = client.completions.create(model=memserve_server.model, prompt="1, 2, 3, 4,", max_tokens=30, temperature=0,
                                  stop=[" 7"])
    assert " 7" not in r.choices[0].text and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model=memserve_server.model, prompt="1, 2, 3, 4,", max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def _post(url: str, body: bytes, content_type: str = "application/json") -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": content_type}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_bad_input_gets_openai_errors_and_server_stays_up(client, memserve_server):
    url = memserve_server.base_url + "/v1/completions"
    model = memserve_server.model
    too_long = [17] * 9000
    cases = [
        (b"{not json", 400),
        (json.dumps({"model": model}).encode(), 400),  # missing prompt
        (json.dumps({"model": model, "prompt": 5}).encode(), 400),  # mistyped prompt
        (json.dumps({"model": model, "prompt": "hi", "max_tokens": 0}).encode(), 400),
        (json.dumps({"model": model, "prompt": "hi", "max_tokens": "ten"}).encode(), 400),
        (json.dumps({"model": model, "prompt": too_long, "max_tokens": 4}).encode(), 400),
        (json.dumps({"model": model, "prompt": "hi", "n": 17}).encode(), 400),
        (json.dumps({"model": "no-such-model", "prompt": "hi"}).encode(), 404),
        (b'{"model": "x", "prompt": "' + b"a" * (5 * 1024 * 1024) + b'"}', 413),
    ]
    for body, status in cases:
        got, payload = _post(url, body)
        assert got == status, (body[:80], payload)
        err = payload["error"]
        assert isinstance(err["message"], str) and err["message"] and "type" in err
        ok = client.completions.create(model=model, prompt="Hello", max_tokens=2, temperature=0)
        assert ok.usage.completion_tokens == 2


def test_disconnect_mid_stream_frees_blocks(memserve_server):
    import http.client

    # Idle: every block is free or evictable (stats lag by up to a heartbeat).
    assert wait_free_blocks(memserve_server, lambda f: f == SERVER_NUM_BLOCKS) == SERVER_NUM_BLOCKS
    host, port = memserve_server.base_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = json.dumps({"model": memserve_server.model, "prompt": "Tell me a very long story. " * 40,
                       "max_tokens": 2000, "stream": True, "ignore_eos": True})
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    for _ in range(3):
        assert resp.fp.readline()
    # The request holds blocks while it streams.
    assert wait_free_blocks(memserve_server, lambda f: f < SERVER_NUM_BLOCKS, 10) < SERVER_NUM_BLOCKS
    conn.sock.close()
    conn.close()
    assert wait_free_blocks(memserve_server, lambda f: f == SERVER_NUM_BLOCKS) == SERVER_NUM_BLOCKS


def test_vanishing_temperature_is_greedy_and_fails_no_one(client, memserve_server):
    """temperature 1e-40 rounds to 0 in float32; it once produced NaN and an id outside the
    vocabulary, and the next step failed every request on the worker."""
    greedy = client.completions.create(model=memserve_server.model, prompt=PROMPTS[0], max_tokens=12, temperature=0)

    async def both():
        async with openai.AsyncOpenAI(base_url=memserve_server.base_url + "/v1", api_key="none",
                                      max_retries=0) as aclient:
            tiny = aclient.completions.create(model=memserve_server.model, prompt=PROMPTS[0], max_tokens=12,
                                              temperature=1e-40)
            other = aclient.completions.create(model=memserve_server.model, prompt=PROMPTS[1], max_tokens=12,
                                               temperature=0.8, seed=1)
            return await asyncio.gather(tiny, other)

    tiny, other = asyncio.run(both())
    assert tiny.choices[0].text == greedy.choices[0].text
    assert other.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=memserve_server.model, prompt="hi", max_tokens=2, temperature=2.5)
