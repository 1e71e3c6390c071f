"""How a byte-level BPE vocabulary from GGUF splits text before merging: `tokenizer.ggml.pre` -> regexes.

The split decides which merges can ever apply, so the wrong one gives other token ids than the model
was trained on (for text with digits, punctuation, CJK or contractions), and nothing fails: quality
just drops. llama.cpp keeps a table from each `tokenizer.ggml.pre` name its converter writes to the
regexes of that model's own tokenizer.json, applied one after the other (each splits the pieces the
one before left; text no match covers stays a piece of its own). `SPLITS` is that table, as the
models' tokenizer.json files write the regexes (llama.cpp rewrites a few for its own regex engine);
`tokenizers`' `Split(..., "isolated")` applies them the same way. A name not in it is refused at load
(`kvgate.models.gguf_tokenizer`), as llama.cpp refuses it: the model's Hugging Face directory carries
its exact pre-tokenizer in tokenizer.json. Checked against llama.cpp's vocabulary test files
(tests/test_bpe_splits.py).
"""

from __future__ import annotations

_CONTRACTIONS = "'s|'t|'re|'ve|'m|'ll|'d"
GPT2 = rf"{_CONTRACTIONS}| ?\p{{L}}+| ?\p{{N}}+| ?[^\s\p{{L}}\p{{N}}]+|\s+(?!\S)|\s+"
LLAMA3 = (
    rf"(?i:{_CONTRACTIONS})|[^\r\n\p{{L}}\p{{N}}]?\p{{L}}+|\p{{N}}{{1,3}}| ?[^\s\p{{L}}\p{{N}}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = (
    rf"(?i:{_CONTRACTIONS})|[^\r\n\p{{L}}\p{{N}}]?\p{{L}}+|\p{{N}}| ?[^\s\p{{L}}\p{{N}}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN35 = (  # Qwen2's, with combining marks kept with their letters
    rf"(?i:{_CONTRACTIONS})|[^\r\n\p{{L}}\p{{N}}]?[\p{{L}}\p{{M}}]+|\p{{N}}| ?[^\s\p{{L}}\p{{M}}\p{{N}}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
TEKKEN = (  # Mistral Nemo, Small 3.x, Devstral, Ministral, Pixtral's Tekken vocabulary
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*|\p{{N}}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GPT4O = (  # o200k's split: Llama 4, MiniMax M2
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+(?i:{_CONTRACTIONS})?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*(?i:{_CONTRACTIONS})?|\p{{N}}{{1,3}}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# DeepSeek's classes as its tokenizer.json writes them, escaped: an editor's Unicode normalization
# would silently turn some of their characters (U+1F7D, U+2126, U+212A) into others
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_CJK_KANA = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
_DEEPSEEK_PUNCT = "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"
_DEEPSEEK_LETTERS = (
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
    "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
    "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
    "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-"
    "\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17"
    "\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb"
    "\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+"
)
DEEPSEEK_V3 = (
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_GROUPS: dict[tuple[str, ...], list[str]] = {
    ("gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4", "gigachat"): [GPT2],
    ("jina-es", "jina-de", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum", "modern-bert"): [GPT2],
    ("jina-v1-en", "jina-v2-code", "roberta-bpe"): [GPT2],
    # every digit alone, then GPT-2's split (SmolLM's, StarCoder's)
    ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"): [
        r"\p{N}",
        GPT2,
    ],
    ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"): [LLAMA3],
    ("jina-v5-nano", "dbrx", "smaug-bpe", "chatglm-bpe", "glm4", "glm5"): [LLAMA3],
    ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open"): [
        QWEN2
    ],
    ("qwen35",): [QWEN35],
    ("tekken",): [TEKKEN],
    ("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"): [GPT4O],
    ("deepseek-llm",): [
        r"[\r\n]",
        _DEEPSEEK_LETTERS,
        _DEEPSEEK_PUNCT,
        r"\s+$",
        _CJK,
        r"\p{N}+",
    ],
    ("deepseek-coder",): [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"],
    ("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"): [r"\p{N}{1,3}", _CJK_KANA, DEEPSEEK_V3],
    # Seed-Coder: Qwen2's with newlines kept out of punctuation runs
    ("seed-coder",): [
        rf"(?i:{_CONTRACTIONS})|[^\r\n\p{{L}}\p{{N}}]?\p{{L}}+|\p{{N}}| ?[^\s\p{{L}}\p{{N}}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
    ],
    ("viking",): [" ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+", r"\p{N}"],
    ("minicpm5",): [
        r"\p{N}{1,3}",
        rf"(?i:{_CONTRACTIONS})|[^\r\n\p{{L}}\p{{N}}]?\p{{L}}+|\p{{N}}+| ?[^\s\p{{L}}\p{{N}}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ],
    ("falcon",): [r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]"],
    # a file that names none: llama.cpp's default, which it loads with a warning that quality may drop
    ("default",): [r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"],
}
SPLITS: dict[str, list[str]] = {name: regexes for names, regexes in _GROUPS.items() for name in names}

# llama.cpp takes a pre-token that is a whole vocabulary entry as one token before any merge for these
# (Llama 3's tokenizer.json says so too): without it, " Việt" was 3 tokens where Llama 3 has one
IGNORE_MERGES = frozenset(
    {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"}
    | {"jina-v5-nano", "tekken", "glm4", "glm5", "minicpm5"}
)
