"""OpenAI request validation for /v1/completions and /v1/chat/completions.

Validation is hand-written (no pydantic in the gateway's dependencies) and always names
the offending field in ``param``. Fields that change what OpenAI would return and that
memserve does not implement (best_of, suffix, functions) are rejected with
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

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

from memserve.gateway.cache_control import CachePin, parse_cache_control
from memserve.gateway.errors import APIError, bad_request
from memserve.gateway.structured_output import response_format_grammar
from memserve.gateway.tool_calls import ToolChoice, parse_tool_choice
from memserve.ipc.messages import SamplingParams

COMPLETION_MAX_TOKENS_DEFAULT = 16
# OpenAI's ranges: top log-probabilities per token on each endpoint.
MAX_COMPLETION_LOGPROBS = 5
MAX_CHAT_TOP_LOGPROBS = 20
# Prompts in one /v1/completions request (OpenAI: 2048); each is a request to the engine.
MAX_BATCHED_PROMPTS = 2048
# Every output token is checked against each of these, so their number is capped
# (OpenAI allows 4 stop strings; vLLM does not cap either).
MAX_STOP_STRINGS = 64
MAX_STOP_TOKEN_IDS = 1024
# Sequences per request (each holds its own KV tail and decodes every step).
MAX_N = 16
MAX_CACHE_SALT_CHARS = 256  # a request's ``cache_salt``
MAX_CACHE_TTL_S = 30 * 86400.0  # a request's ``cache_ttl_s`` extension: at most 30 days
# Entries of logit_bias, as OpenAI caps it.
MAX_LOGIT_BIAS = 300

_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
               dict: "an object"}

# Accepted only at their "off" value: field -> predicate that the value is off.
_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "best_of": lambda v: v in (None, 1),
    "suffix": lambda v: v in (None, ""),
    "functions": lambda v: not v,  # deprecated for tools
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


def _logit_bias(body: dict) -> dict[int, float]:
    """OpenAI's map of token id (a decimal string) to a bias in [-100, 100]."""
    bias = _get(body, "logit_bias", dict, {})
    if len(bias) > MAX_LOGIT_BIAS:
        raise bad_request(f"'logit_bias' can hold at most {MAX_LOGIT_BIAS} entries, got {len(bias)}", "logit_bias")
    out = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isdecimal()) or isinstance(value, bool) or \
                not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise bad_request(f"'logit_bias' maps token ids to numbers in [-100, 100]; got {key!r}: {value!r}",
                              "logit_bias")
        out[int(key)] = float(value)
    return out


