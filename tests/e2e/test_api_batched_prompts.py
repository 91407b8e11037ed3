"""/v1/completions with a batch of prompts (strings or token-id lists), against a real
``memserve up``: each prompt is its own choice, at its index in the batch, and answers
exactly what it answers alone; usage is the batch's sum; streaming interleaves choices."""

from __future__ import annotations

import openai
import orjson
import pytest
from helpers.openai_schema import COMPLETION_CHUNK, assert_valid, request, sse_chunks

from memserve.bench.server_process import ServerHandle

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of"]
FIELDS = {"max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def client(memserve_server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=memserve_server.base_url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def alone(client: openai.OpenAI, memserve_server: ServerHandle) -> list:
    return [client.completions.create(model=memserve_server.model, prompt=p, **FIELDS) for p in PROMPTS]


def post(server: ServerHandle, body: dict) -> tuple[int, bytes]:
    status, _, raw = request(server, "POST", "/v1/completions", orjson.dumps({"model": server.model, **body}))
    return status, raw


def test_string_batch_answers_each_prompt_in_order(client, memserve_server: ServerHandle, alone: list) -> None:
    status, raw = post(memserve_server, {"prompt": PROMPTS, **FIELDS})
    assert status == 200, raw
    body = orjson.loads(raw)
    assert_valid(body, "CreateCompletionResponse")
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["text"] for c in body["choices"]] == [r.choices[0].text for r in alone]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert body["usage"][key] == sum(getattr(r.usage, key) for r in alone)


def test_token_id_batch_equals_string_batch(client, memserve_server: ServerHandle, alone: list) -> None:
    ids = [orjson.loads(request(memserve_server, "POST", "/tokenize", orjson.dumps({"prompt": p}))[2])["tokens"]
           for p in PROMPTS]
    got = client.completions.create(model=memserve_server.model, prompt=ids[::-1], **FIELDS)
    assert [c.text for c in got.choices] == [r.choices[0].text for r in alone][::-1]
    assert got.usage.prompt_tokens == sum(len(i) for i in ids)


def test_streamed_batch_interleaves_choices(memserve_server: ServerHandle, alone: list) -> None:
    status, _, raw = request(memserve_server, "POST", "/v1/completions", orjson.dumps(
        {"model": memserve_server.model, "prompt": PROMPTS, "stream": True, "stream_options": {"include_usage": True},
         **FIELDS}))
    assert status == 200, raw
    chunks = sse_chunks(raw)
    texts, finishes = ["", "", ""], [[], [], []]
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["text"]
        if choice["finish_reason"] is not None:
            finishes[choice["index"]].append(choice["finish_reason"])
        assert_valid(chunk, COMPLETION_CHUNK if choice["finish_reason"] is None else "CreateCompletionResponse")
    assert texts == [r.choices[0].text for r in alone]
    assert finishes == [[r.choices[0].finish_reason] for r in alone]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == sum(r.usage.completion_tokens for r in alone)


def test_scoring_batch_as_lm_eval_sends_it(memserve_server: ServerHandle) -> None:
    """echo + logprobs over a batch: each choice scores its own prompt."""
    def score(prompt):
        status, raw = post(memserve_server, {"prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 1,
                                             "echo": True})
        assert status == 200, raw
        return [c["logprobs"]["token_logprobs"] for c in orjson.loads(raw)["choices"]]

    batch = score(PROMPTS)
    alone = [score(p)[0] for p in PROMPTS]
    assert [len(b) for b in batch] == [len(a) for a in alone]
    for got, want in zip(batch, alone):  # batched rows differ by float32 reduction order only (~1e-5)
        assert got[0] is None and got[1:] == pytest.approx(want[1:], abs=1e-4)


@pytest.mark.parametrize("prompt", [["a", [1, 2]], [[1], "b"], [[1, -2]], [[]]], ids=["str-ids", "ids-str",
                                                                                      "negative", "empty"])
def test_malformed_batches_are_refused(memserve_server: ServerHandle, prompt: list) -> None:
    status, raw = post(memserve_server, {"prompt": prompt, "max_tokens": 1})
    assert status == 400, raw
    body = orjson.loads(raw)
    assert_valid(body, "ErrorResponse")
    assert body["error"]["param"] == "prompt"
