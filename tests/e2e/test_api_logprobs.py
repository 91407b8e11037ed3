"""Logprobs and echo against a real ``memserve up`` with the ``openai`` client, checked
against Hugging Face transformers on the same weights (float32), plus the worker's
prompt logprobs over chunked prefill on an in-process engine.

Tolerance: both sides run the same float32 weights; they differ only in the order of
floating-point reductions (paged attention vs eager attention, batch composition), which
moves a log-probability of magnitude <= 30 by ~1e-5 after 30 layers and a 49k-way
logsumexp. ``ATOL = 1e-4`` allows that, while any real defect (a position off by one, the
wrong token scored, logits taken after temperature) moves values by 1e-1 or more."""

from __future__ import annotations

import openai
import orjson
import pytest
import torch
from helpers.openai_schema import COMPLETION_CHUNK, assert_valid, request, sse_chunks

from memserve.bench.server_process import ServerHandle
from memserve.config import EngineConfig
from memserve.ipc.messages import AddRequest, SamplingParams
from memserve.model_files.gguf_convert import ensure_model_dir
from memserve.workers.engine.engine import Engine
from memserve.workers.real_engine import build_engine

ATOL = 1e-4
CHUNK = 24  # tokens per step of the chunked-prefill engine
PROMPT = "The three primary colors are red, yellow and"
CHAT = [{"role": "user", "content": "Name a color."}]
# A prompt over several 16-token blocks, so a second request finds it cached.
LONG_PROMPT = ("In the quiet town of Eldermere, the old lighthouse keeper kept a journal of every ship that "
               "passed. Each entry noted the weather, the colour of the sails and the song the sailors sang. "
               "One winter night a ship with silver sails appeared, and nobody aboard was singing.")


@pytest.fixture(scope="module")
def client(memserve_server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=memserve_server.base_url + "/v1", api_key="none", max_retries=0)


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] log-softmax of transformers' logits: row i predicts ids[i + 1]."""
    _, model = hf
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def tokenize(server: ServerHandle, **body) -> list[int]:
    status, _, raw = request(server, "POST", "/tokenize", orjson.dumps(body))
    assert status == 200, raw
    return orjson.loads(raw)["tokens"]


def hf_greedy_ids(hf, ids: list[int], num: int) -> list[int]:
    """transformers' greedy continuation: the ids behind memserve's greedy tokens."""
    _, model = hf
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=num, do_sample=False)
    return out[0, len(ids):].tolist()


def without_echo_nulls(body: dict) -> dict:
    """OpenAI gives an echoed prompt's first token null logprobs (nothing predicts it),
    which the published schema's arrays of numbers and objects do not allow: that entry,
    and only that one, is dropped before validating."""
    choices = []
    for choice in body["choices"]:
        logprobs = choice["logprobs"]
        if logprobs and logprobs["token_logprobs"] and logprobs["token_logprobs"][0] is None:
            assert logprobs["top_logprobs"][0] is None
            logprobs = {key: values[1:] for key, values in logprobs.items()}
        choices.append({**choice, "logprobs": logprobs})
    return {**body, "choices": choices}


def post_json(server: ServerHandle, path: str, body: dict) -> dict:
    status, _, raw = request(server, "POST", path, orjson.dumps({"model": server.model, **body}))
    assert status == 200, raw
    return orjson.loads(raw)


def post_stream(server: ServerHandle, path: str, body: dict) -> list[dict]:
    status, _, raw = request(server, "POST", path, orjson.dumps({"model": server.model, "stream": True, **body}))
    assert status == 200, raw
    return sse_chunks(raw)


# ----------------------------------------------------------------------------- chat


def test_chat_logprobs_match_transformers(hf, memserve_server: ServerHandle) -> None:
    body = post_json(memserve_server, "/v1/chat/completions",
                     {"messages": CHAT, "max_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": 5})
    assert_valid(body, "CreateChatCompletionResponse")
    content = body["choices"][0]["logprobs"]["content"]
    tok = hf[0]
    prompt = tokenize(memserve_server, messages=CHAT)
    out_ids = hf_greedy_ids(hf, prompt, 5)
    assert [e["token"] for e in content] == [tok.decode([i]) for i in out_ids]
    assert [e["bytes"] for e in content] == [list(tok.decode([i]).encode()) for i in out_ids]  # no split characters
    want = hf_logprobs(hf, prompt + out_ids)[len(prompt) - 1:-1]
    for entry, row, token_id in zip(content, want, out_ids):
        assert entry["logprob"] == pytest.approx(row[token_id].item(), abs=ATOL)
        top = entry["top_logprobs"]
        values = [t["logprob"] for t in top]
        assert len(top) == 5 and values == sorted(values, reverse=True)
        assert top[0]["token"] == entry["token"]  # greedy: the chosen token is the most likely
        assert values == pytest.approx(row.topk(5).values.tolist(), abs=ATOL)
    assert tok.decode(out_ids, skip_special_tokens=True) == body["choices"][0]["message"]["content"]


