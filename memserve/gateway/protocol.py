"""OpenAI request validation for /v1/completions and /v1/chat/completions.

Validation is hand-written (no pydantic in the gateway's dependencies) and always names
the offending field in ``param``. Fields that change what OpenAI would return and that
memserve does not implement (logprobs, penalties, tools, n > 1, ...) are rejected with
400 rather than silently ignored; unknown fields are ignored, like OpenAI does.

Defaults follow vLLM: /v1/completions generates 16 tokens when ``max_tokens`` is absent
(OpenAI's legacy default), chat requests and an explicit ``null`` use the rest of the
context window; an explicit ``null`` never wins over a value given in the alternative
field (``max_completion_tokens: null, max_tokens: 2`` generates 2 tokens).

User data is never walked recursively: every field is checked at a fixed depth, and chat
messages reach the template only as validated, fixed-shape copies, so a deeply nested
value cannot exhaust the stack anywhere downstream. List fields that cost work per
generated token (``stop``, ``stop_token_ids``) have a length cap."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from memserve.gateway.errors import APIError, bad_request
from memserve.ipc.messages import SamplingParams

COMPLETION_MAX_TOKENS_DEFAULT = 16
# Every output token is checked against each of these, so their number is capped
# (OpenAI allows 4 stop strings; vLLM does not cap either).
MAX_STOP_STRINGS = 64
MAX_STOP_TOKEN_IDS = 1024

_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
               dict: "an object"}

# Accepted only at their "off" value: field -> predicate that the value is off.
_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "logprobs": lambda v: v in (None, False, 0),
    "top_logprobs": lambda v: v in (None, 0),
    "echo": lambda v: v in (None, False),
    "best_of": lambda v: v in (None, 1),
    "suffix": lambda v: v in (None, ""),
    "presence_penalty": lambda v: v in (None, 0),
    "frequency_penalty": lambda v: v in (None, 0),
    "logit_bias": lambda v: not v,
    "tools": lambda v: not v,
    "functions": lambda v: not v,
    "tool_choice": lambda v: v in (None, "none"),
    "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
}


def _get(body: dict, name: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    """``body[name]`` checked against ``kind`` (``None``/absent gives ``default``).
    ``bool`` is never accepted where a number is expected, although it is an int."""
    value = body.get(name)
    if value is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        raise bad_request(f"'{name}' must be {' or '.join(_TYPE_NAMES[k] for k in kinds)}", name)
    return value


def _number(body: dict, name: str, default: float, low: float, high: float | None, low_open: bool = False) -> float:
    value = float(_get(body, name, (int, float), default))
    if value < low or (low_open and value == low) or (high is not None and value > high):
        bounds = f"{'(' if low_open else '['}{low}, {high if high is not None else 'inf'}]"
        raise bad_request(f"'{name}' must be in {bounds}, got {value}", name)
    return value


def _token_ids(value: Any, name: str) -> list[int]:
    """Builtins only (``type(t) is int`` also excludes bools): a 4 MiB body holds two
    million ids, and this runs on the event loop."""
    if not isinstance(value, list) or not all(type(t) is int for t in value) or (value and min(value) < 0):
        raise bad_request(f"'{name}' must be an array of non-negative integers", name)
    return value


def _stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad_request("'stop' must be a non-empty string or an array of non-empty strings", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"'stop' can hold at most {MAX_STOP_STRINGS} strings, got {len(stops)}", "stop")
    return stops


def _stop_token_ids(body: dict) -> list[int]:
    ids = _token_ids(_get(body, "stop_token_ids", list, []), "stop_token_ids")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise bad_request(f"'stop_token_ids' can hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}",
                          "stop_token_ids")
    return ids


@dataclass
class GenerationRequest:
    """What both endpoints share: model, streaming, sampling and memserve extensions."""

    model: str | None
    stream: bool
    include_usage: bool
    max_tokens: int | None  # None: the rest of the context window
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    session_id: str | None
    slo: dict | None  # {"ttft_ms", "tbt_ms", "priority"}, only the keys the client sent

    def sampling_params(self, max_tokens: int, eos_token_ids: list[int]) -> SamplingParams:
        """The model's end-of-sequence ids join the stop ids unless ``ignore_eos``, as
        vLLM does with generation_config's extra EOS ids."""
        stop_ids = list(self.stop_token_ids)
        if not self.ignore_eos:
            stop_ids += [t for t in eos_token_ids if t not in stop_ids]
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=self.seed, stop_token_ids=stop_ids, ignore_eos=self.ignore_eos)


