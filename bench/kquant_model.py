"""The default SmolLM2 re-quantized into another GGUF recipe, for measuring `--weights gguf` on it.

    python -m bench.kquant_model OUT.gguf [--recipe q4_k_m | q4_0 | q5_1 | q8_0]

No other model can be downloaded here, so this writes the bundled model's values again in the block
types real downloads use. `q4_k_m` follows llama.cpp's `Q4_K_M` choice per tensor: Q6_K for attn_v and
ffn_down on the layers `use_more_bits` picks, Q4_K elsewhere, and llama.cpp's fallback (Q4_K -> Q5_0,
Q6_K -> Q8_0) where a row is not a multiple of 256 values; SmolLM2's 576-wide rows make most of its
matrices Q5_0, as in the SmolLM2-135M Q4_K_M files published. The embeddings keep the file's Q8_0 and
the norms F32. The encoders are plain min/max ones (`bench.kquant_encode`), so the values differ from a
llama.cpp `quantize` run's; the types, shapes and bytes are the same.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize

from bench.kquant_encode import ENCODERS

FALLBACK = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}  # llama.cpp's, for rows not a multiple of 256


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers that get more bits under Q4_K_M."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(name: str, cols: int, recipe: str, n_layers: int) -> str | None:
    """The block type a layer matrix is written in (None: keep the tensor as the file has it)."""
    if not name.startswith("blk.") or not name.endswith(".weight") or "norm" in name:
        return None
    if recipe != "q4_k_m":
        return recipe.upper()
    layer = int(name.split(".")[1])
    more = name.endswith(("attn_v.weight", "ffn_down.weight")) and use_more_bits(layer, n_layers)
    kind = "Q6_K" if more else "Q4_K"
    return kind if cols % 256 == 0 else FALLBACK[kind]


def encode(arr: np.ndarray, kind: str) -> np.ndarray:
    return ENCODERS[kind](arr) if kind in ENCODERS else quantize(arr, GGMLQuantizationType[kind])


def write(src: Path, out: Path, recipe: str) -> dict[str, int]:
    reader = GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    n_layers = int(reader.fields[f"{arch}.block_count"].contents())
    w = GGUFWriter(str(out), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        w.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    counts: dict[str, int] = {}
    for t in reader.tensors:
        rows_cols = [int(d) for d in reversed(t.shape)]
        kind = tensor_type(t.name, rows_cols[-1], recipe, n_layers)
        if kind is None:
            if t.tensor_type.name in ("F32", "F16"):
                w.add_tensor(t.name, np.asarray(t.data))
            else:  # the blocks' bytes, [rows, bytes a row]: gguf derives the shape
                w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
            kind = t.tensor_type.name
        else:
            arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(rows_cols)
            w.add_tensor(t.name, encode(arr, kind), raw_dtype=GGMLQuantizationType[kind])
        counts[kind] = counts.get(kind, 0) + 1
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return counts


def main(argv: list[str] | None = None) -> int:
    from kvgate.models import resolve_model_path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--recipe", default="q4_k_m", choices=["q4_k_m", "q4_0", "q5_1", "q8_0"])
    args = ap.parse_args(argv)
    counts = write(resolve_model_path("default"), args.out, args.recipe)
    print(f"wrote {args.out} ({args.out.stat().st_size / 2**20:.1f} MiB): {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
