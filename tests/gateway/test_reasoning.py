"""``--reasoning-parser`` (gateway/reasoning.py): a reasoning model's ``<think>`` text goes
to ``reasoning_content``, whole or streamed in any cut, and the answer to ``content``;
through the real HTTP app with a scripted engine playing the model."""

from __future__ import annotations

import pytest
from helpers.fake_engine import async_test, post, scripted, serve

from memserve.gateway.reasoning import PARSERS, ReasoningStream, split_reasoning
from memserve.text.tokenizer import Tokenizer

QWEN3 = PARSERS["qwen3"]
DEEPSEEK = PARSERS["deepseek_r1"]


@pytest.mark.parametrize("parser, text, want", [
    (QWEN3, "<think>\nThe sea is wide.\n</think>\n\nIt is blue.", ("\nThe sea is wide.\n", "It is blue.")),
    (QWEN3, "It is blue.", (None, "It is blue.")),
    (QWEN3, "<thin", (None, "<thin")),
    (QWEN3, "<think>never ends", ("never ends", "")),
    (DEEPSEEK, "The sea is wide.</think>It is blue.", ("The sea is wide.", "It is blue.")),
    (DEEPSEEK, "<think>wide</think>\nblue", ("wide", "blue")),
    (DEEPSEEK, "all thought", ("all thought", "")),
])
def test_whole_and_streamed_in_every_cut_agree(parser, text, want):
    assert split_reasoning(parser, text) == want
    for cut in range(1, len(text)):  # two deltas, cut anywhere (inside the tags too)
        stream = ReasoningStream(parser)
        parts = [stream.feed(text[:cut]), stream.feed(text[cut:]), stream.finish()]
        reasoning = "".join(p.get("reasoning_content", "") for p in parts)
        content = "".join(p.get("content", "") for p in parts)
        assert (reasoning or None, content) == want, cut
        assert all("<think>" not in p.get("content", "") + p.get("reasoning_content", "") or parser is QWEN3
                   and want[0] is None for p in parts)


REPLY = "<think>\nThe user wants a colour.\n</think>\n\nBlue."


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@async_test
async def test_reasoning_content_through_the_api(tokenizer: Tokenizer, stream: bool) -> None:
    async with serve(scripted(tokenizer, REPLY), tokenizer, reasoning_parser="qwen3") as client:
        status, body = await post(client, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "A colour?"}], "stream": stream})
    assert status == 200, body
    if stream:
        deltas = [c["choices"][0]["delta"] for c in body[:-1] if c["choices"]]
        reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
        content = "".join(d.get("content") or "" for d in deltas)
    else:
        message = body["choices"][0]["message"]
        reasoning, content = message["reasoning_content"], message["content"]
    assert reasoning == "\nThe user wants a colour.\n" and content == "Blue."


@async_test
async def test_without_the_parser_the_thoughts_stay_in_the_content(tokenizer: Tokenizer) -> None:
    async with serve(scripted(tokenizer, REPLY), tokenizer) as client:
        status, body = await post(client, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "A colour?"}]})
    assert status == 200 and body["choices"][0]["message"]["content"] == REPLY
    assert "reasoning_content" not in body["choices"][0]["message"]


THINKING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n"
                     "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
                     "{% endif %}")


@async_test
async def test_chat_template_kwargs_reach_the_template(tokenizer_folder, tmp_path) -> None:
    import shutil

    shutil.copytree(tokenizer_folder, tmp_path, dirs_exist_ok=True)
    (tmp_path / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    thinking = Tokenizer.from_folder(tmp_path)
    engine = scripted(thinking, "Blue.")
    async with serve(engine, thinking, reasoning_parser="qwen3") as client:
        for kwargs in (None, {"enable_thinking": False}):
            status, body = await post(client, "/v1/chat/completions", {
                "messages": [{"role": "user", "content": "A colour?"}],
                **({"chat_template_kwargs": kwargs} if kwargs else {})})
            assert status == 200 and body["choices"][0]["message"]["content"] == "Blue."
        status, body = await post(client, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "A colour?"}], "chat_template_kwargs": {"messages": []}})
    prompts = [thinking.decode(r["prompt_token_ids"], skip_special_tokens=False) for r in engine.requests]
    assert "<think>" not in prompts[0] and prompts[1].endswith("<think>\n\n</think>\n\n")
    assert status == 400 and body["error"]["param"] == "chat_template_kwargs"
