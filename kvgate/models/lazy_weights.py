"""A checkpoint's tensors read from their .safetensors files when asked for, one at a time.

The engine builds its model by popping each tensor it consumes, and the placement checks each layer
matrix once before that. Holding the whole float checkpoint while it was packed put the load's resident
peak far above `--memory-limit` (SmolLM2 under 720 MiB: ~836 MiB, the float32 table being 520 MB of
it; QA pass 6); read on demand, the load holds one tensor beside what is already built.

Each read goes straight into a tensor of its own (never a memory map: views into a map keep the whole
mapping resident, see `hf_loader.read_safetensors`). A tensor read twice (a check, then the build) is
read twice, from the page cache. The header is checked when the index is made (shapes against byte
counts, the file long enough), so a truncated file is refused at load, as before.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import MutableMapping
from pathlib import Path

import torch

ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def index_safetensors(path: Path) -> dict[str, tuple[Path, int, list[int], torch.dtype]]:
    """name -> (file, byte offset of its data, shape, dtype), checked against the file's length."""
    out = {}
    size = path.stat().st_size
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    base = 8 + n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        dtype = ST_DTYPES[info["dtype"]]
        need = math.prod(info["shape"]) * torch.empty(0, dtype=dtype).element_size()
        if need != end - start:
            raise ValueError(f"tensor {name}: header says {end - start} bytes, shape needs {need}")
        if base + end > size:
            raise ValueError(f"tensor {name} is cut short: the file ends early")
        out[name] = (path, base + start, list(info["shape"]), dtype)
    return out


class LazyWeights(MutableMapping):
    """name -> tensor, read from disk on every access (a fresh tensor of its own each time)."""

    def __init__(self, index: dict[str, tuple[Path, int, list[int], torch.dtype]]):
        self._index = dict(index)

    def __getitem__(self, name: str) -> torch.Tensor:
        path, offset, shape, dtype = self._index[name]
        t = torch.empty(shape, dtype=dtype)
        raw = t.reshape(-1).view(torch.uint8).numpy()
        with open(path, "rb") as f:
            f.seek(offset)
            if f.readinto(memoryview(raw)) != raw.nbytes:
                raise ValueError(f"tensor {name} is cut short: the file ends early")
        return t

    def __setitem__(self, name: str, value) -> None:
        raise TypeError("a checkpoint read from disk is not written to")

    def __delitem__(self, name: str) -> None:
        del self._index[name]

    def __iter__(self):
        return iter(list(self._index))

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, name) -> bool:
        return name in self._index

    def numel(self) -> int:
        """Values in every tensor still listed, from the headers (nothing is read)."""
        return sum(math.prod(shape) for _, _, shape, _ in self._index.values())

    held_bytes = 0  # nothing of the checkpoint sits in memory between reads