def _parse_common(body: dict, max_tokens_names: tuple[str, ...], max_tokens_default: int | None) -> dict:
    for name, is_off in _UNSUPPORTED.items():
        if not is_off(body.get(name)):
            raise bad_request(f"'{name}' is not supported by this server", name)
    n = _get(body, "n", int, 1)
    if n != 1:
        raise bad_request("only n=1 is supported", "n")
    stream = _get(body, "stream", bool, False)
    stream_options = _get(body, "stream_options", dict)
    if stream_options is not None and not stream:
        raise bad_request("'stream_options' is only allowed with stream=true", "stream_options")
    include_usage = _get(stream_options or {}, "include_usage", bool, False)

    max_tokens: int | None = max_tokens_default
    given = [name for name in max_tokens_names if name in body]
    if given:  # the first one with a value wins; null only when none has one
        name = next((n for n in given if body[n] is not None), given[0])
        max_tokens = _get(body, name, int)
        if max_tokens is not None and max_tokens <= 0:
            raise bad_request(f"'{name}' must be at least 1, got {max_tokens}", name)

    top_k = _get(body, "top_k", int, 0)
    if top_k < -1:
        raise bad_request(f"'top_k' must be -1 or 0 (disabled) or positive, got {top_k}", "top_k")

    slo: dict[str, float | int] = {}
    for key, name in (("ttft_ms", "slo_ttft_ms"), ("tbt_ms", "slo_tbt_ms")):
        if body.get(name) is not None:
            slo[key] = _number(body, name, 0.0, 0.0, None, low_open=True)
    priority = _get(body, "priority", int)
    if priority is not None:
        slo["priority"] = priority

    return dict(
        model=_get(body, "model", str),
        stream=stream,
        include_usage=include_usage,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),  # OpenAI's range
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        top_k=max(top_k, 0),
        seed=_get(body, "seed", int),
        stop=_stop_strings(body),
        stop_token_ids=_stop_token_ids(body),
        ignore_eos=_get(body, "ignore_eos", bool, False),
        session_id=_get(body, "session_id", str),
        slo=slo or None,
    )


@dataclass
class CompletionRequest(GenerationRequest):
    prompt: str | list[int]


@dataclass
class ChatCompletionRequest(GenerationRequest):
    messages: list[dict]


def parse_completion_request(body: dict) -> CompletionRequest:
    """``prompt`` is a string or a list of token ids; a batch of several prompts is
    rejected (one prompt per request), a batch of one is unwrapped."""
    if "prompt" not in body:
        raise bad_request("'prompt' is required", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) > 1:
            raise bad_request("batched prompts are not supported; send one prompt per request", "prompt")
        prompt = prompt[0]
    if not isinstance(prompt, str):
        prompt = _token_ids(prompt, "prompt")
    max_tokens_default = COMPLETION_MAX_TOKENS_DEFAULT if "max_tokens" not in body else None
    return CompletionRequest(**_parse_common(body, ("max_tokens",), max_tokens_default), prompt=prompt)


def _message_content(content: Any, index: int) -> str:
    """String content, or text parts joined by newlines (as vLLM); no other part types.
    Null or absent content (an assistant turn that only called tools) is empty."""
    param = f"messages[{index}].content"
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"'{param}' must be a string or an array of content parts", param)
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad_request(f"'{param}' parts must be {{\"type\": \"text\", \"text\": string}}; "
                              "only text content is supported", param)
        texts.append(part["text"])
    return "\n".join(texts)


def _tool_calls(value: Any, index: int) -> list[dict]:
    """A tool-call history entry, copied at its fixed depth: templates may ``tojson``
    it, and that must never meet an arbitrarily deep value."""
    param = f"messages[{index}].tool_calls"
    calls = []
    for call in value if isinstance(value, list) else [None]:
        function = call.get("function") if isinstance(call, dict) else None
        if (not isinstance(function, dict) or not isinstance(call.get("id", ""), str)
                or call.get("type", "function") != "function"
                or not all(isinstance(function.get(k), str) for k in ("name", "arguments"))):
            raise bad_request(f"'{param}' must be an array of {{\"id\": string, \"type\": \"function\", "
                              "\"function\": {\"name\": string, \"arguments\": string}}", param)
        calls.append({"id": call.get("id", ""), "type": "function",
                      "function": {"name": function["name"], "arguments": function["arguments"]}})
    return calls


def _message(message: Any, index: int) -> dict:
    """What the chat template sees of one message: role, content and the optional
    ``name``, ``tool_call_id`` and ``tool_calls``; other keys are ignored."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise bad_request(f"'messages[{index}]' must be an object with a string 'role'", f"messages[{index}].role")
    cleaned = {"role": message["role"], "content": _message_content(message.get("content"), index)}
    for key in ("name", "tool_call_id"):
        value = message.get(key)
        if value is None:
            continue
        if not isinstance(value, str):
            raise bad_request(f"'messages[{index}].{key}' must be a string", f"messages[{index}].{key}")
        cleaned[key] = value
    if message.get("tool_calls"):
        cleaned["tool_calls"] = _tool_calls(message["tool_calls"], index)
    return cleaned


def parse_chat_request(body: dict) -> ChatCompletionRequest:
    """``max_completion_tokens`` takes precedence over the deprecated ``max_tokens``."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty array", "messages")
    cleaned = [_message(message, i) for i, message in enumerate(messages)]
    common = _parse_common(body, ("max_completion_tokens", "max_tokens"), None)
    return ChatCompletionRequest(**common, messages=cleaned)


def check_prompt_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    if not token_ids:
        raise bad_request("the prompt is empty", param)
    if max(token_ids) >= vocab_size:
        bad = next(t for t in token_ids if t >= vocab_size)
        raise bad_request(f"token id {bad} is out of the vocabulary (size {vocab_size})", param)


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int, param: str) -> int:
    """The output budget, refusing prompts that leave no room in the context window."""
    if prompt_len >= max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
                       f"has {prompt_len} tokens, which leaves no room for the completion.", param,
                       "context_length_exceeded")
    if requested is None:
        return max_model_len - prompt_len
    if prompt_len + requested > max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                       f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the "
                       "completion). Please reduce the prompt or the completion length.", "max_tokens",
                       "context_length_exceeded")
    return requested