def test_chat_logprobs_without_top(client: openai.OpenAI, memserve_server: ServerHandle) -> None:
    got = client.chat.completions.create(model=memserve_server.model, messages=CHAT, max_tokens=3, temperature=0,
                                         logprobs=True)
    content = got.choices[0].logprobs.content
    assert len(content) == got.usage.completion_tokens and all(e.top_logprobs == [] for e in content)
    plain = client.chat.completions.create(model=memserve_server.model, messages=CHAT, max_tokens=1, temperature=0)
    assert plain.choices[0].logprobs is None


def test_raw_logprobs_ignore_temperature(memserve_server: ServerHandle) -> None:
    """Sampled at temperature 1.5, the reported values are still the model's own."""
    greedy = post_json(memserve_server, "/v1/completions",
                       {"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "logprobs": 5})
    hot = post_json(memserve_server, "/v1/completions",
                    {"prompt": PROMPT, "max_tokens": 1, "temperature": 1.5, "seed": 3, "logprobs": 5})
    top_greedy = greedy["choices"][0]["logprobs"]["top_logprobs"][0]
    top_hot = hot["choices"][0]["logprobs"]["top_logprobs"][0]
    shared = set(top_greedy) & set(top_hot)
    assert len(shared) >= 5
    assert all(top_hot[t] == pytest.approx(top_greedy[t], abs=ATOL) for t in shared)


@pytest.mark.parametrize("path,fields", [
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 3}),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 3}),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 3, "echo": True}),
], ids=["chat", "completion", "completion-echo"])
def test_streamed_logprobs_equal_whole(memserve_server: ServerHandle, path: str, fields: dict) -> None:
    fields = {**fields, "max_tokens": 5, "temperature": 0}
    whole = post_json(memserve_server, path, fields)["choices"][0]["logprobs"]
    chunks = post_stream(memserve_server, path, fields)
    pieces = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    if path == "/v1/chat/completions":
        for chunk in chunks:
            assert_valid(chunk, "CreateChatCompletionStreamResponse")
        assert [e for p in pieces for e in p["content"]] == whole["content"]
    else:
        assert {key: [v for p in pieces for v in p[key]] for key in whole} == whole
        for chunk in chunks:
            streaming = any(c["finish_reason"] is None for c in chunk["choices"])
            assert_valid(without_echo_nulls(chunk), COMPLETION_CHUNK if streaming else "CreateCompletionResponse")


# ----------------------------------------------------------------------------- completions and echo


def test_completion_logprobs_match_transformers(hf, memserve_server: ServerHandle) -> None:
    body = post_json(memserve_server, "/v1/completions",
                     {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 5, "echo": True})
    assert_valid(without_echo_nulls(body), "CreateCompletionResponse")
    choice = body["choices"][0]
    logprobs = choice["logprobs"]
    prompt = tokenize(memserve_server, prompt=PROMPT)
    assert choice["text"].startswith(PROMPT) and len(logprobs["tokens"]) == len(prompt) + 4
    ids = prompt + hf_greedy_ids(hf, prompt, 4)
    assert [hf[0].decode([i]) for i in ids] == logprobs["tokens"]
    want = hf_logprobs(hf, ids)
    for pos in range(1, len(ids)):
        row = want[pos - 1]
        assert logprobs["token_logprobs"][pos] == pytest.approx(row[ids[pos]].item(), abs=ATOL), pos
        top = logprobs["top_logprobs"][pos]
        best = row.topk(5)
        expected = {hf[0].decode([i]): v for i, v in zip(best.indices.tolist(), best.values.tolist())}
        expected.setdefault(logprobs["tokens"][pos], row[ids[pos]].item())  # the chosen one is always there
        assert top.keys() == expected.keys() and all(top[k] == pytest.approx(v, abs=ATOL) for k, v in expected.items())
        if pos >= len(prompt):  # greedy: the generated token is the most likely
            assert logprobs["token_logprobs"][pos] == max(top.values())
    offsets = logprobs["text_offset"]
    assert [choice["text"][o:o + len(t)] for o, t in zip(offsets, logprobs["tokens"])] == logprobs["tokens"]


