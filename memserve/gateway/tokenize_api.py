"""vLLM's ``/tokenize`` and ``/detokenize`` requests, for clients that count tokens.

``POST /tokenize`` takes ``{"model"?, "prompt": str, "add_special_tokens"?: true}`` or
``{"model"?, "messages": [...], "add_generation_prompt"?: true}`` (rendered with the chat
template, and tokenized exactly as a chat request is: ``add_special_tokens`` applies to a
``prompt`` only, ``add_generation_prompt`` to ``messages`` only, as in vLLM) and answers ``{"count", "max_model_len", "tokens"}``,
plus ``token_strs`` when ``return_token_strs`` is true. ``POST /detokenize`` takes
``{"model"?, "tokens": [int]}`` and answers ``{"prompt": str}``, special tokens
included, as vLLM decodes them."""

from __future__ import annotations

from dataclasses import dataclass

from memserve.gateway.errors import bad_request
from memserve.gateway.protocol import check_prompt_ids, parse_messages

_TYPE_ERRORS = {"add_special_tokens": bool, "add_generation_prompt": bool, "return_token_strs": bool, "model": str}


@dataclass
class TokenizeRequest:
    model: str | None
    prompt: str | None  # exactly one of prompt and messages
    messages: list[dict] | None
    add_special_tokens: bool
    add_generation_prompt: bool
    return_token_strs: bool


@dataclass
class DetokenizeRequest:
    model: str | None
    tokens: list[int]


def _check_types(body: dict) -> None:
    for name, kind in _TYPE_ERRORS.items():
        value = body.get(name)
        if value is not None and (not isinstance(value, kind) or (kind is not bool and isinstance(value, bool))):
            raise bad_request(f"'{name}' must be {'a boolean' if kind is bool else 'a string'}", name)


def parse_tokenize_request(body: dict) -> TokenizeRequest:
    _check_types(body)
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_messages:
        raise bad_request("send exactly one of 'prompt' and 'messages'", "prompt")
    if has_prompt and not isinstance(body["prompt"], str):
        raise bad_request("'prompt' must be a string", "prompt")
    return TokenizeRequest(
        model=body.get("model"),
        prompt=body["prompt"] if has_prompt else None,
        messages=parse_messages(body) if has_messages else None,
        add_special_tokens=body.get("add_special_tokens") is not False,
        add_generation_prompt=body.get("add_generation_prompt") is not False,
        return_token_strs=bool(body.get("return_token_strs")),
    )


def parse_detokenize_request(body: dict, vocab_size: int) -> DetokenizeRequest:
    _check_types(body)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(type(t) is int and t >= 0 for t in tokens):
        raise bad_request("'tokens' must be an array of non-negative integers", "tokens")
    if tokens:
        check_prompt_ids(tokens, vocab_size, "tokens")
    return DetokenizeRequest(model=body.get("model"), tokens=tokens)