def check_logit_bias(bias: dict[int, float], vocab_size: int) -> None:
    bad = [t for t in bias if t >= vocab_size]
    if bad:
        raise bad_request(f"'logit_bias' token id {bad[0]} is out of the vocabulary (size {vocab_size})", "logit_bias")


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
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: dict[int, float]
    min_tokens: int
    n: int
    session_id: str | None
    slo: dict | None  # {"ttft_ms", "tbt_ms", "priority"}, the keys set (body, then headers and defaults: resolve_slo)
    logprobs: int | None  # top log-probabilities per generated token; None: no logprobs
    prompt_logprobs: int | None  # the same per prompt token (completions' echo)
    grammar: str | None  # what the output must match (response_format, forced tool calls)
    # keep this conversation's cached KV at least this long (--cache-ttl); keyword-only, as the
    # fields below: the endpoints' own fields follow without defaults
    cache_ttl_s: float | None = field(default=None, kw_only=True)
    # --truncation kv-shift: the tokens the gateway dropped from an over-long conversation
    # and where (text/truncation.py), so the worker can reuse their successors' KV.
    dropped_at: int = field(default=0, kw_only=True)
    dropped_token_ids: list[int] = field(default_factory=list, kw_only=True)
    # vLLM's ``cache_salt``: folded into the first KV block's name, so this prompt shares
    # cached blocks only with requests of the same salt (kvcache/hashing.py).
    cache_salt: str | None = field(default=None, kw_only=True)
    # cache_control (gateway/cache_control.py): keep the prompt's first ``pin_tokens``
    # tokens cached for ``pin_ttl_s`` seconds; the gateway counts the tokens once encoded.
    pin_tokens: int = field(default=0, kw_only=True)
    pin_ttl_s: float = field(default=0.0, kw_only=True)
    pin_owner: str = field(default="", kw_only=True)  # the API key's id: its pins have a share of their own
    lora_name: str | None = field(default=None, kw_only=True)  # the adapter ``model`` names (--lora-modules)
    lora_digest: str = field(default="", kw_only=True)  # its files' digest (gateway/lora_adapters.py)

    def sampling_params(self, max_tokens: int, eos_token_ids: list[int]) -> SamplingParams:
        """The model's end-of-sequence ids join the stop ids unless ``ignore_eos``, as
        vLLM does with generation_config's extra EOS ids."""
        stop_ids = list(self.stop_token_ids)
        if not self.ignore_eos:
            stop_ids += [t for t in eos_token_ids if t not in stop_ids]
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=self.seed, stop_token_ids=stop_ids, ignore_eos=self.ignore_eos,
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              repetition_penalty=self.repetition_penalty, logit_bias=self.logit_bias,
                              min_tokens=self.min_tokens, n=self.n, logprobs=self.logprobs,
                              prompt_logprobs=self.prompt_logprobs, grammar=self.grammar,
                              cache_ttl_s=self.cache_ttl_s, dropped_at=self.dropped_at,
                              dropped_token_ids=self.dropped_token_ids,
                              cache_salt=self.cache_salt, pin_tokens=self.pin_tokens,
                              pin_ttl_s=self.pin_ttl_s, pin_owner=self.pin_owner, lora_name=self.lora_name,
                              lora_digest=self.lora_digest)


def _parse_common(body: dict, max_tokens_names: tuple[str, ...], max_tokens_default: int | None,
                  min_max_tokens: int = 1) -> dict:
    for name, is_off in _UNSUPPORTED.items():
        if not is_off(body.get(name)):
            raise bad_request(f"'{name}' is not supported by this server", name)
    n = _get(body, "n", int, 1)
    if not 1 <= n <= MAX_N:
        raise bad_request(f"'n' must be in [1, {MAX_N}], got {n}", "n")
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
        if max_tokens is not None and max_tokens < min_max_tokens:
            raise bad_request(f"'{name}' must be at least {min_max_tokens}, got {max_tokens}", name)

    min_tokens = _get(body, "min_tokens", int, 0)
    if min_tokens < 0 or (max_tokens is not None and min_tokens > max_tokens):
        raise bad_request(f"'min_tokens' must be in [0, max_tokens], got {min_tokens}", "min_tokens")

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
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.0, None, low_open=True),
        logit_bias=_logit_bias(body),
        min_tokens=min_tokens,
        n=n,
        session_id=_get(body, "session_id", str),
        slo=slo or None,
        cache_ttl_s=_number(body, "cache_ttl_s", 0.0, 0.0, MAX_CACHE_TTL_S) or None,
        grammar=_constrained(body, response_format_grammar(body), "response_format"),
        cache_salt=_cache_salt(body),
    )


def _cache_salt(body: dict) -> str | None:
    """vLLM's ``cache_salt``: a non-empty string of at most ``MAX_CACHE_SALT_CHARS``."""
    salt = _get(body, "cache_salt", str)
    if salt is not None and not 1 <= len(salt) <= MAX_CACHE_SALT_CHARS:
        raise bad_request(f"'cache_salt' must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters",
                          "cache_salt")
    return salt


def _constrained(body: dict, grammar: str | None, param: str) -> str | None:
    """A grammar ends the output with an end-of-sequence token, which ``ignore_eos`` would
    not stop at."""
    if grammar is not None and _get(body, "ignore_eos", bool, False):
        raise bad_request(f"'ignore_eos' cannot be combined with '{param}'", "ignore_eos")
    return grammar


