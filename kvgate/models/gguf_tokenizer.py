"""A GGUF's tokenizer, chat template and end-of-generation ids, from its metadata (`tokenizer.ggml.*`).

`kvgate.models.gguf_loader` writes what this returns into the cache directory (`tokenizer.json` and
`kvgate_tokenizer.json`), so later loads read it as a Hugging Face directory's.
"""

from __future__ import annotations

from pathlib import Path

from kvgate.models.errors import ModelLoadError

# llama.cpp's end-of-generation token texts (its EOG list); any present in the vocab stops generation.
EOG_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<EOT>",
    "<|eom_id|>",
    "<｜end▁of▁sentence｜>",
)

# a GGUF's general.sampling.* keys and the generation_config.json names kvgate reads them as
GGUF_SAMPLING = {
    "temp": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "penalty_repeat": "repetition_penalty",
}


def field(reader, key: str, default=None):
    """A metadata value of a `gguf.GGUFReader`, or `default`."""
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def tokenizer_from_metadata(reader, path: Path) -> tuple[str, dict]:
    from kvgate.bpe_splits import SPLITS
    from kvgate.tokenizer_build import UnknownPreTokenizer, build_bpe_tokenizer, build_spm_tokenizer

    model = field(reader, "tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise ModelLoadError(
            f"{path.name}: "
            + (
                "carries no tokenizer (no tokenizer.ggml.model)"
                if model is None
                else f"tokenizer type '{model}' is not supported yet"
            )
            + " (kvgate reads byte-level BPE, 'gpt2', and SentencePiece, 'llama', from GGUF). Use "
            "a complete GGUF, or the model's Hugging Face directory, which carries tokenizer.json."
        )
    tokens = list(field(reader, "tokenizer.ggml.tokens"))
    token_types = list(field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    if model == "llama":
        scores = field(reader, "tokenizer.ggml.scores")
        if scores is None:
            raise ModelLoadError(
                f"{path.name}: a SentencePiece vocabulary without tokenizer.ggml.scores, which decide "
                "how pieces merge; use a complete GGUF or the model's Hugging Face directory"
            )
        unk = field(reader, "tokenizer.ggml.unknown_token_id")
        prefix = bool(field(reader, "tokenizer.ggml.add_space_prefix", True))  # llama.cpp's default
        tok = build_spm_tokenizer(tokens, [float(x) for x in scores], token_types, unk, prefix)
    else:
        merges = list(field(reader, "tokenizer.ggml.merges", []))
        pre = field(reader, "tokenizer.ggml.pre") or "default"  # absent or empty: llama.cpp's default
        try:
            tok = build_bpe_tokenizer(tokens, merges, token_types, pre)
        except UnknownPreTokenizer:
            raise ModelLoadError(
                f"{path.name}: its vocabulary's pre-tokenizer '{pre}' (tokenizer.ggml.pre) is not one kvgate "
                "knows, and a guessed one would give other token ids than the model was trained on. Use the "
                "model's Hugging Face directory (its tokenizer.json carries the exact pre-tokenizer), or a "
                f"GGUF of the same model converted with one of: {', '.join(sorted(SPLITS))}"
            ) from None
    eos = field(reader, "tokenizer.ggml.eos_token_id")
    bos = field(reader, "tokenizer.ggml.bos_token_id")
    eog = set()
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        v = field(reader, f"tokenizer.ggml.{key}")
        if v is not None:
            eog.add(int(v))
    index = {t: i for i, t in enumerate(tokens)}
    eog.update(index[t] for t in EOG_TEXTS if t in index)
    extra = {
        "chat_template": field(reader, "tokenizer.chat_template"),
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": None if eos is None else int(eos),
        "eog_token_ids": sorted(eog),
        "add_bos_token": bool(field(reader, "tokenizer.ggml.add_bos_token", False)),
        "source": "gguf",
        # llama.cpp's converter writes generation_config.json's sampling as general.sampling.*
        "sampling_defaults": {
            hf: (int(v) if hf == "top_k" else float(v))
            for key, hf in GGUF_SAMPLING.items()
            if (v := field(reader, f"general.sampling.{key}")) is not None
        },
    }
    return tok.to_str(), extra
