"""Byte-level BPE splits by `tokenizer.ggml.pre` (kvgate/bpe_splits.py, session 49).

Before, any name but llama3/qwen2/smollm took GPT-2's split, and token ids came out other than the
model's (llama.cpp's own vocabulary test files, texts of digits, punctuation, CJK and mixed scripts:
command-r, deepseek-coder, starcoder and refact 46/47, falcon 38/47, qwen35 47/51). With the table,
all 13 test files here pass (gpt-2, llama-bpe, mpt, qwen2, qwen35, starcoder, refact, command-r,
deepseek-coder, deepseek-llm, falcon, llama-spm, phi-3), and the qwen2 vocabulary relabelled with each
other group's name tokenizes as llama.cpp's `llama-tokenize` does (97 texts each: gpt-2, starcoder,
llama3, qwen35, gpt-4o, tekken, deepseek-llm, deepseek-coder, deepseek-v3, falcon, default,
chatglm-bpe, glm4, dbrx). Those files are not committed; the pieces below are each group's split of
a text that tells it apart from the others, as llama.cpp splits them.
"""

from __future__ import annotations

import pytest

from kvgate.bpe_splits import IGNORE_MERGES, SPLITS
from kvgate.tokenizer import _BYTE_OF
from kvgate.tokenizer_build import UnknownPreTokenizer, _pre_tokenizer


def pieces(pre: str, text: str) -> list[str]:
    """The pre-tokens of `text`, as text (the byte-level mapping undone)."""
    out = _pre_tokenizer(pre).pre_tokenize_str(text)
    return [bytes(_BYTE_OF[c] for c in p).decode("utf-8") for p, _ in out]


CASES = [
    # every digit alone, then GPT-2's (SmolLM2's, StarCoder's): "½" is a number too
    ("smollm", "ied 4 ½ months", ["ied", " ", "4", " ", "½", " months"]),
    ("gpt-2", "ied 4 ½ months", ["ied", " 4", " ½", " months"]),
    # digits in threes (Llama 3) or alone (Qwen2); the letters take no space before a digit
    ("llama3", "pay 12345!", ["pay", " ", "123", "45", "!"]),
    ("qwen2", "pay 12345!", ["pay", " ", "1", "2", "3", "4", "5", "!"]),
    # Tekken and o200k part a word at its case change; Llama 3 does not
    ("tekken", "HTTPServer iPhone", ["HTTPServer", " i", "Phone"]),
    ("gpt-4o", "HTTPServer iPhone's", ["HTTPServer", " i", "Phone's"]),
    ("llama3", "HTTPServer iPhone", ["HTTPServer", " iPhone"]),
    # DeepSeek V3: numbers in threes and CJK runs first
    ("deepseek-v3", "数字12345abc", ["数字", "123", "45", "abc"]),
    # Falcon: punctuation runs first, numbers then cut in threes
    ("falcon", "a+=1234", ["a", "+=", "123", "4"]),
    ("default", "a+=1234", ["a", "+=", "123", "4"]),
    # Qwen3.5 keeps a combining mark with its letter, Qwen2 parts them
    ("qwen35", "cafe\u0301s", ["cafe\u0301s"]),
    ("qwen2", "cafe\u0301s", ["cafe", "\u0301s"]),
]


@pytest.mark.parametrize(("pre", "text", "want"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_each_group_splits_as_llama_cpp_does(pre, text, want):
    """Seen red with the table left out (every name GPT-2's split: all but gpt-2's case failed)."""
    assert pieces(pre, text) == want


def test_an_unknown_name_is_refused_at_load_with_the_way_out(tmp_path):
    """A guessed split gives wrong ids silently; llama.cpp refuses such a file, and so does kvgate, naming
    the name, the known ones and the model's Hugging Face directory. Seen red with the GPT-2 fallback back."""
    import gguf

    from kvgate.models.errors import ModelLoadError
    from kvgate.models.gguf_tokenizer import tokenizer_from_metadata

    with pytest.raises(UnknownPreTokenizer):
        _pre_tokenizer("jais-2")
    path = tmp_path / "vocab.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("jais-2")
    w.add_token_list(["a", "b", "ab"])
    w.add_token_types([1, 1, 1])
    w.add_token_merges(["a b"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    with pytest.raises(ModelLoadError) as err:
        tokenizer_from_metadata(gguf.GGUFReader(str(path)), path)
    assert "'jais-2'" in str(err.value) and "tekken" in str(err.value) and "Hugging Face" in str(err.value)


def test_an_empty_name_is_llama_cpps_default(tmp_path):
    """A file whose `tokenizer.ggml.pre` is there but empty loads with llama.cpp's default split, as a file
    without the key does (llama.cpp warns and uses it). Seen red with the empty name refused."""
    import gguf

    from kvgate.models.gguf_tokenizer import tokenizer_from_metadata

    path = tmp_path / "vocab.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_key_value("tokenizer.ggml.pre", "", gguf.GGUFValueType.STRING)  # (add_tokenizer_pre skips "")
    w.add_token_list(["a", "b", "ab", "+"])
    w.add_token_types([1, 1, 1, 1])
    w.add_token_merges(["a b"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    js, _ = tokenizer_from_metadata(gguf.GGUFReader(str(path)), path)
    assert "[0-9][0-9][0-9]" in js  # the default sequence's last regex


def test_every_name_compiles_and_the_merge_rule_names_known_ones():
    for pre in SPLITS:
        _pre_tokenizer(pre).pre_tokenize_str("Hello, 世界 123 x²!")
    assert IGNORE_MERGES <= set(SPLITS)