def test_echo_with_zero_max_tokens_scores_the_prompt(hf, memserve_server: ServerHandle) -> None:
    """What lm-evaluation-harness sends: the prompt back with its logprobs, nothing generated."""
    prompt = tokenize(memserve_server, prompt=PROMPT)
    body = post_json(memserve_server, "/v1/completions",
                     {"prompt": prompt, "max_tokens": 0, "temperature": 0, "logprobs": 1, "echo": True})
    assert_valid(without_echo_nulls(body), "CreateCompletionResponse")
    choice = body["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == len(prompt)
    got = choice["logprobs"]["token_logprobs"]
    assert len(got) == len(prompt) and got[0] is None
    want = hf_logprobs(hf, prompt)
    assert got[1:] == pytest.approx([want[i - 1, t].item() for i, t in enumerate(prompt) if i], abs=ATOL)
    both = post_json(memserve_server, "/v1/completions",  # n > 1: one prefill, every choice gets its scores
                     {"prompt": prompt, "max_tokens": 2, "temperature": 0, "logprobs": 1, "echo": True, "n": 2})
    for c in both["choices"]:
        assert c["logprobs"]["token_logprobs"][1:len(prompt)] == pytest.approx(got[1:], abs=ATOL)
    echo_only = post_json(memserve_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0, "echo": True})
    assert echo_only["choices"][0]["text"] == PROMPT and echo_only["choices"][0]["logprobs"] is None


def test_cached_prefix_gives_the_same_prompt_logprobs(memserve_server: ServerHandle) -> None:
    """A prompt whose blocks are cached is computed whole when its logprobs are asked for."""
    def score() -> dict:
        return post_json(memserve_server, "/v1/completions",
                         {"prompt": LONG_PROMPT, "max_tokens": 0, "logprobs": 2, "echo": True})

    uncached = score()
    plain = post_json(memserve_server, "/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 1})
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32  # the prefix is in the cache
    cached = score()
    assert cached["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # ... and was not used
    got, want = cached["choices"][0]["logprobs"], uncached["choices"][0]["logprobs"]
    assert got["tokens"] == want["tokens"]
    assert got["token_logprobs"][1:] == pytest.approx(want["token_logprobs"][1:], abs=ATOL)


# ----------------------------------------------------------------------------- the worker, chunk by chunk


@pytest.fixture(scope="module")
def chunking_engine() -> Engine:
    """Prefill in small chunks, so a prompt's logprobs span several steps; float32 products
    (``--quantization none``), as the server's, to compare with transformers."""
    model_dir = ensure_model_dir(None)
    cfg = EngineConfig(model=str(model_dir), dtype="float32", num_blocks=64, max_num_batched_tokens=CHUNK,
                       quantization="none")
    return build_engine(cfg, model_dir)


def test_prompt_logprobs_across_chunks_and_batches(hf, chunking_engine: Engine) -> None:
    """Two requests prefilled together over many chunks (their last rows wait for the next
    chunk's first token) report every prompt position once, as transformers does."""
    tok = hf[0]
    prompts = {"a": tok.encode(LONG_PROMPT), "b": tok.encode(LONG_PROMPT[::-1])}
    params = SamplingParams(max_tokens=2, temperature=0.0, logprobs=3, prompt_logprobs=4)
    for rid, ids in prompts.items():
        assert chunking_engine.add_request(AddRequest(rid, ids, params)) is None
    prompt_lps: dict[str, list] = {}
    sampled: dict[str, list] = {rid: [] for rid in prompts}
    while chunking_engine.has_work:
        for out in chunking_engine.step():
            if out.prompt_logprobs is not None:
                assert out.request_id not in prompt_lps  # sent once
                prompt_lps[out.request_id] = out.prompt_logprobs
            sampled[out.request_id] += [(t, lp) for t, lp in zip(out.new_token_ids, out.logprobs)]
    for rid, ids in prompts.items():
        assert len(ids) > 2 * CHUNK
        full = ids + [t for t, _ in sampled[rid]]
        want = hf_logprobs(hf, full)
        got = prompt_lps[rid] + [lp for _, lp in sampled[rid]]
        assert len(got) == len(full) - 1
        for pos, (logprob, top_ids, top_lps) in enumerate(got, start=1):
            row = want[pos - 1]
            assert logprob == pytest.approx(row[full[pos]].item(), abs=ATOL), (rid, pos)
            k = 4 if pos < len(ids) else 3
            assert top_lps == pytest.approx(row.topk(k).values.tolist(), abs=ATOL)
            assert top_lps == pytest.approx(row[top_ids].tolist(), abs=ATOL)
