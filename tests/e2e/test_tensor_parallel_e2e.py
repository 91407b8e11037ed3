"""`memserve up --tensor-parallel-size 2` as a user runs it: a tiny Qwen2 built with
transformers (random weights, SmolLM2's tokenizer beside them), one worker of two rank
processes, the official ``openai`` client. Greedy completions are transformers' tokens;
the same prompts again find their prefix cached; /health shows the worker's ranks and
/metrics the time its steps spent in collectives."""

from __future__ import annotations

import shutil
import urllib.request

import openai
import pytest
import torch
from helpers.hf_greedy import transformers_greedy
from helpers.paths import REPO

from memserve.bench.server_process import start_server, stop_server
from memserve.testing.random_models import save_tiny_model
from memserve.text.tokenizer import Tokenizer

NEW_TOKENS = 8
NAME = "tiny-qwen2"


@pytest.fixture(scope="module")
def served(tmp_path_factory, tokenizer_folder):
    folder = tmp_path_factory.mktemp("tiny-tp")
    tok = Tokenizer.from_folder(tokenizer_folder)
    hf = save_tiny_model(folder, "qwen2", vocab_size=tok.vocab_size)
    for f in tokenizer_folder.iterdir():
        shutil.copy(f, folder / f.name)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, tok.vocab_size, (n,), generator=gen).tolist() for n in (12, 40, 70)]
    handle = start_server(["--model", str(folder), "--served-model-name", NAME, "-tp", "2", "--num-blocks", "64"],
                          tmp_path_factory.mktemp("tp-server") / "memserve.log", cwd=REPO)
    yield handle, tok, prompts, transformers_greedy(hf, prompts, NEW_TOKENS)
    stop_server(handle)


def test_greedy_text_is_transformers_and_a_repeat_hits_the_cache(served):
    handle, tok, prompts, reference = served
    client = openai.OpenAI(base_url=handle.base_url + "/v1", api_key="none")
    for attempt in ("cold", "repeat"):
        for prompt, tokens in zip(prompts, reference):
            out = client.completions.create(model=NAME, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                            extra_body={"ignore_eos": True})
            assert out.choices[0].text == tok.decode(tokens), attempt
            cached = out.usage.prompt_tokens_details.cached_tokens if out.usage.prompt_tokens_details else 0
            assert (cached > 0) == (attempt == "repeat" and len(prompt) > 16), (attempt, len(prompt), cached)


def test_health_shows_ranks_and_metrics_the_collectives(served):
    handle = served[0]
    worker = handle.get_json("/health")["workers"][0]
    assert worker["tensor_parallel_size"] == 2 and worker["device"] == "cpu"
    with urllib.request.urlopen(handle.base_url + "/metrics", timeout=10) as r:
        metrics = r.read().decode()
    line = next(m for m in metrics.splitlines() if m.startswith("memserve_tensor_parallel_comm_seconds_total"))
    assert float(line.split()[-1]) > 0
