"""GGUF -> the one in-memory format (an HF-style directory), cached on disk.

Reading a GGUF with the `gguf` package costs seconds (its Python metadata parser and the numpy
dequantizers), so the first load converts the file into an HF-style directory -- `config.json`,
`tokenizer.json`, `kvgate_tokenizer.json` (chat template, end-of-generation ids) and
`model.safetensors` with float32 weights under HF names -- and every later load reads that directory
through `hf_loader`. The cache key hashes the file's path, size, mtime and its first and last MiB, so
a changed file gets a new entry.

Weight layout notes:
- GGUF lists dimensions fastest-first; `gguf`'s reader already returns numpy arrays in row-major
  order, so a weight comes out as [out_features, in_features] like torch's.
- llama.cpp's converter permutes attn_q/attn_k rows so rotary pairs are adjacent (GPT-J style). We
  undo that permutation so the model can use the HF rotate-half RoPE for every source format. It does
  so only for Llama-style architectures (`PERMUTED_QK_ARCHS`): Qwen2 and Qwen3 GGUFs keep HF order.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvgate.models.errors import SUPPORTED_ARCHITECTURES, ModelLoadError
from kvgate.models.gemma_config import gguf_config
from kvgate.models.gguf_cache import settle
from kvgate.models.gguf_names import _hf_name, _unpermute
from kvgate.models.gguf_scales import LAYOUTS, SCALES_FILE, block_scales
from kvgate.models.gguf_tokenizer import field, tokenizer_from_metadata

log = logging.getLogger("kvgate.models")

CACHE_FORMAT = 8  # bumped when the output changes (2: Qwen2 q/k kept, Llama q/k biases unpermuted; 4: scales;
# 5: Llama 3 tokenizers ignore merges for whole-vocabulary words, rope scaling and Qwen3 read; 6: the head's
# block scales written; 7: general.sampling.* kept; 8: every tokenizer.ggml.pre's own split, bpe_splits)
# llama.cpp permutes q/k rows (weights and biases) only for architectures it runs with GPT-J style
# RoPE; Qwen2 and Qwen3 use NeoX (rotate-half) RoPE and are written in HF order, untouched.
PERMUTED_QK_ARCHS = ("llama", "mistral", "smollm")
# Quantization types we accept, all dequantized by `gguf.quants.dequantize`.
SUPPORTED_QUANTS = ("F32 F16 BF16 F64 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q2_K Q3_K Q4_K Q5_K Q6_K Q8_K").split()


def cache_root() -> Path:
    return Path(os.environ.get("KVGATE_CACHE_DIR", Path.home() / ".cache" / "kvgate"))


def cache_key(path: Path) -> str:
    st = path.stat()
    h = hashlib.sha256(f"{CACHE_FORMAT}|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        if st.st_size > 2 << 20:
            f.seek(-(1 << 20), os.SEEK_END)
            h.update(f.read(1 << 20))
    return h.hexdigest()[:24]


def convert_to_cache(path: Path) -> Path:
    """Return a cached HF-style directory for this GGUF file, converting it on first use."""
    if not path.is_file():
        raise ModelLoadError(
            f"model file not found: {path}. Pass --model default for the bundled SmolLM2, "
            "a .gguf file, or a Hugging Face directory with config.json and *.safetensors."
        )
    target = cache_root() / f"gguf-{cache_key(path)}"
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        _convert(path, tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another process won the race; its copy is as good as ours
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            settle(target, path)  # records the source, removes its older versions' entries, logs
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _open_reader(path: Path):
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except Exception as exc:  # the reader raises ValueError, struct.error, IndexError... on bad bytes
        raise ModelLoadError(
            f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc}). It may be truncated or "
            "corrupt: download it again and compare its size and checksum with the source."
        ) from exc


class _Progress:
    """Progress of a first conversion: a bar redrawn on stderr at most 10 times a second when stderr is
    a terminal, otherwise a log line at the start and one every 10 s; a line ends with the tensor and
    byte counts done. Used as a context manager so the bar's line is ended even when conversion fails."""

    def __init__(self, name: str, sizes: list[int]):
        self.name, self.total, self.total_bytes = name, len(sizes), sum(sizes)
        self.done = self.done_bytes = 0
        self.tty = sys.stderr.isatty()
        self.last = time.monotonic()
        log.info(
            "converting %s into the cache (first use only): %d tensors, %.1f MiB",
            name,
            self.total,
            self.total_bytes / 2**20,
        )

    def __enter__(self):
        return self

    def step(self, nbytes: int) -> None:
        self.done += 1
        self.done_bytes += nbytes
        now = time.monotonic()
        if now - self.last < (0.1 if self.tty else 10.0) and self.done < self.total:
            return
        self.last = now
        counts = (
            f"{self.done}/{self.total} tensors, "
            f"{self.done_bytes / 2**20:.1f}/{self.total_bytes / 2**20:.1f} MiB"
        )
        if self.tty:
            filled = 30 * self.done_bytes // max(self.total_bytes, 1)
            sys.stderr.write(f"\rconverting {self.name} [{'#' * filled}{'.' * (30 - filled)}] {counts}")
            sys.stderr.flush()
        elif self.done < self.total:
            log.info("converting %s: %s", self.name, counts)

    def __exit__(self, *exc) -> None:
        if self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _convert(path: Path, out: Path) -> None:
    from gguf.quants import dequantize

    reader = _open_reader(path)
    arch = field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{path.name}: architecture '{arch}' is not supported. Supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (Llama-family decoders and Gemma 3)."
        )
    cfg = _config_from_metadata(reader, arch, path)
    _rope_config(reader, arch, path, cfg)
    window = field(reader, f"{arch}.attention.sliding_window")
    if window and int(window) < cfg["max_position_embeddings"]:
        cfg["sliding_window"] = int(window)
    if arch == "gemma3":
        gguf_config(reader, path, cfg)
    tensors = {t.name: t for t in reader.tensors}
    layout = []  # (GGUF name, HF name, row-major shape): the file's header is written before any data
    for name, t in tensors.items():
        qtype = t.tensor_type.name
        if qtype not in SUPPORTED_QUANTS:
            raise ModelLoadError(
                f"{path.name}: tensor {name} uses quantization type {qtype}, which kvgate cannot "
                f"dequantize. Supported: {', '.join(SUPPORTED_QUANTS)}. Re-quantize the model to one of "
                "these (for example Q8_0 or Q4_K_M) or use the original safetensors directory."
            )
        hf_name = _hf_name(name, arch)
        if hf_name is not None:
            # GGUF lists dims fastest-first
            layout.append((name, hf_name, [int(d) for d in reversed(t.shape)]))
    # the layer matrices' and the head's block scales, per 16 values (a matrix of a float type has none)
    scaled = [
        (name, hf, shape)
        for name, hf, shape in layout
        if (hf.endswith("_proj.weight") or hf in ("model.embed_tokens.weight", "lm_head.weight"))
        and len(shape) == 2
        and shape[1] % 32 == 0
        and tensors[name].tensor_type.name in LAYOUTS
    ]
    scale_entries = [(f"{hf}.{part}", [shape[0], shape[1] // 16]) for _, hf, shape in scaled for part in "dm"]
    names = {hf for _, hf, _ in layout}
    if "model.embed_tokens.weight" not in names:
        raise ModelLoadError(f"{path.name}: no token_embd.weight tensor; the file is incomplete.")
    cfg["tie_word_embeddings"] = "lm_head.weight" not in names
    expected = cfg["num_hidden_layers"]
    missing = [i for i in range(expected) if f"model.layers.{i}.self_attn.q_proj.weight" not in names]
    if missing:
        raise ModelLoadError(
            f"{path.name}: metadata says {expected} layers but layer(s) {missing[:5]} have no weights; "
            "the file is incomplete or corrupt. Download it again."
        )
    n_heads, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    t0 = time.monotonic()
    # One tensor at a time, dequantized and written: holding every float tensor for one save_file made
    # a first start's resident peak the whole float checkpoint over its plan (QA pass 6).
    with (
        _Progress(path.name, [t.n_bytes for t in tensors.values()]) as progress,
        _F32Writer(out / "model.safetensors", [(hf, shape) for _, hf, shape in layout]) as writer,
        _F32Writer(out / SCALES_FILE, scale_entries) as scale_writer,
    ):
        scaled_names = {name for name, _, _ in scaled}
        for name, hf_name, shape in layout:
            t = tensors[name]
            try:
                arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
            except Exception as exc:
                raise ModelLoadError(
                    f"{path.name}: tensor {name} ({t.tensor_type.name}) could not be decoded ({exc}); the "
                    "file is probably truncated or corrupt. Download it again."
                ) from exc
            if list(arr.shape) != shape:
                raise ModelLoadError(
                    f"{path.name}: tensor {name} decodes to shape {list(arr.shape)}, its header says {shape}; "
                    "the file is corrupt. Download it again."
                )
            if arch in PERMUTED_QK_ARCHS and name.endswith(("attn_q.weight", "attn_q.bias")):
                arr = _unpermute(arr, n_heads)
            elif arch in PERMUTED_QK_ARCHS and name.endswith(("attn_k.weight", "attn_k.bias")):
                arr = _unpermute(arr, n_kv)
            writer.write(hf_name, arr)
            if name in scaled_names:
                _write_scales(scale_writer, t, name, hf_name, shape, arch, n_heads, n_kv)
            progress.step(t.n_bytes)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    tok_json, extra = tokenizer_from_metadata(reader, path)
    (out / "tokenizer.json").write_text(tok_json)
    (out / "kvgate_tokenizer.json").write_text(json.dumps(extra, indent=1))
    log.info("converted %s in %.1fs", path.name, time.monotonic() - t0)


def _write_scales(writer, t, name: str, hf_name: str, shape: list[int], arch: str, n_heads: int, n_kv: int):
    """A quantized layer matrix's d and m per 16 values, its rows in the float table's order."""
    got = block_scales(t.tensor_type.name, t.data, *shape)
    if got is None:
        raise ModelLoadError(
            f"tensor {name} ({t.tensor_type.name}): its blocks do not cover {shape}; the file is corrupt"
        )
    for part, arr in zip("dm", got):
        if arch in PERMUTED_QK_ARCHS and name.endswith("attn_q.weight"):
            arr = _unpermute(arr, n_heads)
        elif arch in PERMUTED_QK_ARCHS and name.endswith("attn_k.weight"):
            arr = _unpermute(arr, n_kv)
        writer.write(f"{hf_name}.{part}", arr)


class _F32Writer:
    """A .safetensors file of float32 tensors written one at a time: the header (every name, shape and
    offset) first, padded to 8 bytes as the format asks, then each tensor's bytes in header order."""

    def __init__(self, path: Path, entries: list[tuple[str, list[int]]]):
        header, at = {}, 0
        for name, shape in entries:
            n = 4 * int(np.prod(shape, dtype=np.int64))
            header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [at, at + n]}
            at += n
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        self.order = [name for name, _ in entries]
        self.f = open(path, "wb")
        self.f.write(len(raw).to_bytes(8, "little") + raw)

    def write(self, name: str, arr: np.ndarray) -> None:
        if name != self.order.pop(0):
            raise AssertionError(f"tensor {name} written out of the header's order")
        np.ascontiguousarray(arr, dtype=np.float32).tofile(self.f)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.f.close()


def _config_from_metadata(reader, arch: str, path: Path) -> dict:
    def need(key: str):
        v = field(reader, f"{arch}.{key}")
        if v is None:
            raise ModelLoadError(
                f"{path.name}: metadata key {arch}.{key} is missing; the file is incomplete."
            )
        return v

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv_heads = int(field(reader, f"{arch}.attention.head_count_kv", heads))
    vocab = field(reader, f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    head_dim = int(field(reader, f"{arch}.attention.key_length", 0) or hidden // heads)
    rotated = int(field(reader, f"{arch}.rope.dimension_count", head_dim))
    if rotated != head_dim:
        raise ModelLoadError(
            f"{path.name}: RoPE rotates {rotated} of each head's {head_dim} dimensions (partial rotary), "
            "which kvgate does not implement; the output would be silently wrong, so the file is refused."
        )
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "kvgate_source_architecture": arch,
        "name": str(field(reader, "general.name", path.stem)),
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rope_theta": float(field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "rms_norm_eps": float(field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "max_position_embeddings": int(field(reader, f"{arch}.context_length", 2048)),
    }


def _rope_config(reader, arch: str, path: Path, cfg: dict) -> None:
    """RoPE's scaling into `cfg` as an HF config says it (`hf_loader` reads both the same way): a
    `rope_freqs` tensor (llama.cpp's converter writes Llama 3.1's scaling as a factor per frequency), or
    `rope.scaling.type` linear or yarn with their keys. Any other kind, or yarn with settings kvgate does
    not compute, is refused by name: the output would be silently wrong."""
    from gguf.quants import dequantize

    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        values = np.asarray(dequantize(freqs.data, freqs.tensor_type), dtype=np.float32).reshape(-1)
        if values.size != cfg["head_dim"] // 2:
            raise ModelLoadError(
                f"{path.name}: rope_freqs holds {values.size} factors, not one per frequency "
                f"({cfg['head_dim'] // 2}); the file is corrupt."
            )
        cfg["kvgate_rope_freq_factors"] = [float(v) for v in values]
    kind = field(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return

    def key(name: str, default=None):
        return field(reader, f"{arch}.rope.scaling.{name}", default)

    factor = float(key("factor", 1.0))
    plain = {"yarn_ext_factor": (-1.0, 1.0), "yarn_attn_factor": (1.0,), "yarn_log_multiplier": (0.0,)}
    odd = {n: key(n) for n, ok in plain.items() if key(n) is not None and float(key(n)) not in ok}
    if kind not in ("linear", "yarn") or freqs is not None or odd:
        raise ModelLoadError(
            f"{path.name}: RoPE scaling {kind!r}{f' with {odd}' if odd else ''}"
            f"{' and a rope_freqs tensor' if freqs is not None else ''} is not implemented in kvgate; the "
            "output would be silently wrong, so the file is refused. kvgate computes linear and yarn "
            "scaling and llama3's rope_freqs."
        )
    rope = {"rope_type": kind, "rope_theta": cfg.pop("rope_theta"), "factor": factor}
    if kind == "yarn":
        rope["original_max_position_embeddings"] = int(key("original_context_length", 0)) or None
        rope["beta_fast"] = key("yarn_beta_fast")
        rope["beta_slow"] = key("yarn_beta_slow")
    cfg["rope_parameters"] = rope
