"""Incremental detokenizer: complete characters only, same text as a full decode."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from shared.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from tests.helpers.gateway_support import byte_level_tokenizer_dir, sentencepiece_tokenizer_dir

TEXTS = [
    "Hello world, the quick brown fox.",
    "你好世界，今天天气很好。",
    "Emoji time 😀🎉👍🏽 done",
    "café naïve résumé Ελληνικά русский 𝄞 ok",
    "mixed 天气 and 😀 then English",
]


@pytest.fixture(scope="module")
def byte_tok(tmp_path_factory):
    return AutoTokenizer.from_pretrained(str(byte_level_tokenizer_dir(tmp_path_factory.mktemp("bl"))))


@pytest.fixture(scope="module")
def sp_tok(tmp_path_factory):
    return AutoTokenizer.from_pretrained(str(sentencepiece_tokenizer_dir(tmp_path_factory.mktemp("sp"))))


def byte_level_symbol(byte: int) -> str:
    """The GPT-2 byte-level alphabet: printable latin-1 bytes stand for themselves,
    the others are shifted to code points from 256 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    if byte in printable:
        return chr(byte)
    return chr(256 + [b for b in range(256) if b not in printable].index(byte))


def stream(detok: IncrementalDetokenizer, ids) -> list[str]:
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.flush())
    return pieces


@pytest.mark.parametrize("tok_name", ["byte_tok", "sp_tok"])
@pytest.mark.parametrize("text", TEXTS)
def test_pieces_are_whole_characters_and_join_to_the_text(request, tok_name, text):
    tok = request.getfixturevalue(tok_name)
    ids = tok.encode(text, add_special_tokens=False)
    pieces = stream(IncrementalDetokenizer(tok), ids)
    assert all(REPLACEMENT_CHAR not in p for p in pieces), pieces
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
    assert "".join(pieces) == text


def test_split_character_is_held_until_complete(byte_tok):
    # The tokenizer's merges put the first bytes of 界 with 你好世, its last byte alone.
    ids = byte_tok.encode("你好世界", add_special_tokens=False)
    assert any(REPLACEMENT_CHAR in byte_tok.decode([i]) for i in ids), "tokenizer no longer splits 界"
    detok = IncrementalDetokenizer(byte_tok)
    pieces = [detok.push(i) for i in ids]
    assert pieces[-1].endswith("界")
    assert "".join(pieces) == "你好世界"
    # Something was held back on the way (the piece before the last byte was not "你好世界"[:n]+�).
    assert all(REPLACEMENT_CHAR not in p for p in pieces)


def test_emoji_bytes_one_token_each(byte_tok):
    ids = list(byte_tok.encode("😀", add_special_tokens=False))
    assert len(ids) >= 2, "emoji should span several byte tokens"
    detok = IncrementalDetokenizer(byte_tok)
    pieces = [detok.push(i) for i in ids]
    assert pieces[:-1] == [""] * (len(ids) - 1)
    assert pieces[-1] == "😀"


def test_truncated_character_is_released_only_at_flush(byte_tok):
    ids = byte_tok.encode("ok 😀", add_special_tokens=False)
    cut = ids[:-1]  # generation stopped (max_tokens) in the middle of the emoji
    detok = IncrementalDetokenizer(byte_tok)
    streamed = "".join(detok.push(i) for i in cut)
    assert REPLACEMENT_CHAR not in streamed
    tail = detok.flush()
    assert tail.endswith(REPLACEMENT_CHAR)
    assert streamed + tail == byte_tok.decode(cut)


def test_invalid_bytes_are_not_held_forever(byte_tok):
    # A run of lone continuation bytes never completes a character.
    cont = byte_tok.convert_tokens_to_ids(byte_level_symbol(0x80))
    assert byte_tok.decode([cont]) == REPLACEMENT_CHAR
    hello = byte_tok.encode("Hello", add_special_tokens=False)
    detok = IncrementalDetokenizer(byte_tok)
    out = "".join(detok.push(cont) for _ in range(10))
    assert REPLACEMENT_CHAR in out, "garbage bytes must eventually be released"
    out += detok.push(hello) + detok.flush()
    assert out.endswith("Hello")


def test_prompt_context_keeps_the_leading_space(sp_tok):
    prompt = sp_tok.encode("Hello", add_special_tokens=False)
    answer = sp_tok.encode(" there", add_special_tokens=False)
    answer = [i for i in answer if sp_tok.decode([i]) != ""]  # drop a lone "▁" piece if any
    assert sp_tok.decode(answer[:1]) == "there", "decoding alone strips the space (the problem)"
    detok = IncrementalDetokenizer(sp_tok, prompt_token_ids=prompt)
    assert "".join(stream(detok, answer)) == " there"


def test_special_tokens_skipped_and_window_stays_short(byte_tok):
    eos = byte_tok.eos_token_id
    words = byte_tok.encode("Hello world, the quick brown fox jumps over the lazy dog. " * 5,
                            add_special_tokens=False)
    detok = IncrementalDetokenizer(byte_tok)
    max_window = 0
    text = ""
    for i in words:
        text += detok.push(i)
        max_window = max(max_window, len(detok.token_ids) - detok.prefix_offset)
    text += detok.push(eos) + detok.flush()
    assert text == byte_tok.decode(words)
    assert "<|im_end|>" not in text
    assert max_window <= 4, "decode window must not grow with the output"
    assert detok.num_generated == len(words) + 1
