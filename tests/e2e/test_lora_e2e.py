"""`memserve up --enable-lora --lora-modules ...` as a team with fine-tunes runs it: a tiny
Qwen2 base built with transformers (SmolLM2's tokenizer beside it), two adapters made
with ``peft``, the model split over two ranks (``-tp 2``: each adapter's A cut by
columns, B by rows with its layer), the official ``openai`` client.

- /v1/models lists each adapter with the base as its ``parent``;
- a completion naming an adapter gives peft's greedy text, naming the base transformers';
- a prompt cached under one adapter is found cached under it again, but never under the
  other adapter or the base (its blocks are named with the adapter);
- an unknown model is a 404 with OpenAI's error object, and the server goes on;
- adapters loaded and unloaded at run time (vLLM's endpoints), bad loads refused."""

from __future__ import annotations

import shutil

import httpx
import openai
import pytest
import torch
from helpers.hf_greedy import transformers_greedy
from helpers.paths import REPO
from helpers.peft_adapters import make_adapter, peft_greedy

from memserve.bench.server_process import start_server, stop_server
from memserve.testing.random_models import save_tiny_model
from memserve.text.tokenizer import Tokenizer

NEW_TOKENS = 6
NAME = "tiny-base"
ADAPTERS = {"support": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj", "o_proj"]},
            "legal": {"r": 4, "lora_alpha": 8, "use_rslora": True, "target_modules": ["gate_proj", "up_proj",
                                                                                        "down_proj", "k_proj"]}}


@pytest.fixture(scope="module")
def served(tmp_path_factory, tokenizer_folder):
    root = tmp_path_factory.mktemp("lora-e2e")
    tok = Tokenizer.from_folder(tokenizer_folder)
    base = save_tiny_model(root / "base", "qwen2", vocab_size=tok.vocab_size)
    for f in tokenizer_folder.iterdir():
        shutil.copy(f, root / "base" / f.name)
    prompt = torch.randint(0, tok.vocab_size, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    expected = {None: tok.decode(transformers_greedy(base, [prompt], NEW_TOKENS)[0])}
    for seed, (name, options) in enumerate(ADAPTERS.items()):
        make_adapter(save_tiny_model(root / "scratch", "qwen2", vocab_size=tok.vocab_size), root / name, seed,
                     **options)
        tokens = peft_greedy(lambda: save_tiny_model(root / "scratch", "qwen2", vocab_size=tok.vocab_size),
                             root / name, [prompt], NEW_TOKENS)
        expected[name] = tok.decode(tokens[0])
    assert len(set(expected.values())) == 3
    make_adapter(save_tiny_model(root / "scratch", "qwen2", vocab_size=tok.vocab_size), root / "big", 0, r=16,
                 target_modules=["q_proj"])
    make_adapter(save_tiny_model(root / "other", "qwen2", vocab_size=tok.vocab_size, hidden_size=64),
                 root / "other-base", 0, r=4, target_modules=["q_proj"])
    handle = start_server(["--model", str(root / "base"), "--served-model-name", NAME, "-tp", "2", "--num-blocks", "64",
                           "--enable-lora", "--max-lora-rank", "8", "--allow-runtime-lora-updating",
                           "--lora-modules", *(f"{n}={root / n}" for n in ADAPTERS)],
                          tmp_path_factory.mktemp("lora-server") / "memserve.log", cwd=REPO)
    yield openai.OpenAI(base_url=handle.base_url + "/v1", api_key="none"), prompt, expected, root
    stop_server(handle)


def complete(client: openai.OpenAI, model: str, prompt: list[int]) -> tuple[str, int]:
    out = client.completions.create(model=model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                    extra_body={"ignore_eos": True})
    details = out.usage.prompt_tokens_details if out.usage else None
    assert out.model == model
    return out.choices[0].text, (details.cached_tokens or 0) if details else 0


def test_models_lists_adapters_with_their_parent(served):
    client = served[0]
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {NAME, *ADAPTERS}
    assert all(models[name].model_extra["parent"] == NAME for name in ADAPTERS)


def test_adapters_give_peft_text_and_keep_their_kv_apart(served):
    client, prompt, expected, _ = served
    text, cached = complete(client, "support", prompt)
    assert (text, cached) == (expected["support"], 0)
    assert complete(client, "support", prompt) == (expected["support"], 32)  # its own blocks, found again
    assert complete(client, "legal", prompt) == (expected["legal"], 0)  # never another adapter's
    assert complete(client, NAME, prompt) == (expected[None], 0)  # nor the base model's
    assert complete(client, NAME, prompt) == (expected[None], 32)


def test_unknown_model_is_404_and_the_server_goes_on(served):
    client, prompt, expected, _ = served
    with pytest.raises(openai.NotFoundError) as exc:
        complete(client, "nope", prompt)
    assert exc.value.body["code"] == "model_not_found"
    assert complete(client, "legal", prompt)[0] == expected["legal"]


def change(client: openai.OpenAI, route: str, **body: str) -> httpx.Response:
    return httpx.post(f"{client.base_url}{route}", json=body, timeout=60)


def test_adapters_loaded_and_unloaded_at_run_time(served):
    """vLLM's runtime endpoints (--allow-runtime-lora-updating), on both ranks: an adapter
    loaded later is listed and serves peft's text; unloaded, it is a 404 and so is a
    second unload; the name loaded again from other weights gives their text and none of
    the old weights' cached KV; bad loads are 400s naming why, and serve nothing."""
    client, prompt, expected, root = served
    assert change(client, "load_lora_adapter", lora_name="late", lora_path=str(root / "support")).status_code == 200
    assert "late" in {m.id for m in client.models.list().data}
    assert complete(client, "late", prompt) == (expected["support"], 0)
    assert complete(client, "late", prompt) == (expected["support"], 32)
    reply = change(client, "load_lora_adapter", lora_name="late", lora_path=str(root / "legal"))
    assert reply.status_code == 400 and "already been loaded" in reply.json()["error"]["message"]
    assert change(client, "unload_lora_adapter", lora_name="late").status_code == 200
    with pytest.raises(openai.NotFoundError):
        complete(client, "late", prompt)
    assert change(client, "unload_lora_adapter", lora_name="late").status_code == 404
    assert change(client, "load_lora_adapter", lora_name="late", lora_path=str(root / "legal")).status_code == 200
    assert complete(client, "late", prompt) == (expected["legal"], 0)  # other weights: other blocks
    for path, why in ((root / "big", "rank 16 is over --max-lora-rank 8"), (root / "other-base", "another base model"),
                      (root / "base", "not a LoRA adapter")):
        reply = change(client, "load_lora_adapter", lora_name="bad", lora_path=str(path))
        assert reply.status_code == 400 and why in reply.json()["error"]["message"], reply.text
    assert change(client, "load_lora_adapter", lora_name="bad").status_code == 400  # no lora_path
    assert "bad" not in {m.id for m in client.models.list().data}
    assert complete(client, "support", prompt)[0] == expected["support"]
