"""Incremental detokenisation: streamed text must add up to the full decode, never carry a
broken character, and never leak any part of a stop string."""

from __future__ import annotations

import random

import pytest
from helpers.tokenizer_files import smollm2_tokenizer_folder
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from memserve.text.detokenizer import IncrementalDetokenizer
from memserve.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_folder(smollm2_tokenizer_folder(tmp_path_factory))


class ByteDecoder:
    """One token per UTF-8 byte, decoded like byte-level BPE decoders do (invalid bytes
    become U+FFFD): the worst case for split characters, with exact control."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(token_ids).decode("utf-8", errors="replace")


def byte_tokens(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def stream(detokenizer: IncrementalDetokenizer, token_ids: list[int]) -> list[str]:
    """Feed one token at a time, as the engine usually does, then flush."""
    deltas = [detokenizer.add_tokens([t]) for t in token_ids]
    return deltas + [detokenizer.flush()]


def first_stop_cut(text: str, stops: list[str]) -> str:
    """Reference: the text before the stop string that is completed first."""
    for end in range(1, len(text) + 1):
        starts = [end - len(s) for s in stops if text[:end].endswith(s)]
        if starts:
            return text[:min(starts)]
    return text


@pytest.mark.parametrize("text", ["Hello world, how are you?", "😀 你好世界 🤖🦄 mixed ascii", "naïve café — «quotes»"])
def test_real_tokenizer_stream_equals_full_decode(tokenizer: Tokenizer, text: str) -> None:
    prompt = tokenizer.encode("Say something:")
    ids = tokenizer.encode(text)
    deltas = stream(IncrementalDetokenizer(tokenizer, prompt), ids)
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_real_tokenizer_splits_emoji_across_tokens(tokenizer: Tokenizer) -> None:
    """Guards the test above: single tokens of an emoji really are partial characters."""
    ids = tokenizer.encode("😀")
    assert len(ids) > 1 and "\ufffd" in tokenizer.decode(ids[:1])


def test_special_tokens_are_skipped(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Hi there") + tokenizer.eos_token_ids
    assert "".join(stream(IncrementalDetokenizer(tokenizer, []), ids)) == "Hi there"


def test_leading_space_kept_with_sentencepiece_style_decoder() -> None:
    """Metaspace decoders (Llama, Mistral) drop the space of a sequence's first word, so
    the first output token must be decoded after some prompt context."""
    vocab = {"[UNK]": 0, "\u2581Hello": 1, "\u2581world": 2, "\u2581again": 3}
    metaspace = HFTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    metaspace.pre_tokenizer = pre_tokenizers.Metaspace()
    metaspace.decoder = decoders.Metaspace()
    assert metaspace.decode([2]) == "world"  # what naive per-token decoding would send
    prompt, output = metaspace.encode("Hello").ids, metaspace.encode("world again").ids
    assert "".join(stream(IncrementalDetokenizer(metaspace, prompt), output)) == " world again"


def test_incomplete_character_is_held_then_completed() -> None:
    detokenizer = IncrementalDetokenizer(ByteDecoder(), [])
    head, *rest = byte_tokens("😀")
    assert detokenizer.add_tokens([head]) == ""
    assert detokenizer.add_tokens(rest) == "😀"


def test_flush_emits_incomplete_character_as_replacement() -> None:
    detokenizer = IncrementalDetokenizer(ByteDecoder(), [])
    assert detokenizer.add_tokens(byte_tokens("ok") + byte_tokens("你")[:2]) == "ok"
    assert detokenizer.flush() == "\ufffd"


def test_stop_string_split_across_tokens_is_never_streamed(tokenizer: Tokenizer) -> None:
    text = "The answer is 42.</answer> and more"
    ids = tokenizer.encode(text)
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["</answer>"])
    deltas = stream(detokenizer, ids)
    assert "".join(deltas) == "The answer is 42."
    assert detokenizer.stopped and detokenizer.text == "The answer is 42."
    assert all("<" not in d for d in deltas)
    # Tokens after the one completing the stop string are not consumed.
    consumed = next(n for n in range(1, len(ids) + 1) if "</answer>" in tokenizer.decode(ids[:n]))
    assert detokenizer.num_tokens == consumed < len(ids)


def test_held_back_tail_is_released_when_no_stop_follows() -> None:
    detokenizer = IncrementalDetokenizer(ByteDecoder(), [], stop=["STOP"])
    assert detokenizer.add_tokens(byte_tokens("go ST")) == "go "
    assert detokenizer.add_tokens(byte_tokens("A")) == "STA"
    assert detokenizer.add_tokens(byte_tokens("S")) == ""
    assert detokenizer.flush() == "S"
    assert not detokenizer.stopped


def test_stop_hit_inside_one_multi_token_delta() -> None:
    detokenizer = IncrementalDetokenizer(ByteDecoder(), [], stop=["\n\n", "END"])
    assert detokenizer.add_tokens(byte_tokens("line one\n\nline two END")) == "line one"
    assert detokenizer.stopped
    assert detokenizer.num_tokens == len("line one\n\n")
    assert detokenizer.add_tokens(byte_tokens("more")) == "" and detokenizer.flush() == ""


def test_multibyte_stop_string() -> None:
    detokenizer = IncrementalDetokenizer(ByteDecoder(), [], stop=["世界"])
    assert "".join(stream(detokenizer, byte_tokens("你好世界😀"))) == "你好"


@pytest.mark.parametrize("seed", range(30))
def test_random_streams_match_reference(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = ["a", "b", "c", " ", "é", "你", "😀"]
    text = "".join(rng.choice(alphabet) for _ in range(60))
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(0, 3))]
    expected = first_stop_cut(text, stops)
    detokenizer = IncrementalDetokenizer(ByteDecoder(), [], stop=stops)
    sent = ""
    for delta in stream(detokenizer, byte_tokens(text)):
        assert "\ufffd" not in delta
        sent += delta
        assert expected.startswith(sent)
    assert sent == expected
    assert detokenizer.stopped == (expected != text)
