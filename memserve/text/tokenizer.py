"""Tokenizer and chat template for the gateway, without transformers.

transformers imports torch, and the gateway process must stay torch-free, so this
loads ``tokenizer.json`` with the ``tokenizers`` library and renders the chat template
with Jinja2 the way ``PreTrainedTokenizerBase.apply_chat_template`` does (same sandboxed
environment options, globals, filters and template variables), then encodes the
rendered text without adding special tokens, exactly like HF's ``tokenize=True``."""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders

# The named special tokens HF passes to every chat template (its SPECIAL_TOKENS_ATTRIBUTES).
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered (no template, or the template refused it)."""


class _GenerationTag(jinja2.ext.Extension):
    """Accept HF's ``{% generation %}...{% endgeneration %}`` tag (used for assistant
    masks in training) and render its body unchanged, as HF does when not tracking."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore attributes, as HF's sandbox hardening does."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")


class _TemplateDict:
    """``dict(...)`` for templates without handing them the ``dict`` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; HF's does not.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


def _token_content(value: Any) -> str | None:
    """A special token in tokenizer_config.json is a string or a serialised AddedToken."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _find_chat_template(folder: Path, tokenizer_config: dict) -> str | None:
    """transformers >= 4.43 saves the template to chat_template.jinja (or .json); older
    folders keep it in tokenizer_config.json, as a string or a list of named templates."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _read_json(folder / "chat_template.json").get("chat_template") or tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    return template


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


class Tokenizer:
    """Encode, decode and apply the chat template of one model."""

    def __init__(self, backend: HFTokenizer, chat_template: str | None, special_tokens: dict[str, str],
                 eos_token_ids: list[int]) -> None:
        self._backend = backend
        self.chat_template = chat_template
        self._compiled_template = compile_chat_template(chat_template) if chat_template else None
        self.special_tokens = special_tokens
        self.eos_token_ids = eos_token_ids
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)

    def __reduce__(self) -> tuple:
        """Picklable (the compiled template is rebuilt), so tokenizer processes get a copy."""
        return type(self), (self._backend, self.chat_template, self.special_tokens, self.eos_token_ids)

    @cached_property
    def max_chars_per_token(self) -> int:
        """The most characters one token can stand for (its decoded text, plus the
        leading space a SentencePiece decoder strips): a text that encodes to N tokens
        has at most N times this many characters, so a prompt can be refused by its size
        before it is tokenized. Decoding the vocabulary takes a moment: done once."""
        texts = self._backend.decode_batch([[i] for i in range(self.vocab_size)], skip_special_tokens=False)
        return max(map(len, texts), default=0) + 1

    @classmethod
    def from_folder(cls, path: str | Path) -> "Tokenizer":
        """Load a Hugging Face folder: tokenizer.json, tokenizer_config.json, the chat
        template, and end-of-sequence ids from generation_config.json / config.json."""
        folder = Path(path)
        backend = HFTokenizer.from_file(str(folder / "tokenizer.json"))
        config = _read_json(folder / "tokenizer_config.json")
        special = {name: content for name in _SPECIAL_TOKEN_NAMES if (content := _token_content(config.get(name)))}
        eos_ids: list[int] = []
        eos_id = backend.token_to_id(special["eos_token"]) if "eos_token" in special else None
        candidates = [
            *([eos_id] if eos_id is not None else []),
            *_as_id_list(_read_json(folder / "generation_config.json").get("eos_token_id")),
            *_as_id_list(_read_json(folder / "config.json").get("eos_token_id")),
        ]
        for token_id in candidates:
            if token_id not in eos_ids:
                eos_ids.append(token_id)
        return cls(backend, _find_chat_template(folder, config), special, eos_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    @cached_property
    def _byte_level(self) -> bool:
        return isinstance(self._backend.decoder, decoders.ByteLevel)

    @cached_property
    def _added_token_ids(self) -> set[int]:
        return set(self._backend.get_added_tokens_decoder())

    def byte_level_piece(self, token_id: int) -> str | None:
        """The vocabulary entry of a byte-level BPE token (one character per byte, GPT-2's
        alphabet), or None for an added token or another tokenizer family."""
        if not self._byte_level or token_id in self._added_token_ids:
            return None
        return self._backend.id_to_token(token_id)

    @cached_property
    def supports_tools(self) -> bool:
        """Whether the chat template reads ``tools`` (describes them to the model)."""
        if self.chat_template is None or self._compiled_template is None:
            return False
        return "tools" in jinja2.meta.find_undeclared_variables(self._compiled_template.environment.parse(
            self.chat_template))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, template_kwargs: dict | None = None) -> str:
        """Render like HF: keys whose value is None are dropped from each message, and
        the named special tokens are template variables, as are ``template_kwargs`` (a
        request's ``chat_template_kwargs``, e.g. Qwen3's ``enable_thinking``)."""
        if self._compiled_template is None:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        cleaned = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            return self._compiled_template.render(
                **(template_kwargs or {}), messages=cleaned, tools=tools, documents=None,
                add_generation_prompt=add_generation_prompt, **self.special_tokens,
            )
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"chat template error: {e}") from e

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> list[int]:
        """Token ids of a conversation, equal to HF's ``apply_chat_template(tokenize=True)``."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, tools), add_special_tokens=False)
