"""Build a `tokenizers` fast tokenizer from GGUF's byte-level BPE vocabulary.

The pre-tokenizer follows llama.cpp's table for `tokenizer.ggml.pre`: the split regex decides which
merges can ever apply, so using the wrong one changes token ids for text with digits or contractions.
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

_GPT2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_SPLITS = {
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "llama-bpe": _LLAMA3,
    "smaug-bpe": _LLAMA3,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
}

# llama.cpp (and Llama 3's own tokenizer.json) take a pre-token that is a whole vocabulary entry as one
# token before any merge: without that, " Việt" was 3 tokens where Llama 3 has one (llama.cpp's
# ggml-vocab-llama-bpe.gguf test set, 45 of 46 texts before, 46 after)
IGNORE_MERGES = ("llama3", "llama-v3", "llama-bpe")


def _pre_tokenizer(pre: str):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in _SPLITS:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_SPLITS[pre]), "isolated"), byte_level])
    steps = []
    if pre == "smollm":  # llama.cpp: every digit is its own word, then the GPT-2 split
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    steps.append(pre_tokenizers.Split(Regex(_GPT2), "isolated"))
    steps.append(byte_level)
    return pre_tokenizers.Sequence(steps)


def build_bpe_tokenizer(tokens: list[str], merges: list[str], token_types: list[int], pre: str) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    ignore = pre in IGNORE_MERGES
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, ignore_merges=ignore))
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    # Type 3 (control, e.g. <|im_start|>) is special; type 4 (user-defined) must still match whole.
    special = [
        AddedToken(t, special=True, normalized=False)
        for t, k in zip(tokens, token_types, strict=False)
        if k == 3
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
    return tok
