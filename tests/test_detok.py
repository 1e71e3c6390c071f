"""Incremental detokenization (`kvgate.tokenizer.IncrementalDetokenizer`): text is released only when
final, so a character split across byte tokens never comes out broken, and the pieces always add up
to the full decode."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.models import load_model
from kvgate.tokenizer import IncrementalDetokenizer, TextTokenizer

TEXTS = {
    "one-accent": "é",
    "accents": "naïve café, crème brûlée à la façon de Zoë",
    "cjk": "你好，世界！日本語のテキスト",
    "emoji": "emoji 🙂👍🏽🇫🇷 and a family 👨‍👩‍👧",
    "scripts": "mixed: Ελληνικά, русский, עברית, हिन्दी ✓",
}


@pytest.fixture(scope="module")
def tiny_tok(tiny_dir):
    return TextTokenizer(load_model(str(tiny_dir)).tokenizer)


@pytest.fixture(scope="module")
def real_tok():
    return TextTokenizer(load_model("default").tokenizer)


def stream(tok: TextTokenizer, ids: list[int], prompt_ids: list[int] | None = None) -> list[str]:
    """Every piece the detokenizer releases, one per pushed token, then the flush."""
    d = IncrementalDetokenizer(tok, prompt_ids or [])
    return [d.push(i) for i in ids] + [d.flush()]


def assert_clean_stream(tok: TextTokenizer, text: str) -> list[str]:
    ids = tok.encode(text)
    pieces = stream(tok, ids)
    for piece in pieces:
        assert "\ufffd" not in piece, f"broken character emitted: {pieces!r}"
    assert "".join(pieces) == tok.decode(ids) == text
    return pieces


@pytest.mark.parametrize("text", TEXTS.values(), ids=TEXTS.keys())
def test_multibyte_characters_split_across_byte_tokens_never_come_out_broken(tiny_tok, text):
    """The tiny vocabulary has no multibyte merges, so every non-ASCII character spans 2-4 tokens.

    Seen to fail when push releases text that ends in U+FFFD (the check removed).
    """
    pieces = assert_clean_stream(tiny_tok, text)
    assert "" in pieces[:-1], "no character was split across tokens: the test would prove nothing"


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40))
def test_any_valid_text_streams_without_broken_characters_and_adds_up(tiny_tok, text):
    """Any text, including a literal U+FFFD (which may then appear in a piece, legitimately).

    Seen to fail when push marks held bytes as read (the completed character comes out broken), and
    when a character split across tokens is released early.
    """
    ids = tiny_tok.encode(text)
    pieces = stream(tiny_tok, ids)
    if "\ufffd" not in text:
        assert all("\ufffd" not in p for p in pieces), pieces
    assert "".join(pieces) == tiny_tok.decode(ids)


def test_text_after_a_prompt_excludes_the_prompt_and_keeps_leading_spaces(tiny_tok):
    """Seen to fail when the read offset starts at 0 (the prompt's tail is released again)."""
    prompt = tiny_tok.encode("<|im_start|>assistant\nin")
    ids = tiny_tok.encode(" the café 🙂 the end")
    pieces = stream(tiny_tok, ids, prompt)
    assert "".join(pieces) == " the café 🙂 the end"
    assert pieces[0] == " the"


def test_special_tokens_release_no_text_and_do_not_block_what_follows(tiny_tok):
    """Seen to fail when special tokens are decoded as text (skip_special_tokens off)."""
    im_end = tiny_tok.encode("<|im_end|>")
    assert len(im_end) == 1
    ids = tiny_tok.encode("ok") + im_end + tiny_tok.encode(" é")
    pieces = stream(tiny_tok, ids)
    assert pieces[len(tiny_tok.encode("ok"))] == ""
    assert "".join(pieces) == "ok é"


def test_an_incomplete_character_at_the_end_is_dropped_not_flushed_as_a_replacement(tiny_tok):
    """Generation can stop after the first bytes of a character (max_tokens): those bytes are no text,
    and flush drops them (vLLM's behaviour) instead of sending U+FFFD. Seen red when flush returned
    the window's decode whole (its last piece was '\ufffd')."""
    for text in ("a你", "ok 🎉", "x\ufffd🎉"):  # the last: a whole U+FFFD before the cut one stays
        ids = tiny_tok.encode(text)
        full = tiny_tok.decode(ids)
        for cut in range(1, len(tiny_tok.encode(text[-1]))):
            pieces = stream(tiny_tok, ids[:-cut])
            assert "".join(pieces) == full[:-1], (text, cut, pieces)


def test_a_whole_replacement_character_the_model_wrote_is_kept(tiny_tok):
    """U+FFFD is a character like any other (bytes EF BF BD): flushed at the end, it stays. Seen red
    when flush dropped any trailing U+FFFD (broken_tail returning 1 whatever the bytes)."""
    ids = tiny_tok.encode("a\ufffd")
    assert len(ids) == 4  # "a" and the three bytes: held back by push, released by flush
    pieces = stream(tiny_tok, ids)
    assert pieces == ["a", "", "", "", "\ufffd"]
    assert tiny_tok.broken_tail(ids) == 0 and tiny_tok.broken_tail(ids[:-1]) == 1


def test_special_tokens_after_a_cut_character_do_not_hide_it(tiny_tok):
    """decode() leaves special tokens out, so the bytes checked leave them out too: a character cut
    then an end-of-turn token still drops the broken tail. Seen red when special tokens' text counted
    (the tail then ended in '<|im_end|>', complete)."""
    ids = tiny_tok.encode("é")[:1] + tiny_tok.encode("<|im_end|>")
    assert stream(tiny_tok, ids) == ["", "", ""]


@settings(max_examples=100, deadline=None)
@given(st.text(min_size=1, max_size=20), st.data())
def test_output_cut_anywhere_never_ends_in_a_broken_character(tiny_tok, text, data):
    """Whatever token generation stops at, the pieces are a prefix of the text (a cut character is
    left out, not replaced). Seen red with flush's drop removed."""
    ids = tiny_tok.encode(text)
    ids = ids[: data.draw(st.integers(min_value=0, max_value=len(ids)))]
    joined = "".join(stream(tiny_tok, ids))
    assert text.startswith(joined), (text, joined)
    assert len(tiny_tok.encode(joined)) >= len(ids) - 3  # at most one character's bytes left out


@pytest.mark.slow
@pytest.mark.parametrize("text", [*TEXTS.values(), "Hi! Привет мир. 😀😃😄 — ok ✨🚀"], ids=[*TEXTS, "more"])
def test_real_tokenizer_streams_emoji_cjk_and_accents_without_broken_characters(real_tok, text):
    """SmolLM2's byte-level BPE splits rarer characters (emoji, CJK) into byte tokens.

    Seen to fail when push releases text that ends in U+FFFD.
    """
    assert_clean_stream(real_tok, text)


@pytest.mark.slow
def test_real_tokenizer_splits_some_characters_across_tokens(real_tok):
    """The real-tokenizer test above only means something if some token is a partial character."""
    ids = real_tok.encode("".join(TEXTS.values()))
    assert any("\ufffd" in real_tok.decode([i]) for i in ids)
