"""IncrementalDetokenizer: streamed text equals a full decode; stop strings across tokens."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from engine.detokenizer import IncrementalDetokenizer
from engine.request import SamplingParams

# Merges that split UTF-8 characters in awkward places: a whole 2-byte char (é), the last two
# bytes of a 3-byte char (中), the first two bytes of an emoji, ASCII + a lead byte, " t".
_MERGED_BYTE_PAIRS = [(0xC3, 0xA9), (0xB8, 0xAD), (0xF0, 0x9F), (ord("a"), 0xE4), (0x20, 0x74)]


def _byte_chars() -> list[str]:
    """GPT-2 style printable stand-in for each byte, indexed by byte value."""
    printable = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    chars: list[str] = []
    num_remapped = 0
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + num_remapped))
            num_remapped += 1
    return chars


def _build_tokenizer() -> PreTrainedTokenizerFast:
    chars = _byte_chars()
    vocab = {char: byte for byte, char in enumerate(chars)}
    merges = []
    for first, second in _MERGED_BYTE_PAIRS:
        merges.append((chars[first], chars[second]))
        vocab[chars[first] + chars[second]] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        clean_up_tokenization_spaces=False,
    )


TOKENIZER = _build_tokenizer()
EOS = TOKENIZER.eos_token_id
PROMPT = TOKENIZER.encode("Hello there")
PARAMS = SamplingParams()


def _stream(
    text_or_ids: str | list[int],
    params: SamplingParams = PARAMS,
    chunks: list[int] | None = None,
    skip_special_tokens: bool = True,
) -> tuple[list[str], str | None, str]:
    """Feed tokens in chunks (one at a time by default); return (deltas, stop_str, flushed)."""
    ids = TOKENIZER.encode(text_or_ids) if isinstance(text_or_ids, str) else text_or_ids
    detok = IncrementalDetokenizer(TOKENIZER, PROMPT, params, skip_special_tokens)
    deltas: list[str] = []
    sizes = iter(chunks or [])
    pos = 0
    while pos < len(ids):
        size = max(1, next(sizes, 1))
        update = detok.update(ids[pos : pos + size])
        pos += size
        deltas.append(update.text_delta)
        if update.finished:
            return deltas, update.stop_str, detok.flush()
    return deltas, None, detok.flush()


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=40), chunks=st.lists(st.integers(1, 4), max_size=40))
def test_round_trip_random_unicode(text: str, chunks: list[int]) -> None:
    ids = TOKENIZER.encode(text)
    deltas, stop_str, flushed = _stream(ids, chunks=chunks)
    assert stop_str is None
    assert "".join(deltas) + flushed == TOKENIZER.decode(ids) == text
    # Never emit a replacement character for a character that is merely incomplete.
    assert all("\ufffd" not in d for d in deltas) or "\ufffd" in text


@settings(max_examples=150, deadline=None)
@given(
    ids=st.lists(st.integers(0, len(TOKENIZER) - 1), max_size=30),
    skip_special_tokens=st.booleans(),
)
def test_round_trip_arbitrary_ids(ids: list[int], skip_special_tokens: bool) -> None:
    """Invalid UTF-8 and special tokens included: still equal to one full decode."""
    deltas, _, flushed = _stream(ids, skip_special_tokens=skip_special_tokens)
    expected = TOKENIZER.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) + flushed == expected


@pytest.mark.parametrize("text", ["😀", "a中文", "é😀中", "🇫🇷👩‍👩‍👧"])
def test_split_characters_wait_for_their_bytes(text: str) -> None:
    deltas, _, flushed = _stream(text)
    assert flushed == ""
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # some token alone ended in half a character


def test_truncated_character_surfaces_on_flush() -> None:
    ids = TOKENIZER.encode("ok😀")[:-1]  # drop the emoji's last byte
    deltas, _, flushed = _stream(ids)
    assert "".join(deltas) == "ok"
    assert flushed == "\ufffd" and "".join(deltas) + flushed == TOKENIZER.decode(ids)


def test_output_text_accumulates() -> None:
    detok = IncrementalDetokenizer(TOKENIZER, PROMPT, PARAMS)
    for token_id in TOKENIZER.encode("streamed ☃"):
        detok.update([token_id])
    detok.flush()
    assert detok.output_text == "streamed ☃" and detok.finished


def test_no_prompt() -> None:
    detok = IncrementalDetokenizer(TOKENIZER, [], PARAMS)
    assert detok.update(TOKENIZER.encode("hi")).text_delta == "hi"


def test_stop_terminated_drops_the_eos_text() -> None:
    detok = IncrementalDetokenizer(TOKENIZER, PROMPT, PARAMS, skip_special_tokens=False)
    assert detok.update(TOKENIZER.encode("end")).text_delta == "end"
    assert detok.update([EOS], stop_terminated=True).text_delta == ""
    assert detok.flush() == "" and detok.output_text == "end"


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundaries(include: bool) -> None:
    params = SamplingParams(stop=("STOP",), include_stop_str_in_output=include)
    deltas, stop_str, flushed = _stream("abc STOP def", params)
    assert stop_str == "STOP"
    assert "".join(deltas) == ("abc STOP" if include else "abc ")
    assert flushed == ""
    # The possible stop prefix was held back, never streamed early.
    assert not any("S" in d for d in deltas[:-1])


def test_hold_back_is_released_when_the_prefix_breaks() -> None:
    params = SamplingParams(stop=("abc",))
    detok = IncrementalDetokenizer(TOKENIZER, PROMPT, params)
    assert detok.update(TOKENIZER.encode("xa")).text_delta == "x"
    assert detok.update(TOKENIZER.encode("b")).text_delta == ""
    update = detok.update(TOKENIZER.encode("d"))
    assert update.text_delta == "abd" and not update.finished


def test_flush_returns_held_back_text() -> None:
    params = SamplingParams(stop=("abc",))
    deltas, stop_str, flushed = _stream("xyzab", params)
    assert stop_str is None
    assert "".join(deltas) == "xyz" and flushed == "ab"


def test_match_inside_one_update_truncates_following_text() -> None:
    params = SamplingParams(stop=("\n\n",))
    detok = IncrementalDetokenizer(TOKENIZER, PROMPT, params)
    update = detok.update(TOKENIZER.encode("para one\n\npara two"))
    assert (update.text_delta, update.stop_str, update.finished) == ("para one", "\n\n", True)
    assert detok.update(TOKENIZER.encode("more")) == update.__class__("", None, True)
    assert detok.flush() == ""


def test_earliest_completed_stop_string_wins() -> None:
    params = SamplingParams(stop=("bcd", "c"))
    detok = IncrementalDetokenizer(TOKENIZER, PROMPT, params)
    update = detok.update(TOKENIZER.encode("abcd"))
    assert update.stop_str == "c" and update.text_delta == "ab"


def test_multibyte_stop_string_split_across_byte_tokens() -> None:
    params = SamplingParams(stop=("中文",), include_stop_str_in_output=True)
    deltas, stop_str, _ = _stream("好的中文吗", params)
    assert stop_str == "中文" and "".join(deltas) == "好的中文"


@settings(max_examples=100, deadline=None)
@given(
    text=st.text(alphabet="ab😀中 ", max_size=30),
    stop=st.text(alphabet="ab😀中 ", min_size=1, max_size=4),
    include=st.booleans(),
    chunks=st.lists(st.integers(1, 3), max_size=30),
)
def test_stop_string_property(text: str, stop: str, include: bool, chunks: list[int]) -> None:
    params = SamplingParams(stop=(stop,), include_stop_str_in_output=include)
    deltas, stop_str, flushed = _stream(text, params, chunks)
    position = text.find(stop)
    if position < 0:
        assert stop_str is None and "".join(deltas) + flushed == text
    else:
        end = position + len(stop) if include else position
        assert stop_str == stop and "".join(deltas) == text[:end] and flushed == ""