@dataclass
class CompletionRequest(GenerationRequest):
    prompts: list[str | list[int]]  # one choice (n choices) per prompt, in this order
    echo: bool  # the prompt leads the text (and its logprobs lead the logprobs)


@dataclass
class ChatCompletionRequest(GenerationRequest):
    messages: list[dict]
    tool_choice: ToolChoice | None  # None: no tools
    cache_pin: CachePin | None = None  # the last cache_control marker of the messages
    template_kwargs: dict | None = None  # chat_template_kwargs: more variables for the chat template


def _prompts(body: dict) -> list[str | list[int]]:
    """OpenAI's four forms of ``prompt``: a string, a list of token ids, or a non-empty
    batch of either."""
    if "prompt" not in body:
        raise bad_request("'prompt' is required", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        prompts = [_token_ids(p, "prompt") for p in prompt]
    else:
        return [_token_ids(prompt, "prompt")]
    if len(prompts) > MAX_BATCHED_PROMPTS:
        raise bad_request(f"'prompt' can hold at most {MAX_BATCHED_PROMPTS} prompts, got {len(prompts)}", "prompt")
    return prompts


def parse_completion_request(body: dict) -> CompletionRequest:
    """``logprobs`` (0-5) asks for the chosen token's and the top tokens' logprobs;
    with ``echo`` the prompt's come too, and ``max_tokens: 0`` then scores the prompt
    without generating (lm-evaluation-harness does this)."""
    prompts = _prompts(body)
    echo = _get(body, "echo", bool, False)
    logprobs = _get(body, "logprobs", int)
    if logprobs is not None and not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:
        raise bad_request(f"'logprobs' must be in [0, {MAX_COMPLETION_LOGPROBS}], got {logprobs}", "logprobs")
    max_tokens_default = COMPLETION_MAX_TOKENS_DEFAULT if "max_tokens" not in body else None
    common = _parse_common(body, ("max_tokens",), max_tokens_default, min_max_tokens=0 if echo else 1)
    return CompletionRequest(**common, logprobs=logprobs, prompt_logprobs=logprobs if echo else None,
                             prompts=prompts, echo=echo)


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
        if (not isinstance(call, dict) or not isinstance(function, dict) or not isinstance(call.get("id", ""), str)
                or call.get("type", "function") != "function"
                or not all(isinstance(function.get(k), str) for k in ("name", "arguments"))):
            raise bad_request(f"'{param}' must be an array of {{\"id\": string, \"type\": \"function\", "
                              "\"function\": {\"name\": string, \"arguments\": string}}", param)
        calls.append({"id": call.get("id", ""), "type": "function",
                      "function": {"name": function["name"], "arguments": function["arguments"]}})
    return calls


def _message(message: Any, index: int) -> dict:
    """What the chat template sees of one message: role, content and the optional
    ``name``, ``tool_call_id``, ``tool_calls`` and ``reasoning_content`` (an answer's
    reasoning sent back, which templates such as Qwen3's render in the turn that calls
    tools); other keys are ignored."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise bad_request(f"'messages[{index}]' must be an object with a string 'role'", f"messages[{index}].role")
    cleaned = {"role": message["role"], "content": _message_content(message.get("content"), index)}
    for key in ("name", "tool_call_id", "reasoning_content"):
        value = message.get(key)
        if value is None:
            continue
        if not isinstance(value, str):
            raise bad_request(f"'messages[{index}].{key}' must be a string", f"messages[{index}].{key}")
        cleaned[key] = value
    if message.get("tool_calls"):
        cleaned["tool_calls"] = _tool_calls(message["tool_calls"], index)
    return cleaned


def parse_messages(body: dict) -> list[dict]:
    """``messages``, as the chat template may see them."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty array", "messages")
    return [_message(message, i) for i, message in enumerate(messages)]


