"""Penalties, logit_bias and min_tokens through a real `memserve up`, with the `openai`
client: greedy outputs equal the per-row reference of tests/model/test_penalties.py applied to
Hugging Face transformers' logits step by step, and each knob does what clients use it for
(a frequency penalty breaks a loop, a +100 bias forces a token, min_tokens defers EOS).
Every response validates against OpenAI's schemas."""

from __future__ import annotations

import openai
import orjson
import pytest
import torch
from helpers.openai_schema import assert_valid, chunk_schema, generate, sse_chunks
from helpers.penalties_reference import reference

from memserve.ipc.messages import SamplingParams
from memserve.workers.model.penalties import TokenHistory

LOOP_PROMPT = "I like cats. I like cats. I like cats."  # greedy continues the loop
STEPS = 6


@pytest.fixture(scope="module")
def client(memserve_server):
    return openai.OpenAI(base_url=memserve_server.base_url + "/v1", api_key="none", max_retries=0)


def reference_greedy(hf, prompt_ids: list[int], params: SamplingParams) -> list[int]:
    """Greedy tokens of transformers' float32 logits, adjusted by the plain reference."""
    tok, model = hf
    history = TokenHistory(list(prompt_ids), sorted(set(params.stop_token_ids) | {tok.eos_token_id}))
    ids = list(prompt_ids)
    with torch.inference_mode():
        for _ in range(STEPS):
            logits = model(torch.tensor([ids])).logits[0, -1].float().tolist()
            adjusted = reference(logits, params, history)
            token = max(range(len(adjusted)), key=adjusted.__getitem__)
            if token == tok.eos_token_id:
                break
            ids.append(token)
            history.output_ids.append(token)
    return ids[len(prompt_ids):]


@pytest.fixture(scope="module")
def plain_greedy(hf) -> list[int]:
    return reference_greedy(hf, hf[0](LOOP_PROMPT)["input_ids"], SamplingParams(temperature=0.0))


@pytest.mark.parametrize("fields", [
    {"frequency_penalty": 1.5, "presence_penalty": 0.5, "logit_bias": {"28": 6.5, "314": -100}},
    pytest.param({"repetition_penalty": 1.3}, marks=pytest.mark.slow),
    pytest.param({"frequency_penalty": -0.5, "presence_penalty": 2.0, "repetition_penalty": 0.9},
                 marks=pytest.mark.slow),
], ids=["frequency+presence+bias", "repetition", "mixed-signs"])
def test_greedy_equals_reference_on_transformers_logits(hf, plain_greedy, client, memserve_server,
                                                        fields):
    tok, _ = hf
    prompt_ids = tok(LOOP_PROMPT)["input_ids"]
    params = SamplingParams(temperature=0.0, presence_penalty=fields.get("presence_penalty", 0.0),
                            frequency_penalty=fields.get("frequency_penalty", 0.0),
                            repetition_penalty=fields.get("repetition_penalty", 1.0),
                            logit_bias={int(k): v for k, v in fields.get("logit_bias", {}).items()})
    want = reference_greedy(hf, prompt_ids, params)
    assert want != plain_greedy, "the case must change the greedy output to test anything"
    got = client.completions.create(model=memserve_server.model, prompt=prompt_ids, max_tokens=STEPS, temperature=0,
                                    extra_body=fields)
    assert got.choices[0].text == tok.decode(want)


def test_frequency_penalty_breaks_a_greedy_loop(client, memserve_server):
    def text(**fields) -> str:
        return client.completions.create(model=memserve_server.model, prompt=LOOP_PROMPT, max_tokens=14,
                                         temperature=0, **fields).choices[0].text

    assert text().count("I'm a cat") >= 3
    assert text(frequency_penalty=2.0).count("I'm a cat") == 1


def test_logit_bias_forces_and_bans_tokens(hf, client, memserve_server):
    tok, _ = hf
    forced = tok(" banana")["input_ids"]
    assert len(forced) == 1
    out = client.completions.create(model=memserve_server.model, prompt="Hello", max_tokens=5, temperature=0.7, seed=3,
                                    logit_bias={str(forced[0]): 100})
    assert out.choices[0].text == " banana" * 5
    plain = client.completions.create(model=memserve_server.model, prompt="Hello", max_tokens=1, temperature=0)
    first = tok(plain.choices[0].text)["input_ids"][0]
    banned = client.completions.create(model=memserve_server.model, prompt="Hello", max_tokens=1, temperature=0,
                                       logit_bias={str(first): -100})
    assert banned.choices[0].text != plain.choices[0].text


def test_min_tokens_defers_eos(client, memserve_server):
    messages = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
    short = client.chat.completions.create(model=memserve_server.model, messages=messages, max_tokens=30, temperature=0)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 6
    longer = client.chat.completions.create(model=memserve_server.model, messages=messages, max_tokens=14,
                                            temperature=0, extra_body={"min_tokens": 12})
    assert longer.usage.completion_tokens >= 12
    assert longer.choices[0].message.content.startswith(short.choices[0].message.content.rstrip("."))


@pytest.mark.parametrize("path,fields,schema", [
    ("/v1/completions", {"prompt": LOOP_PROMPT}, "CreateCompletionResponse"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Say hello."}]}, "CreateChatCompletionResponse"),
], ids=["completion", "chat"])
def test_responses_with_adjustments_follow_the_schema(memserve_server, path, fields, schema):
    adjustments = {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1,
                   "logit_bias": {"28": 3}, "min_tokens": 2}
    status, _, raw = generate(memserve_server, path, {**fields, **adjustments, "max_tokens": 6})
    assert status == 200, raw
    assert_valid(orjson.loads(raw), schema)
    status, _, raw = generate(memserve_server, path, {**fields, **adjustments, "max_tokens": 6, "stream": True})
    assert status == 200, raw
    for chunk in sse_chunks(raw):
        assert_valid(chunk, chunk_schema(schema, chunk))
