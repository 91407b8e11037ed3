"""vLLM's /tokenize and /detokenize on a real ``memserve up``: the ids are the ones the
server generates from (chat usage counts them), and detokenizing gives the text back."""

from __future__ import annotations

import orjson
import pytest
from helpers.openai_schema import assert_valid, request

from memserve.bench.server_process import ServerHandle

TEXT = "Tokenizers split héllo wörld 😀 into pieces."
MESSAGES = [{"role": "user", "content": "How many tokens is this?"}]


def post(server: ServerHandle, path: str, body: dict) -> tuple[int, dict]:
    status, _, raw = request(server, "POST", path, orjson.dumps(body))
    return status, orjson.loads(raw)


def test_tokenize_detokenize_round_trip(memserve_server: ServerHandle, tokenizer) -> None:
    status, body = post(memserve_server, "/tokenize", {"model": memserve_server.model, "prompt": TEXT,
                                                       "return_token_strs": True})
    assert status == 200, body
    models = memserve_server.get_json("/v1/models")["data"][0]
    assert body["tokens"] == tokenizer.encode(TEXT) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == models["max_model_len"]
    assert len(body["token_strs"]) == body["count"]
    status, back = post(memserve_server, "/detokenize", {"tokens": body["tokens"]})
    assert (status, back) == (200, {"prompt": TEXT})


def test_tokenize_messages_counts_what_chat_bills(memserve_server: ServerHandle) -> None:
    status, body = post(memserve_server, "/tokenize", {"messages": MESSAGES})
    assert status == 200, body
    status, chat = post(memserve_server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1})
    assert status == 200 and chat["usage"]["prompt_tokens"] == body["count"]
    status, back = post(memserve_server, "/detokenize", {"tokens": body["tokens"]})
    assert back["prompt"].startswith("<|im_start|>") and "How many tokens is this?" in back["prompt"]


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"messages": "hi"}, "messages"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ("/detokenize", {"tokens": [10 ** 9]}, "tokens"),
], ids=["nothing", "both", "mistyped-prompt", "mistyped-messages", "mistyped-flag", "negative", "mistyped-tokens",
        "out-of-vocabulary"])
def test_bad_input_gets_openai_errors(memserve_server: ServerHandle, path: str, body: dict, param: str) -> None:
    status, error = post(memserve_server, path, body)
    assert status == 400 and error["error"]["param"] == param, error
    assert_valid(error, "ErrorResponse")


def test_unknown_model_is_404(memserve_server: ServerHandle) -> None:
    status, error = post(memserve_server, "/tokenize", {"model": "gpt-4", "prompt": "a"})
    assert status == 404
    assert_valid(error, "ErrorResponse")