def parse_chat_request(body: dict) -> ChatCompletionRequest:
    """``max_completion_tokens`` takes precedence over the deprecated ``max_tokens``."""
    cleaned = parse_messages(body)
    if body.get("echo") not in (None, False):
        raise bad_request("'echo' is only supported on /v1/completions", "echo")
    logprobs = _get(body, "logprobs", bool, False)
    top_logprobs = _get(body, "top_logprobs", int)
    if top_logprobs is not None:
        if not 0 <= top_logprobs <= MAX_CHAT_TOP_LOGPROBS:
            raise bad_request(f"'top_logprobs' must be in [0, {MAX_CHAT_TOP_LOGPROBS}], got {top_logprobs}",
                              "top_logprobs")
        if not logprobs:
            raise bad_request("'logprobs' must be true when 'top_logprobs' is used", "top_logprobs")
    common = _parse_common(body, ("max_completion_tokens", "max_tokens"), None)
    tool_choice = parse_tool_choice(body)
    if tool_choice is not None and tool_choice.grammar is not None:
        if common["grammar"] is not None:
            raise bad_request(f"'response_format' cannot be combined with tool_choice '{tool_choice.mode}'",
                              "response_format")
        common["grammar"] = _constrained(body, tool_choice.grammar, "tool_choice")
    return ChatCompletionRequest(**common, logprobs=(top_logprobs or 0) if logprobs else None, prompt_logprobs=None,
                                 messages=cleaned, tool_choice=tool_choice,
                                 cache_pin=parse_cache_control(body["messages"]),
                                 template_kwargs=_template_kwargs(body))


# Variables the chat template gets from the server, which a request cannot set.
_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
MAX_TEMPLATE_KWARGS = 16


def _template_kwargs(body: dict) -> dict | None:
    """vLLM's ``chat_template_kwargs`` (e.g. ``{"enable_thinking": false}`` for Qwen3): up to
    16 variables of scalar values; none may replace what the server passes."""
    kwargs = _get(body, "chat_template_kwargs", dict)
    if kwargs is None:
        return None
    param = "chat_template_kwargs"
    if len(kwargs) > MAX_TEMPLATE_KWARGS or not all(
            isinstance(k, str) and k.isidentifier() and not k.endswith("_token") and k not in _TEMPLATE_VARIABLES
            and (v is None or isinstance(v, (bool, int, float, str))) for k, v in kwargs.items()):
        raise bad_request(f"'{param}' must map at most {MAX_TEMPLATE_KWARGS} names (not messages, tools, documents, "
                          "add_generation_prompt or special tokens) to strings, numbers, booleans or null", param)
    return kwargs


# The SLO headers (as the Gateway API Inference Extension names them) and the keys of
# ``GenerationRequest.slo`` they set.
SLO_HEADERS = {"ttft_ms": "x-slo-ttft-ms", "tbt_ms": "x-slo-tbt-ms", "priority": "x-priority"}


def _slo_header(name: str, text: str) -> float | int:
    """A positive number of milliseconds, or an integer priority (``x-priority``)."""
    if name == SLO_HEADERS["priority"]:
        try:
            return int(text)
        except ValueError:
            raise bad_request(f"header '{name}' must be an integer, got {text!r}", name) from None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise bad_request(f"header '{name}' must be a positive number of milliseconds, got {text!r}", name)
    return value


def resolve_slo(body_slo: dict | None, headers: Mapping[str, str], defaults: Mapping[str, float]) -> dict | None:
    """A request's SLOs, each from the first that sets it: the body field
    (``slo_ttft_ms``, ``slo_tbt_ms``, ``priority``), the header (``x-slo-ttft-ms``,
    ``x-slo-tbt-ms``, ``x-priority``), the server default (``--slo-ttft-ms``,
    ``--slo-tbt-ms``). The body wins because it is what the client itself wrote; a header
    is often added by a proxy for a whole class of traffic."""
    slo: dict = dict(defaults)
    for key, name in SLO_HEADERS.items():
        text = headers.get(name)
        if text is not None:
            slo[key] = _slo_header(name, text.strip())
    slo.update(body_slo or {})
    return slo or None


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
