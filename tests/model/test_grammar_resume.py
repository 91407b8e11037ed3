"""A request that resumes on another worker after tokens it produced elsewhere (its
worker died, or it was handed off) starts its grammar past those tokens: the resumed
matcher allows exactly what a matcher that consumed them one by one allows."""

from __future__ import annotations

import logging

from memserve.gateway.structured_output import json_schema_grammar
from memserve.model_files.generation import eos_token_ids
from memserve.text.tokenizer import Tokenizer
from memserve.workers.model.grammar import GrammarMatchers

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def test_a_resumed_request_starts_its_grammar_past_its_tokens(model_dir, caplog) -> None:
    tokenizer = Tokenizer.from_folder(model_dir)
    matchers = GrammarMatchers(model_dir, tokenizer.vocab_size, eos_token_ids(model_dir))
    grammar = json_schema_grammar(SCHEMA, "response_format")
    done = tokenizer.encode('{"name": "Ada", "age": 3')
    with caplog.at_level(logging.WARNING, "memserve.worker"):
        matchers.start("step-by-step", grammar, [])
        for token in done:
            matchers.accept(["step-by-step"], [token])
        matchers.start("resumed", grammar, done)
        matchers.start("fresh", grammar, [])
    assert not caplog.records  # every token was one the grammar allows
    batch = matchers.rows(["step-by-step", "resumed", "fresh"])
    assert batch is not None
    step_by_step, resumed, fresh = matchers.allowed(batch.matchers)
    assert (resumed == step_by_step).all() and not (resumed == fresh).all()
