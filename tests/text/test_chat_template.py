"""The gateway's torch-free tokenizer must tokenize conversations exactly like Hugging
Face's ``apply_chat_template(..., tokenize=True)``, since prefix caching and token-level
equality with transformers depend on identical prompt ids."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers.tokenizer_files import folder_without_template, smollm2_tokenizer_folder

from memserve.text.tokenizer import ChatTemplateError, Tokenizer


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return smollm2_tokenizer_folder(tmp_path_factory)


@pytest.fixture(scope="module")
def hf_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def tokenizer(folder: Path) -> Tokenizer:
    return Tokenizer.from_folder(folder)


CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": "Comment ça va? 😀 你好世界"},
    ],
    [{"role": "user", "content": ""}],
    [{"role": "user", "content": "  leading and trailing spaces \n\n and newlines\t"}],
    # Control tokens inside user text are parsed as special tokens by HF's default too.
    [{"role": "user", "content": "break out <|im_end|> here"}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_token_ids_equal_hf(tokenizer: Tokenizer, hf_tokenizer, messages: list[dict]) -> None:
    expected = hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert tokenizer.encode_chat(messages) == expected


def test_default_system_prompt_is_added_only_without_system_message(tokenizer: Tokenizer) -> None:
    without = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    with_system = tokenizer.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}])
    assert "SmolLM" in without and "SmolLM" not in with_system
    assert with_system.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("text", ["Hello world", " leading space", "😀 emoji and 你好", "<|im_start|>user"])
def test_encode_decode_equal_hf(tokenizer: Tokenizer, hf_tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert ids == hf_tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)


# Exercises what real templates use: special-token variables, raise_exception, namespace,
# loop controls, HF's tojson (no HTML escaping) and the {% generation %} tag.
FEATURE_TEMPLATE = """{{ bos_token }}{% set ns = namespace(turns=0) %}
{% for message in messages %}
{% if message['role'] == 'tool' %}{{ raise_exception('tool messages are not supported') }}{% endif %}
{% if message['role'] == 'system' %}{% continue %}{% endif %}
{% set ns.turns = ns.turns + 1 %}
[{{ message['role'] }} {{ ns.turns }}] {% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}{% endgeneration %}{% else %}{{ message['content'] | tojson }}{% endif %}{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}[assistant]{% endif %}"""


@pytest.fixture(scope="module")
def feature_folder(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    copy = tmp_path_factory.mktemp("feature-template")
    shutil.copytree(folder, copy, dirs_exist_ok=True)
    (copy / "chat_template.jinja").write_text(FEATURE_TEMPLATE)
    return copy


def test_template_features_render_like_hf(feature_folder: Path, hf_tokenizer) -> None:
    messages = [
        {"role": "system", "content": "skipped"},
        {"role": "user", "content": "a <b> & \"c\" 😀"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "again"},
    ]
    ours = Tokenizer.from_folder(feature_folder)
    expected = hf_tokenizer.apply_chat_template(messages, chat_template=FEATURE_TEMPLATE, tokenize=False,
                                                add_generation_prompt=True)
    assert ours.apply_chat_template(messages) == expected
    assert "<b> &" in expected  # HF's tojson keeps HTML characters
    assert ours.encode_chat(messages) == hf_tokenizer.apply_chat_template(
        messages, chat_template=FEATURE_TEMPLATE, tokenize=True, add_generation_prompt=True)["input_ids"]


def test_template_raise_exception_becomes_chat_template_error(feature_folder: Path) -> None:
    with pytest.raises(ChatTemplateError, match="tool messages are not supported"):
        Tokenizer.from_folder(feature_folder).encode_chat([{"role": "tool", "content": "x"}])


def test_sandbox_refuses_underscore_namespace_attributes(feature_folder: Path, tmp_path: Path) -> None:
    shutil.copytree(feature_folder, tmp_path, dirs_exist_ok=True)
    (tmp_path / "chat_template.jinja").write_text("{% set ns = namespace(_secret=1) %}x")
    with pytest.raises(ChatTemplateError, match="underscore"):
        Tokenizer.from_folder(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_from_tokenizer_config_string_or_named_list(folder: Path, tmp_path: Path) -> None:
    target = folder_without_template(folder, tmp_path)
    config_path = target / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = "plain:{{ messages[0]['content'] }}"
    config_path.write_text(json.dumps(config))
    assert Tokenizer.from_folder(target).apply_chat_template([{"role": "user", "content": "x"}]) == "plain:x"
    config["chat_template"] = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "named"}]
    config_path.write_text(json.dumps(config))
    assert Tokenizer.from_folder(target).apply_chat_template([{"role": "user", "content": "x"}]) == "named"


def test_missing_template_is_a_chat_template_error(folder: Path, tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_folder(folder_without_template(folder, tmp_path))
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tokenizer.encode_chat([{"role": "user", "content": "x"}])


def test_eos_ids_merge_tokenizer_generation_config_and_config(folder: Path, tmp_path: Path) -> None:
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    assert Tokenizer.from_folder(tmp_path).eos_token_ids == [2]  # <|im_end|>
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert Tokenizer.from_folder(tmp_path).eos_token_ids == [2, 0, 5]
