"""SentencePiece vocabularies read from a GGUF (`tokenizer.ggml.model` = `llama`: Llama 1-2, Mistral 7B,
TinyLlama, Gemma) tokenize as SentencePiece itself does.

The test trains small SentencePiece BPE models (the type Llama's and Gemma's are) with byte fallback,
writes their pieces, scores and types into a GGUF as llama.cpp's converter does, and compares kvgate's
ids and decoded text with the `sentencepiece` library's on generated text: ASCII, accents, CJK, emoji
(byte fallback), runs of spaces, tabs and newlines, and the user-defined pieces a file matches whole.

Off the machine of this test, on llama.cpp's own vocabulary test files (`ggml-vocab-llama-spm.gguf`,
`ggml-vocab-phi-3.gguf` with their expected ids; not in the repository) kvgate gave 47 of 47 texts each,
and on the real Gemma 3 270M GGUF 2,351 of 2,351 texts as transformers' converted tokenizer.

Seen red: merges taken lowest score first; the space prefix always added (the Gemma-style case); no byte fallback (emoji become
`<unk>`); the decoder's Strip left out (a leading space on every decode).
"""

from __future__ import annotations

import io
import random

import gguf
import pytest
import sentencepiece as spm

from kvgate.models.gguf_tokenizer import tokenizer_from_metadata
from kvgate.models.hf_loader import TokenizerInfo
from kvgate.tokenizer import IncrementalDetokenizer, TextTokenizer

CORPUS_WORDS = (
    "the model reads every byte it will need before a request is admitted and the queue answers early "
    "tokens merge into pieces while rare characters fall back to bytes numbers 12345 and 67890 "
    "Straße café naïve résumé über 東京 中文 字 ok done"
).split()
ALPHABET = "abcdefghijklmnop ABC  \n\n\t0123456789.,!?'\"éüñ中文字東京🦙ßœ—<>_-/\\"


def _train(user_symbols: list[str], dummy_prefix: bool):
    rng = random.Random(1)
    lines = [" ".join(rng.choice(CORPUS_WORDS) for _ in range(12)) for _ in range(400)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        model_type="bpe",
        vocab_size=400,
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=dummy_prefix,
        split_digits=False,
        user_defined_symbols=user_symbols,
        allow_whitespace_only_pieces=True,
        minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def _gguf_type(sp, i: int, user: list[str]) -> int:  # llama.cpp's converter's mapping of piece kinds
    if sp.IsUnknown(i):
        return 2
    if sp.IsControl(i):
        return 3
    if sp.IsByte(i):
        return 6
    if sp.IsUnused(i):
        return 5
    return 4 if sp.IdToPiece(i) in user else 1


def _write(sp, path, add_space_prefix: bool, user: list[str]):
    n = sp.GetPieceSize()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list([sp.IdToPiece(i) for i in range(n)])
    w.add_token_scores([sp.GetScore(i) for i in range(n)])
    w.add_token_types([_gguf_type(sp, i, user) for i in range(n)])
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_add_space_prefix(add_space_prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()


@pytest.fixture(scope="module", params=["llama", "gemma"])
def pair(request, tmp_path_factory):
    """(sentencepiece processor, kvgate's tokenizer from the GGUF, user-defined pieces) for a Llama-style
    vocabulary (space prefix, no user pieces) and a Gemma-style one (no prefix, whitespace pieces)."""
    llama = request.param == "llama"
    user = [] if llama else ["\n\n", "\t\t", "<tool>"]
    sp = _train(user, dummy_prefix=llama)
    path = tmp_path_factory.mktemp("spm") / "vocab.gguf"
    _write(sp, path, add_space_prefix=llama, user=user)
    tok_json, extra = tokenizer_from_metadata(gguf.GGUFReader(path), path)
    info = TokenizerInfo(
        tokenizer_json=tok_json,
        chat_template=None,
        bos_token_id=extra["bos_token_id"],
        eos_token_id=extra["eos_token_id"],
        eog_token_ids=extra["eog_token_ids"],
        add_bos_token=False,
    )
    return sp, TextTokenizer(info), user


def _texts(seed: int, user: list[str]) -> list[str]:
    rng = random.Random(seed)
    out = ["", " ", "  leading spaces", "trailing  ", "Hello world", "a\n\nb\t\tc <tool> d", "🦙🦙 東京"]
    out += ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 50))) for _ in range(400)]
    out += [" ".join(rng.choice(CORPUS_WORDS + user) for _ in range(rng.randint(1, 15))) for _ in range(200)]
    return out


def _expected(sp, text: str, user: list[str]) -> list[int]:
    """sentencepiece's ids. It matches user-defined pieces inside its own encode; llama.cpp (and kvgate)
    cut the text at them first, so the pieces between are encoded on their own (no difference when the
    vocabulary has none)."""
    if not user:
        return sp.encode(text)
    ids, rest = [], text
    while rest:
        at = min(((rest.find(u), -len(u), u) for u in user if u in rest), default=None)
        if at is None:
            return ids + sp.encode(rest)
        pos, _, u = at
        ids += (sp.encode(rest[:pos]) if pos else []) + [sp.PieceToId(u)]
        rest = rest[pos + len(u) :]
    return ids


def test_ids_are_sentencepieces_on_generated_text(pair):
    sp, tok, user = pair
    wrong = [(t, tok.encode(t), _expected(sp, t, user)) for t in _texts(0, user)]
    wrong = [w for w in wrong if w[1] != w[2]]
    assert not wrong, f"{len(wrong)} texts differ, first: {wrong[0]!r}"


def test_byte_fallback_is_used_for_characters_outside_the_vocabulary(pair):
    sp, tok, _ = pair
    ids = tok.encode("🦙")
    assert all(tok.token_text(i).startswith("<0x") for i in ids[-4:]), [tok.token_text(i) for i in ids]
    assert tok.decode(ids) == sp.decode(ids) == "🦙"


def test_decoded_text_is_sentencepieces(pair):
    sp, tok, user = pair
    for text in _texts(1, user)[:300]:
        ids = _expected(sp, text, user)
        assert tok.decode(ids) == sp.decode(ids), text


def test_streamed_text_is_the_whole_decode(pair):
    """What a stream sends token by token (`IncrementalDetokenizer` after a BOS prompt) is the whole
    decode: the prefix space dropped once at the start, byte-fallback characters sent whole."""
    sp, tok, user = pair
    for text in _texts(2, user)[:200]:
        ids = _expected(sp, text, user)
        det = IncrementalDetokenizer(tok, [sp.bos_id()])
        streamed = "".join(det.push(i) for i in ids) + det.flush()
        assert streamed == tok.decode(ids), text
