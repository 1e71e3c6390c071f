"""Build a `tokenizers` fast tokenizer from a GGUF's vocabulary: byte-level BPE (`gpt2`) or SentencePiece
(`llama`: Llama 1-2, Mistral 7B, TinyLlama, Gemma).

Byte-level BPE: the pre-tokenizer follows llama.cpp's table for `tokenizer.ggml.pre`
(kvgate/bpe_splits.py): the split decides which merges can ever apply, so using the wrong one changes
token ids for text with digits, punctuation or contractions; a name not in the table is refused.

SentencePiece: llama.cpp (`llm_tokenizer_spm`) splits the text into characters and merges, again and
again, the adjacent pair whose joined text is a vocabulary entry with the highest score (the leftmost
among equals); a character with no entry becomes its UTF-8 bytes' `<0xNN>` tokens. That is BPE with one
merge per way of splitting each entry in two, ranked by the entry's score, plus byte fallback: what
transformers builds for these vocabularies too. Spaces are written as U+2581 and, where the file asks
(`add_space_prefix`, Llama's default), one is put before the text and after each special token.
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from kvgate.bpe_splits import IGNORE_MERGES, SPLITS


def _pre_tokenizer(pre: str):
    """The byte-level BPE split for `tokenizer.ggml.pre` (`bpe_splits.SPLITS`), then the byte mapping."""
    regexes = SPLITS.get(pre)
    if regexes is None:
        raise UnknownPreTokenizer(pre)
    steps = [pre_tokenizers.Split(Regex(r), "isolated") for r in regexes]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps)


class UnknownPreTokenizer(ValueError):
    """A `tokenizer.ggml.pre` kvgate has no split for (`kvgate.models.gguf_tokenizer` says what to do)."""


def spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every split of every entry into two entries, the highest-scoring entry's first; one entry's
    splits by their halves' ids (transformers' `SentencePieceExtractor` order)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found = []
    for piece, score in zip(tokens, scores, strict=True):
        halves = ((vocab.get(piece[:k]), vocab.get(piece[k:])) for k in range(1, len(piece)))
        splits = sorted((a, b) for a, b in halves if a is not None and b is not None)
        found.extend((score, tokens[a], tokens[b]) for a, b in splits)
    found.sort(key=lambda m: -m[0])  # stable: equal scores keep the vocabulary's order
    return [(left, right) for _, left, right in found]


def build_spm_tokenizer(
    tokens: list[str], scores: list[float], token_types: list[int], unk_id: int | None, add_space_prefix: bool
) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    model = models.BPE(
        vocab=vocab, merges=spm_merges(tokens, scores), unk_token=unk, fuse_unk=True, byte_fallback=True
    )
    tok = Tokenizer(model)
    space = normalizers.Replace(" ", "\u2581")
    tok.normalizer = (
        normalizers.Sequence([normalizers.Prepend("\u2581"), space]) if add_space_prefix else space
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:  # the prefix space is not the text's: a whole decode drops it
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    _add_tokens(tok, tokens, token_types, special_types=(2, 3))
    return tok


def build_bpe_tokenizer(tokens: list[str], merges: list[str], token_types: list[int], pre: str) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    ignore = pre in IGNORE_MERGES
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, ignore_merges=ignore))
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    _add_tokens(tok, tokens, token_types, special_types=(3,))
    return tok


def _add_tokens(tok: Tokenizer, tokens: list[str], token_types: list[int], special_types: tuple) -> None:
    """GGUF token types: control (3, e.g. <|im_start|>; and unknown, 2, in SentencePiece files) are
    special; user-defined (4) are matched whole in text too, as llama.cpp does."""
    special = [
        AddedToken(t, special=True, normalized=False)
        for t, k in zip(tokens, token_types, strict=False)
        if k in special_types
    ]
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, k in zip(tokens, token_types, strict=False)
        if k == 4
    ]
    if special:
        tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)
